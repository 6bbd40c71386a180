"""A request body limit for the runtime's and the router's HTTP servers.

Without one, a single client can post a body of tens of megabytes that the server must read,
parse and tokenize before it can say no (a 21 MB body stalled ``/health`` for a minute). This ASGI middleware refuses a body over the limit before the app sees it: at once
from ``Content-Length``, or as soon as a chunked body crosses the limit. The answer is a 413 in
the OpenAI error shape. The body is read here (FastAPI reads it whole anyway) and replayed to
the app, so a refusal never depends on how the app handles errors. It sits outside the runtime's layers (like :mod:`.auth`) so the server
and the router share it.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large_body(max_bytes: int) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": f"request body is larger than the server's limit of {max_bytes} bytes",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
    ).encode()


async def send_too_large(send: Send, *, max_bytes: int) -> None:
    body = too_large_body(max_bytes)
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """Refuses HTTP request bodies over ``max_bytes`` with a 413 (0 disables the limit)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._app = app
        self._max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._max_bytes == 0:
            await self._app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self._max_bytes:
            await send_too_large(send, max_bytes=self._max_bytes)
            return
        body = await _read_body(receive, max_bytes=self._max_bytes)
        if body is None:
            await send_too_large(send, max_bytes=self._max_bytes)
            return
        replayed = False

        async def replay_receive() -> Message:
            # The whole body once, then the real channel (so disconnects still arrive).
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._app(scope, replay_receive, send)


async def _read_body(receive: Receive, *, max_bytes: int) -> bytes | None:
    """The request body, or None as soon as it is longer than ``max_bytes``."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # disconnected while sending: nothing to serve
            return b"".join(chunks)
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > max_bytes:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
