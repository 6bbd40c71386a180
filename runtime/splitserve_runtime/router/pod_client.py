"""The router's proxied requests to its pods: HTTP/1.1 keep-alive on asyncio, answers parsed by httptools.

A reverse proxy needs little from an HTTP client: write a request it already holds as bytes,
read the answer's status and headers, and pass the body on as it arrives. aiohttp's client,
which the router used before, builds a request object, a response object, a payload writer,
timers and trace hooks for every request: about 40 % of the router's CPU per proxied request
in a py-spy profile of bench/router_overhead.py. Here a request is one ``transport.write`` of
its head and body, and the answer goes through httptools (the C parser uvicorn already uses for
the router's own server side) straight into a :class:`PodResponse`.

What the router relies on, kept from before:

* idle connections are kept per pod address for :data:`KEEPALIVE_SECONDS` (the pods' own idle
  timeout is the same 5 s, so the router's retry of a request whose pooled connection the pod
  had just closed stays: :mod:`.proxy`);
* every failure is the httpx error the router handles: a refused connection is
  :class:`httpx.ConnectError`, no connection within the connect limit
  :class:`httpx.ConnectTimeout`, no free connection within the pool limit
  :class:`httpx.PoolTimeout`, a connection the pod closed before or while answering
  :class:`httpx.RemoteProtocolError` (reset: :class:`httpx.ReadError`), a malformed answer
  :class:`httpx.RemoteProtocolError`, silence longer than the read limit
  :class:`httpx.ReadTimeout`;
* a stream's chunks reach the router as they arrive; a slow reader pauses reading from the pod
  (TCP back-pressure) instead of buffering without bound;
* a response not read to its end, or answered with ``connection: close``, closes its
  connection; only a complete answer's connection goes back to the pool.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import httpx

KEEPALIVE_SECONDS = 5.0
"""How long an idle connection to a pod is kept (the pods' own idle timeout is the same)."""
PAUSE_BYTES = 256 * 1024
"""Unread body bytes at which reading from the pod pauses (back-pressure to the pod); it
resumes when the reader takes what is buffered (:meth:`PodResponse.aiter_raw` takes it all)."""
_NOT_SENT = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Headers the client writes itself (the rest of the caller's headers go as given)."""


@dataclass(frozen=True, slots=True)
class PodTimeout:
    """Limits for one request, in seconds (None: no limit). ``read_seconds`` bounds each wait
    for the pod (the answer's headers, then every gap between body bytes), not the whole
    answer: a stream lasts as long as it generates."""

    connect_seconds: float | None
    read_seconds: float | None
    pool_seconds: float | None = None
    """Waiting for a free connection when all ``max_connections`` are in use."""


@functools.lru_cache(maxsize=1024)
def _address(url: str) -> tuple[str, int, str, str]:
    """(host, port, request target, Host header) of a pod URL; the pods are few, their paths two."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"pod URL {url!r}: only http://host[:port]/path is supported")
    port = parts.port or 80
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return parts.hostname, port, target, f"{host}:{port}" if parts.port else host


def _request_bytes(*, host: str, target: str, headers: Mapping[str, str], content: bytes) -> bytes:
    """One POST as it goes on the wire. A header name or value with a line break is left out
    (the router's server side never lets one through; this keeps that true here too)."""
    lines = [f"POST {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {len(content)}\r\n"]
    for name, value in headers.items():
        if name.lower() in _NOT_SENT or "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            continue
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1") + content


def _expire(waiter: asyncio.Future[None], seconds: float, what: str) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(f"no {what} from the pod within {seconds:g} s"))


class PodResponse:
    """A pod's answer: status, headers (names lower-case), the body as it arrives
    (:meth:`aiter_raw`) or whole (:meth:`aread`, then :attr:`content` and :meth:`json`), and
    :meth:`aclose`, which hands the connection back (or closes it when the answer was not
    read to its end)."""

    __slots__ = (
        "__weakref__",
        "_buffered",
        "_chunks",
        "_closed",
        "_connection",
        "_error",
        "_head_done",
        "_paused",
        "_read_seconds",
        "_waiter",
        "content",
        "done",
        "headers",
        "status_code",
    )

    def __init__(self, connection: _Connection, read_seconds: float | None) -> None:
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.content = b""
        """The body once :meth:`aread` has read it."""
        self.done = False
        """The whole answer has arrived."""
        self._connection = connection
        self._read_seconds = read_seconds
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._head_done = False
        self._error: httpx.TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    # ---------------------------------------------------------------- from the connection
    def _on_head(self, status: int, headers: dict[str, str]) -> None:
        self.status_code, self.headers, self._head_done = status, headers, True
        self._wake()

    def _on_body(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > PAUSE_BYTES and not self._paused:
            self._paused = True
            self._connection.pause_reading()
        self._wake()

    def _on_end(self) -> None:
        self.done = True
        self._wake()

    def _on_error(self, error: httpx.TransportError) -> None:
        if not self.done and self._error is None:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, what: str) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        seconds = self._read_seconds
        timer = None if seconds is None else waiter.get_loop().call_later(seconds, _expire, waiter, seconds, what)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def _read_head(self) -> None:
        while not self._head_done:
            if self._error is not None:
                raise self._error
            await self._wait("answer")

    # ---------------------------------------------------------------- for the router
    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (what is already buffered comes as one chunk)."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._connection.resume_reading()
                yield chunk
                continue
            if self._error is not None:
                raise self._error
            if self.done:
                return
            await self._wait("body bytes")

    async def aread(self) -> bytes:
        self.content = b"".join([chunk async for chunk in self.aiter_raw()])
        return self.content

    def json(self) -> Any:
        """The body read by :meth:`aread`, decoded (ValueError when it is not JSON)."""
        return json.loads(self.content)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._connection.exchange_over(reusable=self.done and self._error is None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a pod and its parser; at most one exchange at a time."""

    def __init__(self, pool: PodClient, key: tuple[str, int]) -> None:
        self.key = key
        self.idle_since = 0.0
        self.closed = False
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: weakref.ref[PodResponse] | None = None
        """The exchange in progress. Weak: a response the router drops without closing it
        (a relay that never started) ends its exchange (:meth:`_dropped`) instead of holding
        its connection and pool slot for ever."""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._until_close = False
        self._keep_alive = False

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def _current(self) -> PodResponse | None:
        return None if self._response is None else self._response()

    def data_received(self, data: bytes) -> None:
        response = self._current()
        if response is None:  # bytes nobody asked for: this connection cannot be trusted
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._on_error(httpx.RemoteProtocolError(f"malformed answer from the pod: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says what it meant

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        response = self._current()
        if response is None or response.done:
            return
        if response._head_done and self._until_close and exc is None:
            response._on_end()  # a body framed by the connection's end (neither length nor chunks)
            return
        where = "while answering" if response._head_done else "before answering"
        if isinstance(exc, OSError):
            response._on_error(httpx.ReadError(f"connection to the pod lost {where}: {exc!r}"))
        else:
            response._on_error(httpx.RemoteProtocolError(f"the pod closed the connection {where}"))

    # ---------------------------------------------------------------- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        headers: dict[str, str] = {}
        for raw_name, raw_value in self._raw_headers:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._raw_headers = []
        self._until_close = "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "")
        response = self._current()
        if response is not None:
            response._on_head(self._parser.get_status_code(), headers)

    def on_body(self, body: bytes) -> None:
        response = self._current()
        if response is not None:
            response._on_body(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        response = self._current()
        if response is not None:
            response._on_end()

    # ---------------------------------------------------------------- for the pool
    def send(self, data: bytes, read_seconds: float | None) -> PodResponse:
        assert self._transport is not None
        response = PodResponse(self, read_seconds)
        self._response = weakref.ref(response, self._dropped)
        self._keep_alive = False
        self._transport.write(data)
        return response

    def pause_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    def exchange_over(self, *, reusable: bool) -> None:
        self._response = None
        if reusable and self._keep_alive and not self.closed:
            self.resume_reading()
            self._pool.release(self, keep=True)
        else:
            self.close()
            self._pool.release(self, keep=False)

    def _dropped(self, ref: weakref.ref[PodResponse]) -> None:
        """The response of ``ref`` was dropped unclosed (possibly on another thread, by the
        garbage collector): its exchange ends here, and the connection closes."""
        loop = self._pool.loop
        if ref is self._response and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._end_dropped, ref)

    def _end_dropped(self, ref: weakref.ref[PodResponse]) -> None:
        if ref is self._response:
            self.exchange_over(reusable=False)

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()


class PodClient:
    """Keep-alive connections to the pods, at most ``max_connections`` in use at once; see the
    module docstring. Open it and close it (:meth:`aclose`) inside the running loop."""

    def __init__(self, *, max_connections: int, keepalive_seconds: float = KEEPALIVE_SECONDS) -> None:
        self._keepalive_seconds = keepalive_seconds
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop the connections run on (set with the first); a dropped response's
        finalizer schedules the end of its exchange there."""

    async def post(
        self, url: str, *, content: bytes, headers: Mapping[str, str], timeout: PodTimeout, fresh: bool = False
    ) -> PodResponse:
        """POST ``content`` to ``url``; the answer once its status and headers have arrived.
        ``fresh``: on a new connection, not a kept one (a retry after a kept one failed)."""
        host, port, target, host_header = _address(url)
        await self._acquire(timeout.pool_seconds)
        try:
            connection = (None if fresh else self._take_idle((host, port))) or await self._connect(
                host, port, timeout.connect_seconds
            )
        except BaseException:
            self._slots.release()
            raise
        response = connection.send(
            _request_bytes(host=host_header, target=target, headers=headers, content=content), timeout.read_seconds
        )
        try:
            await response._read_head()
        except BaseException:
            response.close()
            raise
        return response

    async def _acquire(self, seconds: float | None) -> None:
        if not self._slots.locked():
            await self._slots.acquire()  # returns at once
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), seconds)
        except TimeoutError:
            raise httpx.PoolTimeout(f"no free pod connection within {seconds:g} s") from None

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        oldest = time.monotonic() - self._keepalive_seconds
        while idle:
            connection = idle.pop()  # the most recent: the least likely to be closed by the pod
            if not connection.closed and connection.idle_since >= oldest:
                return connection
            connection.close()
        return None

    async def _connect(self, host: str, port: int, seconds: float | None) -> _Connection:
        self.loop = loop = asyncio.get_running_loop()
        key = (host, port)
        try:
            _transport, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), host, port), seconds
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {seconds:g} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        self._connections.add(connection)
        return connection

    def release(self, connection: _Connection, *, keep: bool) -> None:
        """The exchange on ``connection`` is over; ``keep``: it may carry the next one."""
        self._slots.release()
        if keep:
            connection.idle_since = time.monotonic()
            self._idle.setdefault(connection.key, []).append(connection)

    def forget(self, connection: _Connection) -> None:
        """``connection`` is closed: out of the idle lists."""
        self._connections.discard(connection)
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)
            if not idle:
                del self._idle[connection.key]

    async def aclose(self) -> None:
        for connection in list(self._connections):
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost
