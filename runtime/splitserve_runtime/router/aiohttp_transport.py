"""The router's httpx client for its own calls to the pods (health polls, the model list): an
httpx transport that sends with aiohttp.

httpx's own pool (httpcore) cost about 0.7 ms of CPU per request on a 2-core machine, against
0.2 ms for aiohttp (bench/router_overhead.py), and walks every pooled connection on each request.
The proxied requests themselves go through the leaner :mod:`.pod_client`; this transport serves
the few requests a second the poller makes, through httpx's API.

Errors come back as the httpx errors the router handles: a connection the pod closed before
answering is :class:`httpx.RemoteProtocolError`, a refused one :class:`httpx.ConnectError`,
timeouts the httpx timeout classes. Bodies pass through as they arrive (no decompression: the
router asks for none). httpx requests carry their ``timeout`` extension (connect, read, pool).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping

import aiohttp
import httpx
import yarl

KEEPALIVE_SECONDS = 5.0
"""How long an idle connection to a pod is kept (httpx's default, as before)."""
_NOT_SENT = frozenset({"host", "content-length", "transfer-encoding", "connection"})


_url = functools.lru_cache(maxsize=1024)(yarl.URL)
"""A pod URL parsed once (the pods are few; their paths are two)."""


def _mapped(exc: BaseException) -> httpx.TransportError:
    """The httpx error the router expects for an aiohttp (or asyncio) error."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message)
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        return httpx.ReadTimeout(message)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message)
    if isinstance(exc, aiohttp.ClientOSError | ConnectionError):
        return httpx.ReadError(message)
    # ServerDisconnectedError, ClientPayloadError, ClientResponseError (a malformed answer)
    return httpx.RemoteProtocolError(message)


class _Body(httpx.AsyncByteStream):
    """A pod's response body for httpx, chunk by chunk as it arrives; errors while reading are
    the httpx errors the router handles."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _mapped(exc) from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to the end: the connection goes back to the pool
        else:
            self._response.close()  # not read to the end: the connection cannot be reused


def _timeout(
    *, connect_seconds: float | None, read_seconds: float | None, pool_seconds: float | None = None
) -> aiohttp.ClientTimeout:
    """No total limit (a stream lasts as long as it generates): a connect limit, a pool wait
    limit (aiohttp's ``connect``, which also covers connecting) and a limit between reads."""
    return aiohttp.ClientTimeout(total=None, connect=pool_seconds, sock_connect=connect_seconds, sock_read=read_seconds)


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=AiohttpTransport(...))`` for the router's calls other than
    the proxied requests. The session opens on first use (inside the running loop) and closes
    with the client."""

    def __init__(self, *, max_connections: int) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_SECONDS
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(),
        )
        return self._session

    async def _request(
        self,
        method: str,
        url: yarl.URL,
        *,
        content: bytes | None,
        headers: Mapping[str, str] | list[tuple[str, str]],
        timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        session = self._session or self._open()
        try:
            return await session.request(
                method, url, data=content or None, headers=headers, timeout=timeout, allow_redirects=False
            )
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _mapped(exc) from exc

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        limits = request.extensions.get("timeout", {})
        timeout = _timeout(
            connect_seconds=limits.get("connect"), read_seconds=limits.get("read"), pool_seconds=limits.get("pool")
        )
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _NOT_SENT]
        try:
            answer = await self._request(
                request.method, _url(str(request.url)), content=await request.aread(), headers=headers, timeout=timeout
            )
        except httpx.TransportError as exc:
            exc.request = request
            raise
        return httpx.Response(
            status_code=answer.status,
            headers=list(answer.raw_headers),
            stream=_Body(answer),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (answer.reason or "").encode()},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
