"""The relay's pod stream is released however the response ends (router/relay.py): also when
the client leaves before the relay has asked for its first chunk, when the relay generator has
never started and closing it runs none of its code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Message

from splitserve_runtime.router.relay import RelayResponse

SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0", "spec_version": "2.3"},
    "method": "POST",
    "path": "/v1/completions",
    "headers": [],
}


class _Relay:
    """A relay generator and the record of what ran: its chunks, its finally, on_close."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.events: list[str] = []

    async def body(self) -> AsyncIterator[bytes]:
        self.events.append("started")
        try:
            for i in range(self.chunks):
                yield f"data: {i}\n\n".encode()
        finally:
            self.events.append("finally")

    async def on_close(self) -> None:
        self.events.append("on_close")


def test_a_client_gone_before_the_first_chunk_still_releases_the_stream() -> None:
    relay = _Relay(chunks=3)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await asyncio.sleep(10)  # the client never takes the response's start

    async def run() -> None:
        response = RelayResponse(relay.body(), on_close=relay.on_close, media_type="text/event-stream")
        await asyncio.wait_for(response(SCOPE, receive, send), timeout=5)

    asyncio.run(run())
    assert relay.events == ["on_close"]  # the generator never ran; on_close released it anyway


def test_a_client_gone_mid_stream_runs_the_relays_finally_before_on_close() -> None:
    relay = _Relay(chunks=1000)
    sent: list[Message] = []
    gone = asyncio.Event()

    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if len(sent) == 3:  # the start and two chunks, then the client hangs up
            gone.set()
        await asyncio.sleep(0.001)

    async def run() -> None:
        response = RelayResponse(relay.body(), on_close=relay.on_close, media_type="text/event-stream")
        await asyncio.wait_for(response(SCOPE, receive, send), timeout=5)

    asyncio.run(run())
    assert relay.events == ["started", "finally", "on_close"]  # promptly, not when collected
    assert 3 <= len(sent) < 100


def test_a_stream_that_ends_calls_on_close_once_after_its_last_chunk() -> None:
    relay = _Relay(chunks=3)
    sent: list[Message] = []

    async def receive() -> Message:
        await asyncio.sleep(10)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    async def run() -> None:
        response = RelayResponse(relay.body(), on_close=relay.on_close, media_type="text/event-stream")
        await asyncio.wait_for(response(SCOPE, receive, send), timeout=5)

    asyncio.run(run())
    bodies = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    assert b"".join(bodies) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert relay.events == ["started", "finally", "on_close"]
