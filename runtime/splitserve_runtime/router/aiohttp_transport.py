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
arrive (no decompression: the router asks for none). httpx requests carry their ``timeout``
extension (connect and read); :meth:`AiohttpTransport.post` takes a :func:`pod_timeout`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

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


class PodResponse:
    """A pod's answer as the router reads it, without httpx's model layer: status, headers
    (case-insensitive), the body chunk by chunk as it arrives or whole, and ``aclose``.
    Errors while reading are the httpx errors the router handles."""

    __slots__ = ("_response", "content", "headers", "status_code")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers: Mapping[str, str] = response.headers
        self.content = b""
        """The body once :meth:`aread` has read it."""

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _mapped(exc) from exc

    async def aread(self) -> bytes:
        try:
            self.content = await self._response.read()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _mapped(exc) from exc
        return self.content

    def json(self) -> Any:
        """The body read by :meth:`aread`, decoded (ValueError when it is not JSON)."""
        return json.loads(self.content)

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to the end: the connection goes back to the pool
        else:
            self._response.close()  # not read to the end: the connection cannot be reused


class _Body(httpx.AsyncByteStream):
    """A pod's response body for httpx, chunk by chunk as it arrives."""

    def __init__(self, response: PodResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_raw():
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


def pod_timeout(*, connect_seconds: float | None, read_seconds: float | None,
                pool_seconds: float | None = None) -> aiohttp.ClientTimeout:
    """No total limit (a stream lasts as long as it generates): a connect limit, a pool wait
    limit (aiohttp's ``connect``, which also covers connecting) and a limit between reads."""
    return aiohttp.ClientTimeout(total=None, connect=pool_seconds, sock_connect=connect_seconds,
                                 sock_read=read_seconds)


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=AiohttpTransport(...))`` for the router's few other calls
    (health polls, the model list), and :meth:`post` for the proxied requests, which skips
    building httpx requests and responses (about a quarter of the router's CPU per request
    went there). The session opens on first use (inside the running loop) and closes with
    the client."""

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

    async def post(self, url: str, *, content: bytes, headers: Mapping[str, str],
                   timeout: aiohttp.ClientTimeout) -> PodResponse:
        """POST ``content`` to ``url``; the answer once its headers have arrived."""
        return await self._request("POST", _url(url), content=content, headers=headers,
                                   timeout=timeout)

    async def _request(self, method: str, url: yarl.URL, *, content: bytes | None,
                       headers: Mapping[str, str] | list[tuple[str, str]],
                       timeout: aiohttp.ClientTimeout) -> PodResponse:
        session = self._session or self._open()
        try:
            response = await session.request(method, url, data=content or None, headers=headers,
                                             timeout=timeout, allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _mapped(exc) from exc
        return PodResponse(response)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        limits = request.extensions.get("timeout", {})
        timeout = pod_timeout(connect_seconds=limits.get("connect"), read_seconds=limits.get("read"),
                              pool_seconds=limits.get("pool"))
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _NOT_SENT]
        try:
            answer = await self._request(request.method, _url(str(request.url)),
                                         content=await request.aread(), headers=headers,
                                         timeout=timeout)
        except httpx.TransportError as exc:
            exc.request = request
            raise
        return httpx.Response(
            status_code=answer.status_code, headers=list(answer._response.raw_headers),
            stream=_Body(answer), request=request,
            extensions={"http_version": b"HTTP/1.1",
                        "reason_phrase": (answer._response.reason or "").encode()})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
