"""The TCP KV transport: a server on the prefill pod's KV port and a pulling client.

One connection moves one request's blocks (pull, as NIXL does in vLLM): the decode pod sends
FETCH with the first block it lacks, the server answers LAYOUT then one BLOCK frame per block,
then DONE; the client answers RELEASE, and only then are the prefill pod's blocks unpinned. A
client that vanishes before RELEASE leaves the export to its lease (it may retry).

A parallel rank's server holds one :class:`~.slices.KVSlice` of every block (its layers and KV
heads); a FETCH may name a ``slice`` (inside what the server holds, else ``layout_mismatch``)
and then each BLOCK frame carries just that rectangle. Several ranks of a decode pod pull
slices of one export, so theirs end with RELEASE ``keep`` (done, but leave it pinned); the
decode driver's final pull of no blocks releases it.

Both ends move bytes through :class:`~.wire.Channel` (the event loop's own sockets, no asyncio
streams): the server hands frame headers and the blocks' own bytes to gathering ``sendmsg``
calls, reading and checksumming blocks at most :data:`SEND_AHEAD_BYTES` ahead of what the socket
took, and mostly while it is full, so a slow decode pod never makes the prefill pod buffer a
whole request, and the CRCs overlap the decode pod's receiving.
The client receives each block straight into its buffer (the destination's own memory when the
sink is a :class:`~.connector.BlockDestination`), checks the CRC there, then hands it over.

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
import logging
import socket
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence

from .auth import HandoffAuth, HandoffRejected
from .connector import BlockDestination, BlockSink, FetchResult, KVLayout, TransferError
from .framing import (
    BLOCK_HEADER_SIZE,
    Frame,
    FrameError,
    FrameType,
    block_header,
    encode_json,
)
from .receive import BlockReceiver
from .registry import ExportedKV, KVExportRegistry
from .slices import KVSlice, extract
from .wire import Channel, PeerClosed, byte_view

log = logging.getLogger(__name__)

CONTROL_FRAME_MAX_BYTES = 64 * 1024
PEER_ERROR_CODES = frozenset({"unknown_request", "layout_mismatch", "protocol", "unauthorized"})
"""Codes a server's ERROR frame may carry; any other is reported as ``protocol`` (a peer's
words go into logs and errors only as bounded, known codes and a truncated message)."""
MAX_PEER_MESSAGE_CHARS = 300
SEND_AHEAD_BYTES = 2 * 1024 * 1024
"""How far the server reads and checksums blocks ahead of what the socket took (at least one
block): enough to keep the socket fed while the decode pod drains it, little memory."""
LISTEN_BACKLOG = 128

TransferObserver = Callable[[int, float, bool], None]
"""Called after each transfer with (bytes moved, seconds, succeeded): feeds the metrics."""


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransferError(code="connect_failed", message=f"bad KV endpoint {endpoint!r} (want host:port)")
    return host.strip("[]"), int(port)


async def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host``:``port``, bound as ``asyncio.start_server`` would (every
    address ``host`` resolves to; all interfaces for ""), non-blocking."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(infos):
            listener = socket.socket(family, kind, proto)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    if not listeners:
        raise OSError(f"{host!r} resolves to no address to listen on")
    return listeners


async def _connect(host: str, port: int) -> Channel:
    """A channel to the first address of ``host``:``port`` that accepts the connection."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    failure: OSError = OSError(f"{host!r} resolves to no address")
    for family, kind, proto, _name, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            return Channel(sock)
        except OSError as exc:
            sock.close()
            failure = exc
        except BaseException:
            sock.close()
            raise
    raise failure


class TcpKVServer:
    """Serves exported KV blocks from `registry`; runs in the prefill pod's event loop."""

    def __init__(
        self,
        *,
        registry: KVExportRegistry,
        layout: KVLayout,
        host: str,
        port: int,
        io_timeout_seconds: float = 30.0,
        observer: TransferObserver | None = None,
        auth: HandoffAuth | None = None,
        holds: KVSlice | None = None,
    ) -> None:
        """``holds``: the slice of every block this server's exports hold (a parallel rank's
        layers and heads; default: whole blocks)."""
        self._auth = auth if auth is not None else HandoffAuth(key=None)
        self._registry = registry
        self._layout = layout
        self._holds = holds if holds is not None else KVSlice.whole(layout)
        if not self._holds.fits(layout):
            raise ValueError(f"a KV server cannot hold {self._holds.describe()} of {layout}")
        self._host = host
        self._port = port
        self._io_timeout_seconds = io_timeout_seconds
        self._observer = observer
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._expiry_task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        if not self._listeners:
            return self._port
        return int(self._listeners[0].getsockname()[1])

    async def start(self, *, expiry_interval_seconds: float = 1.0) -> None:
        self._listeners = await _listen(self._host, self._port)
        for listener in self._listeners:
            self._spawn(self._accept_forever(listener))
        self._expiry_task = asyncio.create_task(self._expire_forever(expiry_interval_seconds))

    async def stop(self) -> None:
        """Stop accepting, end transfers still running (their pullers see a truncated
        stream and fall back), and close the listening sockets."""
        tasks = [*self._tasks, *([self._expiry_task] if self._expiry_task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for listener in self._listeners:
            listener.close()

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _address = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, ...: keep serving the others
                log.warning("KV server cannot accept a connection: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._serve(connection))

    async def _expire_forever(self, interval_seconds: float) -> None:
        while True:
            await asyncio.sleep(interval_seconds)
            expired = self._registry.expire()
            if expired:
                log.warning("freed KV of %d unclaimed request(s) after their lease", expired)

    async def _serve(self, connection: socket.socket) -> None:
        started = time.perf_counter()
        num_bytes = 0
        ok = False
        peer: object = "?"
        channel: Channel | None = None
        try:
            peer = connection.getpeername()
            channel = Channel(connection)
            num_bytes = await self._serve_one(channel, peer=peer)
            ok = True
        except (FrameError, TransferError, PeerClosed, TimeoutError, OSError) as exc:
            log.warning("KV transfer to %s failed: %s", peer, str(exc) or type(exc).__name__)
        except asyncio.CancelledError:  # the server stops: not a failed transfer
            num_bytes, ok = 0, True
            raise
        finally:
            if channel is not None:
                channel.close()
            else:
                connection.close()
            if self._observer is not None and (num_bytes or not ok):
                self._observer(num_bytes, time.perf_counter() - started, ok)

    async def _send(self, channel: Channel, buffers: Sequence[bytes | memoryview]) -> None:
        channel.expire_in(self._io_timeout_seconds)
        await channel.send(buffers)

    async def _send_error(self, channel: Channel, *, code: str, message: str) -> None:
        await self._send(channel, [encode_json(FrameType.ERROR, {"code": code, "message": message})])

    async def _read_control(self, channel: Channel) -> Frame:
        channel.expire_in(self._io_timeout_seconds)
        return await channel.read_frame(max_payload_bytes=CONTROL_FRAME_MAX_BYTES)

    async def _serve_one(self, channel: Channel, *, peer: object) -> int:
        frame = await self._read_control(channel)
        if frame.type is not FrameType.FETCH:
            raise FrameError(f"expected FETCH, got {frame.type.name}")
        body = frame.json()
        peer_host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        try:  # first: a stranger learns nothing, not even whether the request exists
            nonce = self._auth.check_fetch(body, peer_host=peer_host)
        except HandoffRejected as exc:
            await self._send_error(channel, code="unauthorized", message="FETCH refused: not authenticated")
            raise TransferError(code="unauthorized", message=exc.message) from None
        request_id = str(body.get("request_id", ""))
        first_block = body.get("first_block", 0)
        wanted = KVLayout.from_json(body.get("layout", {}))
        if wanted != self._layout:
            await self._send_error(
                channel,
                code="layout_mismatch",
                message=f"KV layouts differ (decode vs prefill: {wanted.mismatch(self._layout)}); "
                f"decode wants {wanted}, prefill holds {self._layout}",
            )
            return 0
        exported = self._registry.get(request_id)
        if exported is None:
            await self._send_error(
                channel,
                code="unknown_request",
                message=f"no KV held for request {request_id!r} (never prefilled here, released, or expired)",
            )
            return 0
        if not isinstance(first_block, int) or not 0 <= first_block <= exported.num_blocks:
            await self._send_error(
                channel,
                code="protocol",
                message=f"first_block {first_block!r} outside 0..{exported.num_blocks}",
            )
            return 0
        try:
            wanted_slice = KVSlice.from_json(body["slice"]) if "slice" in body else KVSlice.whole(self._layout)
        except TransferError as exc:
            await self._send_error(channel, code="protocol", message=exc.message)
            return 0
        if first_block < exported.num_blocks and not (
            wanted_slice.fits(self._layout) and self._holds.contains(wanted_slice)
        ):
            await self._send_error(
                channel,
                code="layout_mismatch",
                message=f"this endpoint holds {self._holds.describe()}, not {wanted_slice.describe()}",
            )
            return 0
        block_nbytes = wanted_slice.block_nbytes(self._layout)
        header = {
            "num_blocks": exported.num_blocks,
            "num_tokens": exported.num_tokens,
            "first_block": first_block,
            "block_nbytes": block_nbytes,
        }
        layout = encode_json(
            FrameType.LAYOUT, {**header, **self._auth.layout_proof(request_id=request_id, nonce=nonce, header=header)}
        )
        await channel.send_frames(
            self._frames(exported, first_block=first_block, layout=layout, wanted=wanted_slice),
            ahead_bytes=SEND_AHEAD_BYTES,
            stall_seconds=self._io_timeout_seconds,
        )
        num_bytes = (exported.num_blocks - first_block) * (BLOCK_HEADER_SIZE + block_nbytes)
        ack = await self._read_control(channel)
        if ack.type is FrameType.RELEASE and ack.json().get("keep") is not True:
            self._registry.release(request_id)
        return num_bytes

    def _frames(
        self, exported: ExportedKV, *, first_block: int, layout: bytes, wanted: KVSlice
    ) -> Iterator[Sequence[bytes | memoryview]]:
        """LAYOUT, then each BLOCK frame as (header, the block's own bytes, or the slice of
        them that was asked for), then DONE; a block is read and checksummed only when the
        channel asks for it."""
        yield (layout,)
        held_nbytes = self._holds.block_nbytes(self._layout)
        block_nbytes = wanted.block_nbytes(self._layout)
        # Slices are cut into a ring of buffers, each reused once the channel sent it: it
        # holds at most SEND_AHEAD_BYTES plus one frame not yet sent (see send_frames).
        ring = (
            []
            if wanted == self._holds
            else [memoryview(bytearray(block_nbytes)) for _ in range(SEND_AHEAD_BYTES // block_nbytes + 3)]
        )
        for index in range(first_block, exported.num_blocks):
            data = byte_view(exported.read_block(index))
            if len(data) != held_nbytes:
                raise TransferError(
                    code="protocol",
                    message=(
                        f"block {index} of {exported.request_id!r} has {len(data)} bytes, the layout {held_nbytes}"
                    ),
                )
            data = extract(
                data,
                layout=self._layout,
                held=self._holds,
                wanted=wanted,
                out=ring[index % len(ring)] if ring else None,
            )
            yield block_header(index=index, data=data), data
        num_bytes = (exported.num_blocks - first_block) * (BLOCK_HEADER_SIZE + block_nbytes)
        yield (encode_json(FrameType.DONE, {"num_bytes": num_bytes}),)


class TcpKVConnector:
    """Pulls one request's blocks over TCP; implements :class:`~.connector.KVConnector`."""

    def __init__(self, *, observer: TransferObserver | None = None, auth: HandoffAuth | None = None) -> None:
        self._observer = observer
        self._auth = auth if auth is not None else HandoffAuth(key=None)

    async def fetch(
        self,
        *,
        endpoint: str,
        request_id: str,
        first_block: int,
        layout: KVLayout,
        on_block: BlockSink | BlockDestination,
        timeout_seconds: float,
        expected_num_tokens: int | None = None,
        slice: KVSlice | None = None,
        release: bool = True,
    ) -> FetchResult:
        """See :meth:`.connector.KVConnector.fetch`. Raises ValueError (not TransferError)
        when a :class:`~.connector.BlockDestination` offers buffers that do not hold a block."""
        started = time.perf_counter()
        try:
            result = await self._fetch(
                endpoint=endpoint,
                request_id=request_id,
                first_block=first_block,
                layout=layout,
                on_block=on_block,
                timeout_seconds=timeout_seconds,
                expected_num_tokens=expected_num_tokens,
                slice=slice,
                release=release,
            )
        except TransferError:
            if self._observer is not None:
                self._observer(0, time.perf_counter() - started, False)
            raise
        if self._observer is not None:
            self._observer(result.num_bytes, result.seconds, True)
        return result

    async def _fetch(
        self,
        *,
        endpoint: str,
        request_id: str,
        first_block: int,
        layout: KVLayout,
        on_block: BlockSink | BlockDestination,
        timeout_seconds: float,
        expected_num_tokens: int | None,
        slice: KVSlice | None,
        release: bool,
    ) -> FetchResult:
        if slice is not None and not slice.fits(layout):
            raise TransferError(code="layout_mismatch", message=f"{slice.describe()} is outside the KV layout")
        try:
            self._auth.check_endpoint(endpoint)
        except HandoffRejected as exc:
            raise TransferError(code="endpoint_not_allowed", message=exc.message) from None
        host, port = _parse_endpoint(endpoint)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_seconds):
                channel = await _connect(host, port)
        except (OSError, TimeoutError) as exc:
            raise TransferError(code="connect_failed", message=f"{endpoint}: {exc or type(exc).__name__}") from exc
        nonce = self._auth.new_nonce()
        try:
            channel.expire_in(timeout_seconds)
            await channel.send(
                [
                    encode_json(
                        FrameType.FETCH,
                        {
                            "request_id": request_id,
                            "first_block": first_block,
                            "layout": layout.to_json(),
                            **({"slice": slice.to_json()} if slice is not None else {}),
                            **self._auth.fetch_credentials(request_id=request_id, nonce=nonce),
                        },
                    )
                ]
            )
            return await self._receive(
                channel=channel,
                request_id=request_id,
                nonce=nonce,
                first_block=first_block,
                layout=layout,
                on_block=on_block,
                timeout_seconds=timeout_seconds,
                started=started,
                expected_num_tokens=expected_num_tokens,
                block_nbytes=(slice or KVSlice.whole(layout)).block_nbytes(layout),
                release=release,
            )
        except FrameError as exc:
            raise TransferError(code="corrupt", message=str(exc)) from exc
        except HandoffRejected as exc:
            raise TransferError(code="unauthenticated", message=exc.message) from None
        except PeerClosed as exc:
            raise TransferError(
                code="truncated", message=(f"peer closed after {exc.received} of the {exc.expected} bytes due")
            ) from exc
        except TimeoutError as exc:
            raise TransferError(code="timeout", message=f"no data from {endpoint} within {timeout_seconds}s") from exc
        except OSError as exc:  # reset, broken pipe, ...
            raise TransferError(code="truncated", message=f"connection to {endpoint} lost: {exc}") from exc
        finally:
            channel.close()

    async def _receive(
        self,
        *,
        channel: Channel,
        request_id: str,
        nonce: str,
        first_block: int,
        layout: KVLayout,
        on_block: BlockSink | BlockDestination,
        timeout_seconds: float,
        started: float,
        expected_num_tokens: int | None,
        block_nbytes: int,
        release: bool,
    ) -> FetchResult:
        channel.expire_in(timeout_seconds)
        frame = await channel.read_frame(max_payload_bytes=CONTROL_FRAME_MAX_BYTES)
        if frame.type is FrameType.ERROR:
            body = frame.json()
            code = body.get("code")
            raise TransferError(
                code=code if code in PEER_ERROR_CODES else "protocol",
                message=str(body.get("message", ""))[:MAX_PEER_MESSAGE_CHARS],
            )
        if frame.type is not FrameType.LAYOUT:
            raise TransferError(code="protocol", message=f"expected LAYOUT, got {frame.type.name}")
        header = frame.json()
        self._auth.check_layout(header, request_id=request_id, nonce=nonce)  # before any block
        num_blocks, num_tokens = _check_layout_header(
            header,
            layout=layout,
            first_block=first_block,
            expected_num_tokens=expected_num_tokens,
            block_nbytes=block_nbytes,
        )
        num_bytes = await BlockReceiver(
            channel=channel,
            block_nbytes=block_nbytes,
            on_block=on_block,
            timeout_seconds=timeout_seconds,
            first_block=first_block,
            num_blocks=num_blocks,
        ).receive()
        channel.expire_in(timeout_seconds)
        done = await channel.read_frame(max_payload_bytes=CONTROL_FRAME_MAX_BYTES)
        if done.type is not FrameType.DONE:
            raise TransferError(code="protocol", message=f"expected DONE, got {done.type.name}")
        channel.expire_in(timeout_seconds)
        await channel.send(
            [encode_json(FrameType.RELEASE, {"request_id": request_id, **({} if release else {"keep": True})})]
        )
        return FetchResult(
            num_blocks=num_blocks - first_block,
            num_bytes=num_bytes,
            num_tokens=num_tokens,
            seconds=time.perf_counter() - started,
        )


def _check_layout_header(
    header: dict[str, object], *, layout: KVLayout, first_block: int, expected_num_tokens: int | None, block_nbytes: int
) -> tuple[int, int]:
    """(num_blocks, num_tokens) of a LAYOUT answer, which must describe exactly the pull that
    was asked for; raises TransferError otherwise."""
    values: dict[str, int] = {}
    for name in ("num_blocks", "num_tokens", "first_block", "block_nbytes"):
        value = header.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TransferError(code="protocol", message=f"LAYOUT field {name} is {value!r}, not a count")
        values[name] = value
    if values["block_nbytes"] != block_nbytes:
        raise TransferError(code="layout_mismatch", message="block size in bytes differs between pods")
    num_blocks, num_tokens = values["num_blocks"], values["num_tokens"]
    if values["first_block"] != first_block or not first_block <= num_blocks:
        raise TransferError(
            code="protocol",
            message=(
                f"LAYOUT starts at block {values['first_block']} of {num_blocks}; block {first_block} was asked for"
            ),
        )
    if num_tokens < 1 or num_blocks != -(-num_tokens // layout.block_size):
        raise TransferError(code="protocol", message=(f"LAYOUT announces {num_blocks} blocks for {num_tokens} tokens"))
    if expected_num_tokens is not None and num_tokens != expected_num_tokens:
        raise TransferError(
            code="prompt_mismatch",
            message=(f"the prefill pod holds {num_tokens} tokens, the prompt has {expected_num_tokens}"),
        )
    return num_blocks, num_tokens
