"""Server-sent events in the OpenAI stream format, and the response that carries them.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]``. An error after
the stream has started cannot change the HTTP status any more, so it is sent as an event
``data: {"error": {...}}`` (the `openai` client raises it as an APIError) followed by
``[DONE]``.

The response's background task closes the :class:`Generation` even when the body was never
iterated (the client vanished before the first byte), so an abandoned request is always
aborted in the engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from splitserve_runtime.server.errors import APIError
from splitserve_runtime.server.generation import Generation

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


def event_stream_response(*, events: AsyncIterator[str], generation: Generation
                          ) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as error:
            yield sse_error(error)
        finally:
            await generation.close()
        yield DONE

    return StreamingResponse(
        body(), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(generation.close),
    )
