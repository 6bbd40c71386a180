"""The router's completion routes as plain ASGI, in front of FastAPI's own layers.

Every proxied request used to pass Starlette's and FastAPI's layers (error and exception
middleware, telemetry, FastAPI's body limit, an exit stack, then route matching over every
route, docs included) before reaching an endpoint that reads its own body and answers with its
own response: about a fifth of the router's CPU per request (bench/router_overhead.py). A POST
to one of the proxied paths now goes from :class:`RouterApp` straight to :class:`ProxyEndpoint`,
through the same pure-ASGI layers the app adds for every other route (errors, API key,
in-flight count, body limit: the caller wraps both the same way). Everything else (health,
metrics, ``/v1/models``, another method on these paths, the lifespan) goes to FastAPI as before;
the endpoints stay registered there too, so a GET to them is still a 405.

The body is forwarded as the client sent it unless the router has to change it
(:meth:`~.proxy.Router.handle`): decoding it once is needed for the checks and the prompt,
encoding it again is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..json_bodies import BodyDecoder, DecoderBusy, DecoderFailed
from . import metrics
from .bodies import BodyRefusal, decode_client_body
from .proxy import Router, error_response

_DECODER_ERRORS: dict[type[Exception], tuple[int, str, str]] = {
    DecoderBusy: (429, "rate_limit_error", "rate_limit_exceeded"),
    DecoderFailed: (503, "service_unavailable", "decoder_failed"),
}
"""The answer (status, error type, code) when the body decoder cannot take a body."""


class RouterApp(FastAPI):
    """FastAPI, with POSTs to the proxied paths sent to their ASGI apps directly."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proxied: dict[str, ASGIApp] = {}

    def proxy_posts(self, routes: Mapping[str, ASGIApp]) -> None:
        """POSTs to each path of ``routes`` go to its app, past FastAPI's stack."""
        self._proxied = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._proxied.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


async def read_body(receive: Receive) -> bytes | None:
    """The request body; None when the client left before sending all of it."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ProxyEndpoint:
    """One proxied path (``/v1/completions``, ``/v1/chat/completions``): decode the client's
    body (off the loop when large, :mod:`.bodies`), hand it to the :class:`~.proxy.Router` in
    ``state`` (set by the app's lifespan) and send its answer."""

    def __init__(self, *, path: str, state: dict[str, Any]) -> None:
        self._path = path
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        if raw is None:
            return  # the client is gone: nobody to answer
        decoder: BodyDecoder = self._state["decoder"]
        answer: Response
        try:
            body = await decoder.run(decode_client_body, raw)
        except (DecoderBusy, DecoderFailed) as exc:  # both are worth a retry in a second
            status, type_, code = _DECODER_ERRORS[type(exc)]
            answer = error_response(
                status=status,
                message=str(exc),
                type_=type_,
                code=code,
                headers={"Retry-After": "1"},
            )
        else:
            if isinstance(body, BodyRefusal):
                answer = error_response(status=400, message=body.message, type_="invalid_request_error", code=body.code)
            else:
                router: Router = self._state["router"]
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
                answer = await router.handle(path=self._path, body=body, headers=headers, raw=raw)
                scope[metrics.COUNTED_BY_ROUTER] = True  # the Router counts what it answers
        await answer(scope, receive, send)
