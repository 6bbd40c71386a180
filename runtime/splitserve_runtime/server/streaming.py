"""Server-sent events in the OpenAI stream format, and the response that carries them.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]``. An error after
the stream has started cannot change the HTTP status any more, so it is sent as an event
``data: {"error": {...}}`` (the `openai` client raises it as an APIError) followed by
``[DONE]``.

The response's background task closes the :class:`Generation` even when the body was never
iterated (the client vanished before the first byte), so an abandoned request is always
aborted in the engine. Every generation answer carries ``x-request-id``
(contract.HEADER_REQUEST_ID): the router's id when it sent one, else ours.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from splitserve_contract import HEADER_REQUEST_ID
from splitserve_runtime.server.errors import SERVER_ERROR, APIError
from splitserve_runtime.server.generation import (
    DISCONNECTED_STATUS,
    ClientDisconnected,
    Generation,
    run_until_disconnect,
)

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


def event_stream_response(*, events: AsyncIterator[str], generation: Generation) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as error:
            yield sse_error(error)
        except Exception:  # a bug: log it, and still end the stream in the error shape
            logger.exception("stream %s failed", generation.request_id)
            yield sse_error(
                APIError(status_code=500, type=SERVER_ERROR, code="internal_error", message="internal server error")
            )
        finally:
            await generation.close()
        yield DONE

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(generation.close),
    )


async def respond(
    *,
    request: Request,
    generation: Generation,
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    whole: Callable[[], Coroutine[Any, Any, Response]],
) -> Response:
    """Answer with a stream or a whole body; either way the generation is closed (aborted if
    unfinished) when the client goes away or anything fails.

    `whole` must admit the generation itself (so the wait is raced against a disconnect);
    for a stream the first token is awaited here, before the 200 status is committed."""
    try:
        if stream:
            await run_until_disconnect(request=request, work=generation.admit())
            response: Response = event_stream_response(events=events(), generation=generation)
        else:
            response = await run_until_disconnect(request=request, work=whole())
        response.headers[HEADER_REQUEST_ID] = _correlation_id(
            request.headers.get(HEADER_REQUEST_ID), default=generation.request_id
        )
        return response
    except ClientDisconnected:
        await generation.close()
        return Response(status_code=DISCONNECTED_STATUS)
    except BaseException:
        await generation.close()
        raise


def _correlation_id(incoming: str | None, *, default: str) -> str:
    """The caller's x-request-id (the router's) echoed back if it is a sane token; ours
    otherwise. Only for logs and tracing: the engine always uses our own unique id."""
    if incoming and len(incoming) <= 128 and incoming.isascii() and incoming.isprintable():
        return incoming
    return default
