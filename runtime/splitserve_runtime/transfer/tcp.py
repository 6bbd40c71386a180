"""The TCP KV transport: a server on the prefill pod's KV port and a pulling client.

One connection moves one request's blocks (pull, as NIXL does in vLLM): the decode pod sends
FETCH with the first block it lacks, the server answers LAYOUT then one BLOCK frame per block,
then DONE; the client answers RELEASE, and only then are the prefill pod's blocks unpinned. A
client that vanishes before RELEASE leaves the export to its lease (it may retry). Back-pressure
comes from awaiting `drain()` after each block, so a slow decode pod never makes the prefill pod
buffer a whole request in memory.

Both ends authenticate (:mod:`.auth`): the server answers nothing but an ERROR to a FETCH
without a valid token, and the client accepts no block before the LAYOUT proved the server
holds the key. The client trusts nothing else the server says either: the LAYOUT's counts
must be consistent with each other, with the request it asked for and with the prompt it
expects, every BLOCK must be the next index with exactly a block's bytes (CRC-checked), and
anything else ends the pull with a :class:`~.connector.TransferError` (the only exception
:meth:`TcpKVConnector.fetch` raises), before the block in question reaches the sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from .auth import HandoffAuth, HandoffRejected
from .connector import BlockSink, FetchResult, KVLayout, TransferError
from .framing import (
    FrameError,
    FrameType,
    encode_json,
    read_frame,
    write_block,
)
from .registry import KVExportRegistry

log = logging.getLogger(__name__)

CONTROL_FRAME_MAX_BYTES = 64 * 1024
PEER_ERROR_CODES = frozenset({"unknown_request", "layout_mismatch", "protocol", "unauthorized"})
"""Codes a server's ERROR frame may carry; any other is reported as ``protocol`` (a peer's
words go into logs and errors only as bounded, known codes and a truncated message)."""
MAX_PEER_MESSAGE_CHARS = 300

TransferObserver = Callable[[int, float, bool], None]
"""Called after each transfer with (bytes moved, seconds, succeeded): feeds the metrics."""


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransferError(code="connect_failed", message=f"bad KV endpoint {endpoint!r} (want host:port)")
    return host.strip("[]"), int(port)


class TcpKVServer:
    """Serves exported KV blocks from `registry`; runs in the prefill pod's event loop."""

    def __init__(
        self, *, registry: KVExportRegistry, layout: KVLayout, host: str, port: int,
        io_timeout_seconds: float = 30.0, observer: TransferObserver | None = None,
        auth: HandoffAuth | None = None,
    ) -> None:
        self._auth = auth if auth is not None else HandoffAuth(key=None)
        self._registry = registry
        self._layout = layout
        self._host = host
        self._port = port
        self._io_timeout_seconds = io_timeout_seconds
        self._observer = observer
        self._server: asyncio.Server | None = None
        self._expiry_task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, *, expiry_interval_seconds: float = 1.0) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        self._expiry_task = asyncio.create_task(self._expire_forever(expiry_interval_seconds))

    async def stop(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _expire_forever(self, interval_seconds: float) -> None:
        while True:
            await asyncio.sleep(interval_seconds)
            expired = self._registry.expire()
            if expired:
                log.warning("freed KV of %d unclaimed request(s) after their lease", expired)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        started = time.perf_counter()
        num_bytes = 0
        ok = False
        try:
            num_bytes = await self._serve_one(reader, writer)
            ok = True
        except (FrameError, TransferError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            log.warning("KV transfer to %s failed: %s", writer.get_extra_info("peername"), exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            if self._observer is not None and (num_bytes or not ok):
                self._observer(num_bytes, time.perf_counter() - started, ok)

    async def _send_error(self, writer: asyncio.StreamWriter, *, code: str, message: str) -> None:
        writer.write(encode_json(FrameType.ERROR, {"code": code, "message": message}))
        await writer.drain()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        frame = await read_frame(
            reader, timeout_seconds=self._io_timeout_seconds, max_payload_bytes=CONTROL_FRAME_MAX_BYTES,
        )
        if frame.type is not FrameType.FETCH:
            raise FrameError(f"expected FETCH, got {frame.type.name}")
        body = frame.json()
        peer = writer.get_extra_info("peername")
        peer_host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        try:  # first: a stranger learns nothing, not even whether the request exists
            nonce = self._auth.check_fetch(body, peer_host=peer_host)
        except HandoffRejected as exc:
            await self._send_error(writer, code="unauthorized", message="FETCH refused: not authenticated")
            raise TransferError(code="unauthorized", message=exc.message) from None
        request_id = str(body.get("request_id", ""))
        first_block = body.get("first_block", 0)
        wanted = KVLayout.from_json(body.get("layout", {}))
        if wanted != self._layout:
            await self._send_error(
                writer, code="layout_mismatch",
                message=f"KV layouts differ (decode vs prefill: {wanted.mismatch(self._layout)}); "
                f"decode wants {wanted}, prefill holds {self._layout}",
            )
            return 0
        exported = self._registry.get(request_id)
        if exported is None:
            await self._send_error(
                writer, code="unknown_request",
                message=f"no KV held for request {request_id!r} (never prefilled here, released, or expired)",
            )
            return 0
        if not isinstance(first_block, int) or not 0 <= first_block <= exported.num_blocks:
            await self._send_error(
                writer, code="protocol",
                message=f"first_block {first_block!r} outside 0..{exported.num_blocks}",
            )
            return 0
        header = {"num_blocks": exported.num_blocks, "num_tokens": exported.num_tokens,
                  "first_block": first_block, "block_nbytes": self._layout.block_nbytes}
        writer.write(encode_json(FrameType.LAYOUT, {
            **header, **self._auth.layout_proof(request_id=request_id, nonce=nonce, header=header)}))
        num_bytes = 0
        for index in range(first_block, exported.num_blocks):
            num_bytes += write_block(writer, index=index, data=exported.read_block(index))
            await writer.drain()
        writer.write(encode_json(FrameType.DONE, {"num_bytes": num_bytes}))
        await writer.drain()
        ack = await read_frame(
            reader, timeout_seconds=self._io_timeout_seconds, max_payload_bytes=CONTROL_FRAME_MAX_BYTES,
        )
        if ack.type is FrameType.RELEASE:
            self._registry.release(request_id)
        return num_bytes


class TcpKVConnector:
    """Pulls one request's blocks over TCP; implements :class:`~.connector.KVConnector`."""

    def __init__(self, *, observer: TransferObserver | None = None,
                 auth: HandoffAuth | None = None) -> None:
        self._observer = observer
        self._auth = auth if auth is not None else HandoffAuth(key=None)

    async def fetch(
        self, *, endpoint: str, request_id: str, first_block: int, layout: KVLayout,
        on_block: BlockSink, timeout_seconds: float, expected_num_tokens: int | None = None,
    ) -> FetchResult:
        started = time.perf_counter()
        try:
            result = await self._fetch(
                endpoint=endpoint, request_id=request_id, first_block=first_block,
                layout=layout, on_block=on_block, timeout_seconds=timeout_seconds,
                expected_num_tokens=expected_num_tokens,
            )
        except TransferError:
            if self._observer is not None:
                self._observer(0, time.perf_counter() - started, False)
            raise
        if self._observer is not None:
            self._observer(result.num_bytes, result.seconds, True)
        return result

    async def _fetch(
        self, *, endpoint: str, request_id: str, first_block: int, layout: KVLayout,
        on_block: BlockSink, timeout_seconds: float, expected_num_tokens: int | None,
    ) -> FetchResult:
        try:
            self._auth.check_endpoint(endpoint)
        except HandoffRejected as exc:
            raise TransferError(code="endpoint_not_allowed", message=exc.message) from None
        host, port = _parse_endpoint(endpoint)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_seconds):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            raise TransferError(code="connect_failed", message=f"{endpoint}: {exc or type(exc).__name__}") from exc
        nonce = self._auth.new_nonce()
        try:
            writer.write(encode_json(FrameType.FETCH, {
                "request_id": request_id, "first_block": first_block, "layout": layout.to_json(),
                **self._auth.fetch_credentials(request_id=request_id, nonce=nonce),
            }))
            await writer.drain()
            return await self._receive(
                reader=reader, writer=writer, request_id=request_id, nonce=nonce,
                first_block=first_block, layout=layout, on_block=on_block,
                timeout_seconds=timeout_seconds, started=started,
                expected_num_tokens=expected_num_tokens,
            )
        except FrameError as exc:
            raise TransferError(code="corrupt", message=str(exc)) from exc
        except HandoffRejected as exc:
            raise TransferError(code="unauthenticated", message=exc.message) from None
        except asyncio.IncompleteReadError as exc:
            raise TransferError(code="truncated", message=f"peer closed after {len(exc.partial)} bytes of a frame") from exc
        except TimeoutError as exc:
            raise TransferError(code="timeout", message=f"no data from {endpoint} within {timeout_seconds}s") from exc
        except OSError as exc:  # reset, broken pipe, ...
            raise TransferError(code="truncated", message=f"connection to {endpoint} lost: {exc}") from exc
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _receive(
        self, *, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request_id: str,
        nonce: str, first_block: int, layout: KVLayout, on_block: BlockSink,
        timeout_seconds: float, started: float, expected_num_tokens: int | None,
    ) -> FetchResult:
        frame = await read_frame(reader, timeout_seconds=timeout_seconds, max_payload_bytes=CONTROL_FRAME_MAX_BYTES)
        if frame.type is FrameType.ERROR:
            body = frame.json()
            code = body.get("code")
            raise TransferError(code=code if code in PEER_ERROR_CODES else "protocol",
                                message=str(body.get("message", ""))[:MAX_PEER_MESSAGE_CHARS])
        if frame.type is not FrameType.LAYOUT:
            raise TransferError(code="protocol", message=f"expected LAYOUT, got {frame.type.name}")
        header = frame.json()
        self._auth.check_layout(header, request_id=request_id, nonce=nonce)  # before any block
        num_blocks, num_tokens = _check_layout_header(header, layout=layout, first_block=first_block,
                                                      expected_num_tokens=expected_num_tokens)
        max_payload = layout.block_nbytes + 64
        num_bytes = 0
        for expected_index in range(first_block, num_blocks):
            frame = await read_frame(reader, timeout_seconds=timeout_seconds, max_payload_bytes=max_payload)
            if frame.type is not FrameType.BLOCK:
                raise TransferError(code="protocol", message=f"expected BLOCK {expected_index}, got {frame.type.name}")
            index, data = frame.block()
            if index != expected_index or len(data) != layout.block_nbytes:
                raise TransferError(
                    code="corrupt",
                    message=f"block {index} with {len(data)} bytes where block {expected_index} "
                    f"with {layout.block_nbytes} bytes was due",
                )
            on_block(index, data)
            num_bytes += len(frame.payload)
        done = await read_frame(reader, timeout_seconds=timeout_seconds, max_payload_bytes=CONTROL_FRAME_MAX_BYTES)
        if done.type is not FrameType.DONE:
            raise TransferError(code="protocol", message=f"expected DONE, got {done.type.name}")
        writer.write(encode_json(FrameType.RELEASE, {"request_id": request_id}))
        await writer.drain()
        return FetchResult(
            num_blocks=num_blocks - first_block, num_bytes=num_bytes,
            num_tokens=num_tokens, seconds=time.perf_counter() - started,
        )


def _check_layout_header(header: dict[str, object], *, layout: KVLayout, first_block: int,
                         expected_num_tokens: int | None) -> tuple[int, int]:
    """(num_blocks, num_tokens) of a LAYOUT answer, which must describe exactly the pull that
    was asked for; raises TransferError otherwise."""
    values: dict[str, int] = {}
    for name in ("num_blocks", "num_tokens", "first_block", "block_nbytes"):
        value = header.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TransferError(code="protocol", message=f"LAYOUT field {name} is {value!r}, not a count")
        values[name] = value
    if values["block_nbytes"] != layout.block_nbytes:
        raise TransferError(code="layout_mismatch", message="block size in bytes differs between pods")
    num_blocks, num_tokens = values["num_blocks"], values["num_tokens"]
    if values["first_block"] != first_block or not first_block <= num_blocks:
        raise TransferError(code="protocol", message=(
            f"LAYOUT starts at block {values['first_block']} of {num_blocks}; block {first_block} was asked for"))
    if num_tokens < 1 or num_blocks != -(-num_tokens // layout.block_size):
        raise TransferError(code="protocol", message=(
            f"LAYOUT announces {num_blocks} blocks for {num_tokens} tokens"))
    if expected_num_tokens is not None and num_tokens != expected_num_tokens:
        raise TransferError(code="prompt_mismatch", message=(
            f"the prefill pod holds {num_tokens} tokens, the prompt has {expected_num_tokens}"))
    return num_blocks, num_tokens
