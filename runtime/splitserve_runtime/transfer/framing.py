"""Length-prefixed, checksummed frames for the TCP KV transport.

Every frame is a fixed 16-byte header followed by a payload::

    magic  b"SSKV" | version u8 | type u8 | reserved u16 | payload_len u32 | crc32 u32

The CRC covers the payload, so a corrupted or truncated block is detected before any byte of
it reaches the decode pod's cache. Control frames carry JSON; BLOCK frames carry a u32 block
index followed by the block's raw bytes. Reads are bounded by a timeout and a maximum payload
size so a stuck or hostile peer cannot hang or exhaust the reader.
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

MAGIC = b"SSKV"
VERSION = 1
HEADER = struct.Struct("!4sBBHII")
BLOCK_INDEX = struct.Struct("!I")
HEADER_SIZE = HEADER.size


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


def encode_header(*, frame_type: FrameType, payload_len: int, crc: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(frame_type), 0, payload_len, crc)


def encode_json(frame_type: FrameType, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    return encode_header(frame_type=frame_type, payload_len=len(payload), crc=zlib.crc32(payload)) + payload


def write_block(writer: asyncio.StreamWriter, *, index: int, data: memoryview | bytes) -> int:
    """Queue one BLOCK frame without copying the block's bytes; returns bytes queued."""
    prefix = BLOCK_INDEX.pack(index)
    crc = zlib.crc32(data, zlib.crc32(prefix))
    payload_len = len(prefix) + len(data)
    writer.write(encode_header(frame_type=FrameType.BLOCK, payload_len=payload_len, crc=crc) + prefix)
    writer.write(data)
    return HEADER_SIZE + payload_len


async def read_frame(
    reader: asyncio.StreamReader, *, timeout_seconds: float, max_payload_bytes: int,
) -> Frame:
    """Read and verify one frame. Raises FrameError, asyncio.TimeoutError or
    asyncio.IncompleteReadError (peer closed mid-frame)."""
    async with asyncio.timeout(timeout_seconds):
        header = await reader.readexactly(HEADER_SIZE)
        magic, version, raw_type, _reserved, payload_len, crc = HEADER.unpack(header)
        if magic != MAGIC:
            raise FrameError(f"bad frame magic {magic!r}")
        if version != VERSION:
            raise FrameError(f"unsupported frame version {version} (this side speaks {VERSION})")
        try:
            frame_type = FrameType(raw_type)
        except ValueError as exc:
            raise FrameError(f"unknown frame type {raw_type}") from exc
        if payload_len > max_payload_bytes:
            raise FrameError(f"frame of {payload_len} bytes exceeds the limit of {max_payload_bytes}")
        payload = await reader.readexactly(payload_len)
    if zlib.crc32(payload) != crc:
        raise FrameError(f"{frame_type.name} frame failed its CRC check ({payload_len} bytes)")
    return Frame(type=frame_type, payload=payload)
