"""The router's pod client: requests go out as written, answers and streams come back as they
arrive, connections are kept and reused only when an answer was complete, a slow reader
pauses the pod, and every failure is the httpx error the router handles (a connection the pod
closed before answering is the RemoteProtocolError it resends once).

Each test runs a raw asyncio HTTP server on loopback whose behaviour the test scripts, on
asyncio's loop and on uvloop's (conftest.py).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from scripted_pod import (
    FIRST_EVENT,
    SECOND_EVENT,
    STREAM_HEAD,
    Pod,
    chunked,
    die_after_first_event,
    endless_streams,
    hang_up,
    read_request,
    silent,
    two_events,
)

from splitserve_runtime.router import pod_client as pod_client_module
from splitserve_runtime.router.pod_client import PodClient, PodTimeout

TIMEOUT = PodTimeout(connect_seconds=3.0, read_seconds=10.0, pool_seconds=10.0)
OK = b'{"ok":true}'


def _ok(body: bytes = OK, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: rt-1\r\n"
        + extra
        + b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


@pytest.fixture
async def client() -> AsyncIterator[PodClient]:
    client = PodClient(max_connections=16)
    try:
        yield client
    finally:
        await client.aclose()


async def _post(
    client: PodClient, url: str, *, timeout: PodTimeout = TIMEOUT, headers: dict[str, str] | None = None
) -> pod_client_module.PodResponse:
    return await client.post(
        f"{url}/v1/completions",
        content=b'{"prompt":"hi"}',
        headers=headers or {"x-request-id": "rt-1", "content-type": "application/json"},
        timeout=timeout,
    )


async def _until(condition: Callable[[], bool], *, seconds: float = 5.0) -> None:
    """Wait, polling, until ``condition()`` holds (fails after ``seconds``)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def _answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:  # keep-alive: one connection, many requests
        await read_request(reader)
        writer.write(_ok())
        await writer.drain()


async def test_a_body_goes_and_comes_back_on_one_kept_connection(client: PodClient) -> None:
    seen: list[tuple[bytes, dict[str, str], bytes]] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(_ok())
            await writer.drain()

    async with Pod(answer) as pod:
        for _ in range(3):
            response = await _post(client, pod.url)
            assert response.status_code == 200
            assert await response.aread() == OK
            assert response.json() == {"ok": True}
            assert response.headers["x-request-id"] == "rt-1"
            assert response.headers["content-type"] == "application/json"
            await response.aclose()
        assert pod.connections == 1
    line, headers, body = seen[0]
    assert line == b"POST /v1/completions HTTP/1.1"
    assert body == b'{"prompt":"hi"}'
    assert headers["content-type"] == "application/json" and headers["x-request-id"] == "rt-1"
    assert headers["host"] == pod.url.removeprefix("http://")
    assert headers["content-length"] == str(len(body))


async def test_the_caller_cannot_set_framing_headers_or_split_the_request(client: PodClient) -> None:
    seen: list[tuple[bytes, dict[str, str], bytes]] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(_ok())
        await writer.drain()

    async with Pod(answer) as pod:
        response = await _post(
            client,
            pod.url,
            headers={
                "Content-Length": "999",
                "Transfer-Encoding": "chunked",
                "Host": "elsewhere",
                "x-smuggled": "a\r\nx-evil: 1",
                "x-kept": "yes",
            },
        )
        assert await response.aread() == OK
        await response.aclose()
    _line, headers, body = seen[0]
    assert body == b'{"prompt":"hi"}'
    assert headers["content-length"] == str(len(body)) and "transfer-encoding" not in headers
    assert headers["host"] == pod.url.removeprefix("http://")
    assert "x-smuggled" not in headers and "x-evil" not in headers and headers["x-kept"] == "yes"


async def test_a_stream_arrives_event_by_event(client: PodClient) -> None:
    go_on = asyncio.Event()

    async with Pod(two_events(go_on)) as pod:
        response = await _post(client, pod.url)
        assert response.headers["content-type"] == "text/event-stream"
        chunks = response.aiter_raw()
        assert await anext(chunks) == FIRST_EVENT
        go_on.set()
        assert b"".join([chunk async for chunk in chunks]) == SECOND_EVENT
        assert response.done
        await response.aclose()


async def test_a_body_ended_by_the_connection_s_close_is_complete(client: PodClient) -> None:
    async def old_style(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + OK)
        await writer.drain()

    async with Pod(old_style) as pod:
        for _ in range(2):
            response = await _post(client, pod.url)
            assert await response.aread() == OK
            await response.aclose()
        assert pod.connections == 2  # `connection: close`: never reused


async def test_a_refused_connection_is_a_connect_error(client: PodClient) -> None:
    async with Pod(lambda reader, writer: asyncio.sleep(0)) as pod:
        url = pod.url
    with pytest.raises(httpx.ConnectError):
        await _post(client, url)


async def test_a_pod_that_closes_before_answering_is_a_remote_protocol_error(client: PodClient) -> None:

    async with Pod(hang_up) as pod:
        with pytest.raises(httpx.RemoteProtocolError):
            await _post(client, pod.url)


async def test_an_idle_connection_the_pod_closed_is_not_reused(client: PodClient) -> None:
    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(_ok())
        await writer.drain()  # then the handler ends and the pod closes the kept connection

    async with Pod(one_answer) as pod:
        for _ in range(2):
            response = await _post(client, pod.url)
            assert await response.aread() == OK
            await response.aclose()
            await _until(lambda: not client._idle)  # the pod's close reached the pool
        assert pod.connections == 2


async def test_a_fresh_request_does_not_take_a_kept_connection(client: PodClient) -> None:
    async with Pod(_answering) as pod:
        for fresh in (False, True):
            response = await client.post(
                f"{pod.url}/v1/completions", content=b"{}", headers={}, timeout=TIMEOUT, fresh=fresh
            )
            assert await response.aread() == OK
            await response.aclose()
        assert pod.connections == 2


async def test_an_idle_connection_past_the_keepalive_is_not_reused() -> None:
    client = PodClient(max_connections=4, keepalive_seconds=0.05)
    try:
        async with Pod(_answering) as pod:
            for _ in range(2):
                response = await _post(client, pod.url)
                await response.aread()
                await response.aclose()
                await asyncio.sleep(0.1)
            assert pod.connections == 2
    finally:
        await client.aclose()


async def test_a_silent_pod_is_a_read_timeout(client: PodClient) -> None:

    async with Pod(silent) as pod:
        with pytest.raises(httpx.ReadTimeout):
            await _post(client, pod.url, timeout=PodTimeout(connect_seconds=3.0, read_seconds=0.2))


async def test_a_stream_that_stalls_is_a_read_timeout(client: PodClient) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunked(FIRST_EVENT))
        await writer.drain()
        await asyncio.sleep(5)

    async with Pod(stall) as pod:
        response = await _post(client, pod.url, timeout=PodTimeout(connect_seconds=3.0, read_seconds=0.2))
        chunks = response.aiter_raw()
        assert await anext(chunks) == FIRST_EVENT
        with pytest.raises(httpx.ReadTimeout):
            await anext(chunks)
        await response.aclose()


async def test_a_pod_dying_mid_stream_is_an_http_error(client: PodClient) -> None:

    async with Pod(die_after_first_event) as pod:
        response = await _post(client, pod.url)
        with pytest.raises(httpx.RemoteProtocolError):
            async for _data in response.aiter_raw():
                pass
        await response.aclose()


async def test_a_malformed_answer_is_a_remote_protocol_error(client: PodClient) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with Pod(garbage) as pod:
        with pytest.raises(httpx.RemoteProtocolError):
            await _post(client, pod.url)


async def test_a_stream_closed_before_its_end_leaves_its_connection(client: PodClient) -> None:

    async with Pod(endless_streams) as pod:
        for _ in range(2):  # a client that went away: the router closes the pod's stream
            response = await _post(client, pod.url)
            assert await anext(response.aiter_raw()) == FIRST_EVENT
            await response.aclose()
        assert pod.connections == 2  # the half-read connection was not reused


async def test_a_slow_reader_pauses_the_pod_and_loses_nothing(client: PodClient) -> None:
    total = 32 * 2**20  # more than the kernel's socket buffers on loopback hold
    piece = b"x" * 65536
    written = 0
    wrote_all = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        while written < total:
            writer.write(piece)
            await writer.drain()
            written += len(piece)
        wrote_all.set()

    async with Pod(flood) as pod:
        response = await _post(client, pod.url)
        await asyncio.sleep(0.5)  # nobody reads: the client stops reading, the pod's writes block
        assert not wrote_all.is_set()
        assert written < total
        held = sum(len(chunk) for chunk in response._chunks)  # what the client buffers itself
        assert held <= pod_client_module.PAUSE_BYTES + 2**20
        received = 0
        async for chunk in response.aiter_raw():
            received += len(chunk)
        assert received == total and wrote_all.is_set()
        await response.aclose()


@pytest.fixture
async def one_slot() -> AsyncIterator[PodClient]:
    """A client allowed one connection in use at a time."""
    client = PodClient(max_connections=1)
    try:
        yield client
    finally:
        await client.aclose()


def _pool_wait(seconds: float) -> PodTimeout:
    return PodTimeout(connect_seconds=3.0, read_seconds=5.0, pool_seconds=seconds)


async def test_the_pool_limit_makes_a_request_wait_then_time_out(one_slot: PodClient) -> None:
    async with Pod(_answering) as pod:
        first = await _post(one_slot, pod.url)
        with pytest.raises(httpx.PoolTimeout):
            await _post(one_slot, pod.url, timeout=_pool_wait(0.1))
        waiting = asyncio.ensure_future(_post(one_slot, pod.url))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await first.aread()
        await first.aclose()  # the slot frees: the waiting request goes out
        second = await asyncio.wait_for(waiting, 5)
        assert await second.aread() == OK
        await second.aclose()
        assert pod.connections == 1


async def test_a_response_dropped_unclosed_gives_back_its_slot(one_slot: PodClient) -> None:
    async with Pod(_answering) as pod:
        response = await _post(one_slot, pod.url)
        del response  # a relay that never started: nobody closes it
        gc.collect()
        again = await _post(one_slot, pod.url, timeout=_pool_wait(1.0))  # waits for the freed slot
        assert await again.aread() == OK
        await again.aclose()
        assert pod.connections == 2  # the dropped one's connection was closed, not reused


async def test_concurrent_requests_to_one_pod_each_get_their_own_answer(client: PodClient) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _line, headers, _body = await read_request(reader)
            await asyncio.sleep(0.01)
            writer.write(_ok(headers["x-request-id"].encode()))
            await writer.drain()

    async with Pod(echo) as pod:

        async def one(i: int) -> bytes:
            response = await _post(client, pod.url, headers={"x-request-id": f"r{i}"})
            try:
                return await response.aread()
            finally:
                await response.aclose()

        answers = await asyncio.gather(*(one(i) for i in range(12)))
        assert answers == [f"r{i}".encode() for i in range(12)]
        assert pod.connections <= 12


def test_only_http_pod_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="only http"):
        pod_client_module._address("https://pod:8000/v1/completions")
    assert pod_client_module._address("http://10.0.0.7:8000/v1/completions") == (
        "10.0.0.7",
        8000,
        "/v1/completions",
        "10.0.0.7:8000",
    )
