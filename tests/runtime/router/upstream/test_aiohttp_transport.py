"""The router's aiohttp transport speaks httpx to the router: bodies and streams pass through as
they arrive, connections are reused, and every failure is the httpx error the router handles
(a connection the pod closed before answering is the RemoteProtocolError it resends once).

Each test runs a raw asyncio HTTP server on loopback whose behaviour the test scripts
(scripted_pod.py), on asyncio's loop and on uvloop's (conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from scripted_pod import (
    FIRST_EVENT,
    SECOND_EVENT,
    Pod,
    die_after_first_event,
    endless_streams,
    hang_up,
    read_request,
    silent,
    two_events,
)

from splitserve_runtime.router.aiohttp_transport import AiohttpTransport


@pytest.fixture
async def transport() -> AsyncIterator[AiohttpTransport]:
    transport = AiohttpTransport(max_connections=16)
    try:
        yield transport
    finally:
        await transport.aclose()


def _post(url: str, *, read_timeout: float = 10.0) -> httpx.Request:
    timeout = httpx.Timeout(read_timeout, connect=3.0).as_dict()
    return httpx.Request(
        "POST",
        f"{url}/v1/completions",
        json={"prompt": "hi"},
        headers={"x-request-id": "rt-1"},
        extensions={"timeout": timeout},
    )


async def test_a_body_goes_and_comes_back_on_one_kept_connection(transport: AiohttpTransport) -> None:
    seen: list[tuple[bytes, dict[str, str], bytes]] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: one connection, many requests
            seen.append(await read_request(reader))
            body = b'{"ok":true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: rt-1\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()

    async with Pod(answer) as pod:
        for _ in range(3):
            response = await transport.handle_async_request(_post(pod.url))
            assert response.status_code == 200
            assert await response.aread() == b'{"ok":true}'
            assert response.json() == {"ok": True}
            assert response.headers["x-request-id"] == "rt-1"
            await response.aclose()
        assert pod.connections == 1
    line, headers, body = seen[0]
    assert line == b"POST /v1/completions HTTP/1.1"
    assert body == b'{"prompt":"hi"}'
    assert headers["content-type"] == "application/json" and headers["x-request-id"] == "rt-1"
    assert headers["host"] == pod.url.removeprefix("http://")
    assert "accept-encoding" not in headers and "user-agent" not in headers  # raw bytes relayed


async def test_a_stream_arrives_event_by_event(transport: AiohttpTransport) -> None:
    go_on = asyncio.Event()

    async with Pod(two_events(go_on)) as pod:
        response = await transport.handle_async_request(_post(pod.url))
        chunks = response.aiter_raw()
        assert await anext(chunks) == FIRST_EVENT
        go_on.set()
        assert b"".join([chunk async for chunk in chunks]) == SECOND_EVENT
        await response.aclose()


async def test_a_refused_connection_is_a_connect_error(transport: AiohttpTransport) -> None:
    async with Pod(lambda reader, writer: asyncio.sleep(0)) as pod:
        url = pod.url
    with pytest.raises(httpx.ConnectError):
        await transport.handle_async_request(_post(url))


async def test_a_pod_that_closes_before_answering_is_a_remote_protocol_error(transport: AiohttpTransport) -> None:

    async with Pod(hang_up) as pod:
        with pytest.raises(httpx.RemoteProtocolError):
            await transport.handle_async_request(_post(pod.url))


async def test_a_silent_pod_is_a_read_timeout(transport: AiohttpTransport) -> None:

    async with Pod(silent) as pod:
        with pytest.raises(httpx.ReadTimeout):
            await transport.handle_async_request(_post(pod.url, read_timeout=0.2))


async def test_a_pod_dying_mid_stream_is_an_http_error(transport: AiohttpTransport) -> None:

    async with Pod(die_after_first_event) as pod:
        response = await transport.handle_async_request(_post(pod.url))
        with pytest.raises(httpx.HTTPError):
            async for _data in response.aiter_raw():
                pass
        await response.aclose()


async def test_a_stream_closed_before_its_end_leaves_its_connection(transport: AiohttpTransport) -> None:

    async with Pod(endless_streams) as pod:
        for _ in range(2):  # a client that went away: the router closes the pod's stream
            response = await transport.handle_async_request(_post(pod.url))
            assert await anext(response.aiter_raw()) == FIRST_EVENT
            await response.aclose()
        assert pod.connections == 2  # the half-read connection was not reused


async def test_the_health_poller_s_client_reads_through_it() -> None:
    async def ready(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, _, _ = await read_request(reader)
        assert line == b"GET /ready HTTP/1.1"
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 18\r\n\r\n{"status":"ready"}')
        await writer.drain()

    async with Pod(ready) as pod:
        async with httpx.AsyncClient(transport=AiohttpTransport(max_connections=4)) as client:
            answer = await client.get(f"{pod.url}/ready", timeout=5)
        assert answer.status_code == 200 and answer.json() == {"status": "ready"}
