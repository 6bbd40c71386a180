"""Length-prefixed, checksummed frames for the TCP KV transport.

Every frame is a fixed 16-byte header followed by a payload::

    magic  b"SSKV" | version u8 | type u8 | reserved u16 | payload_len u32 | crc32 u32

The CRC covers the payload, so a corrupted or truncated block is detected before the decode
pod uses any byte of it. Control frames carry JSON; BLOCK frames carry a u32 block index
followed by the block's raw bytes. Reads are bounded by a timeout and a maximum payload size
so a stuck or hostile peer cannot hang or exhaust the reader.

The checksum is CRC-32 (zlib's polynomial), an integrity check against corruption, not a MAC
(:mod:`.auth` says who may send). It is computed over every byte on both sides, so its speed
bounds the transfer: with the ``zlib-ng`` package installed the same CRC-32 is computed with
carry-less multiply instructions (tens of GB/s, against about 3 GB/s for the standard
library's zlib). Both compute the same value, so the choice changes no byte on the wire.

Version 1 is the only version; a peer speaking another is refused with a clear
:class:`FrameError` at its first frame. Prefill and decode pods of one InferenceService always
run the same image (its compat hash says so), so a mismatch means a misconfiguration, not a
rolling upgrade to bridge.

The production reader and writer are in :mod:`.wire` (sockets, no copies); :func:`read_frame`
and :func:`write_block` here speak the same format over asyncio streams, for simple peers
(test doubles) and for checking one implementation against the other.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

MAGIC = b"SSKV"
VERSION = 1
HEADER = struct.Struct("!4sBBHII")
BLOCK_INDEX = struct.Struct("!I")
HEADER_SIZE = HEADER.size
BLOCK_HEADER_SIZE = HEADER_SIZE + BLOCK_INDEX.size
"""A BLOCK frame's bytes before the block itself: the header and the block index."""

Crc32 = Callable[[Any, int], int]


def _crc32_implementation() -> tuple[str, Crc32]:
    """zlib-ng's CRC-32 when installed (same polynomial and value, much faster), else zlib's."""
    try:
        module = importlib.import_module("zlib_ng.zlib_ng")
    except ImportError:
        return "zlib", cast(Crc32, zlib.crc32)
    return "zlib-ng", cast(Crc32, module.crc32)


CRC32_IMPLEMENTATION, _crc32 = _crc32_implementation()
"""Which library computes the CRC here ("zlib-ng" or "zlib"): the benchmark prints it."""


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 of ``data`` (any bytes-like object, not copied), continuing from ``value``."""
    return _crc32(data, value)


class FrameType(enum.IntEnum):
    FETCH = 1  # client -> server: JSON {request_id, first_block, layout}
    LAYOUT = 2  # server -> client: JSON {num_blocks, num_tokens, block_nbytes, layout}
    BLOCK = 3  # server -> client: u32 block index + bytes
    DONE = 4  # server -> client: JSON {num_bytes}
    RELEASE = 5  # client -> server: JSON {request_id}: blocks may be freed
    ERROR = 6  # either way: JSON {code, message}


class FrameError(Exception):
    """The peer sent something that is not a valid frame (bad magic, version, size, CRC)."""


@dataclass(frozen=True)
class Frame:
    type: FrameType
    payload: bytes

    def json(self) -> dict[str, Any]:
        try:
            value = json.loads(self.payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FrameError(f"{self.type.name} frame does not hold JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise FrameError(f"{self.type.name} frame holds {type(value).__name__}, not an object")
        return value

    def block(self) -> tuple[int, memoryview]:
        if len(self.payload) < BLOCK_INDEX.size:
            raise FrameError("BLOCK frame shorter than its index")
        (index,) = BLOCK_INDEX.unpack_from(self.payload)
        return index, memoryview(self.payload)[BLOCK_INDEX.size :]


@dataclass(frozen=True)
class Header:
    """A checked frame header: what follows is ``payload_len`` bytes with CRC ``crc``."""

    type: FrameType
    payload_len: int
    crc: int


def encode_header(*, frame_type: FrameType, payload_len: int, crc: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(frame_type), 0, payload_len, crc)


def decode_header(header: bytes | bytearray | memoryview, *, max_payload_bytes: int) -> Header:
    """Check the 16 bytes of a frame header; raises FrameError before any payload is read."""
    magic, version, raw_type, _reserved, payload_len, crc = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r}")
    if version != VERSION:
        raise FrameError(
            f"unsupported frame version {version} (this side speaks {VERSION}; "
            "prefill and decode pods must run the same image)"
        )
    try:
        frame_type = FrameType(raw_type)
    except ValueError as exc:
        raise FrameError(f"unknown frame type {raw_type}") from exc
    if payload_len > max_payload_bytes:
        raise FrameError(f"frame of {payload_len} bytes exceeds the limit of {max_payload_bytes}")
    return Header(type=frame_type, payload_len=payload_len, crc=crc)


def check_crc(header: Header, crc: int) -> None:
    if crc != header.crc:
        raise FrameError(f"{header.type.name} frame failed its CRC check ({header.payload_len} bytes)")


def encode_json(frame_type: FrameType, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    return encode_header(frame_type=frame_type, payload_len=len(payload), crc=crc32(payload)) + payload


def block_header(*, index: int, data: memoryview | bytes) -> bytes:
    """The first :data:`BLOCK_HEADER_SIZE` bytes of the BLOCK frame carrying ``data``; the
    block's bytes follow them on the wire as they are (the CRC reads them, nothing copies them)."""
    prefix = BLOCK_INDEX.pack(index)
    crc = crc32(data, crc32(prefix))
    return encode_header(frame_type=FrameType.BLOCK, payload_len=len(prefix) + len(data), crc=crc) + prefix


def write_block(writer: asyncio.StreamWriter, *, index: int, data: memoryview | bytes) -> int:
    """Queue one BLOCK frame on a stream without copying the block's bytes; returns bytes queued."""
    writer.write(block_header(index=index, data=data))
    writer.write(data)
    return BLOCK_HEADER_SIZE + len(data)


async def read_frame(
    reader: asyncio.StreamReader,
    *,
    timeout_seconds: float,
    max_payload_bytes: int,
) -> Frame:
    """Read and verify one frame from a stream. Raises FrameError, asyncio.TimeoutError or
    asyncio.IncompleteReadError (peer closed mid-frame)."""
    async with asyncio.timeout(timeout_seconds):
        header = decode_header(await reader.readexactly(HEADER_SIZE), max_payload_bytes=max_payload_bytes)
        payload = await reader.readexactly(header.payload_len)
    check_crc(header, crc32(payload))
    return Frame(type=header.type, payload=payload)
