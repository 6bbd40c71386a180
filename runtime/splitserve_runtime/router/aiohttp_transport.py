"""The router's connection pool to its pods: an httpx transport that sends with aiohttp.

The router speaks httpx (requests, responses, errors) and its health poller uses an httpx
client, but httpx's own pool (httpcore) cost about 0.7 ms of CPU per proxied request on a
2-core machine, against 0.2 ms for aiohttp (bench/router_overhead.py), and it walks every pooled
connection on each request and each response, so that cost grows with the streams open through
the router. aiohttp keeps idle connections per host and parses HTTP in C. It is already a
dependency of the runtime (via ``kubernetes``).

Errors come back as the httpx errors the router handles: a connection the pod closed before
answering is :class:`httpx.RemoteProtocolError` (the router resends it once), a refused one
:class:`httpx.ConnectError`, timeouts the httpx timeout classes. Bodies pass through as they
arrive (no decompression: the router asks for none). Requests carry the httpx request's
``timeout`` extension (connect and read).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx

KEEPALIVE_SECONDS = 5.0
"""How long an idle connection to a pod is kept (httpx's default, as before)."""
_NOT_SENT = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def _mapped(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx error the router expects for an aiohttp (or asyncio) error."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ClientOSError | ConnectionError):
        return httpx.ReadError(message, request=request)
    # ServerDisconnectedError, ClientPayloadError, ClientResponseError (a malformed answer)
    return httpx.RemoteProtocolError(message, request=request)


class _Body(httpx.AsyncByteStream):
    """A pod's response body, chunk by chunk as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _mapped(exc, self._request) from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to the end: the connection goes back to the pool
        else:
            self._response.close()  # not read to the end: the connection cannot be reused


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=AiohttpTransport(...))``; the session opens on first use
    (inside the running loop) and closes with the client."""

    def __init__(self, *, max_connections: int) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                         keepalive_timeout=KEEPALIVE_SECONDS)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"), timeout=aiohttp.ClientTimeout())
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session or self._open()
        limits = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, connect=limits.get("pool"),
                                        sock_connect=limits.get("connect"),
                                        sock_read=limits.get("read"))
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _NOT_SENT]
        try:
            response = await session.request(
                request.method, str(request.url), data=await request.aread() or None,
                headers=headers, timeout=timeout, allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _mapped(exc, request) from exc
        return httpx.Response(
            status_code=response.status, headers=list(response.raw_headers),
            stream=_Body(response, request), request=request,
            extensions={"http_version": b"HTTP/1.1",
                        "reason_phrase": (response.reason or "").encode()})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
