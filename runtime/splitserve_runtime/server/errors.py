"""One error shape for every failure the server reports, and the typed mapping onto it.

Every non-2xx answer is ``{"error": {"message", "type", "param", "code"}}`` as in the OpenAI
API, so the `openai` client raises its typed exceptions (BadRequestError, NotFoundError,
AuthenticationError, RateLimitError, ...). Client mistakes are 4xx: FastAPI's 422 for a body
that fails validation becomes 400, malformed JSON is 400, the engine's admission errors map
to 400 / 429 / 503. Only a bug in the server is a 500, and its message never carries
internals (the traceback goes to the log); so is a request whose logits the model computed as
NaN or infinity (code ``non_finite_logits``, the engine's message: a numerical fault of the
model on this server, which the client can do nothing about but retry elsewhere).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve_runtime.engine.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    EngineDead,
    EngineError,
    KVTransferFailed,
    PromptExceedsKVCapacity,
    QueueFull,
    RequestExceedsKVCapacity,
)

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable"

MAX_ERRORS_READ = 64
"""Validation errors turned into the 400's message; further ones are only counted."""

_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote client text (a model name)
    holding a lone surrogate, which is valid JSON as ``\\ud800`` but not encodable as UTF-8."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, indent=None, separators=(",", ":")).encode(
            "ascii"
        )


class APIError(Exception):
    """An error the server answers with; raise it anywhere below a route."""

    def __init__(
        self,
        *,
        status_code: int,
        message: str,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorJSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(status_code=400, message=message, type=INVALID_REQUEST, param=param, code=code)


def check_text(text: str, *, param: str) -> None:
    """Raise a 400 for client text no tokenizer can take: a lone UTF-16 surrogate
    (``"\\ud800"``) is valid JSON and a valid Python str, but not Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"{param} is not valid Unicode text: it holds a lone UTF-16 surrogate "
            f"(U+{ord(text[exc.start]):04X}) at character {exc.start}",
            param=param,
            code="invalid_text",
        ) from None


def model_not_found(model: str) -> APIError:
    return APIError(
        status_code=404,
        type=INVALID_REQUEST,
        code="model_not_found",
        param="model",
        message=f"The model `{model}` does not exist.",
    )


def unavailable(message: str, *, retry_after_seconds: int = 1, code: str = "unavailable") -> APIError:
    return APIError(
        status_code=503, type=UNAVAILABLE, code=code, message=message, headers={"Retry-After": str(retry_after_seconds)}
    )


def from_engine_error(exc: EngineError, *, prompt_param: str) -> APIError:
    """Map an engine admission error onto the HTTP answer (docs/architecture.md, "Reliability")."""
    if isinstance(exc, ContextLengthExceeded | PromptExceedsKVCapacity):
        return bad_request(str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, RequestExceedsKVCapacity):  # lowering max_tokens is the usual fix
        return bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, QueueFull):
        retry_after = max(1, math.ceil(exc.retry_after_seconds))
        return APIError(
            status_code=429,
            type=RATE_LIMIT,
            code="rate_limit_exceeded",
            message=str(exc),
            headers={"Retry-After": str(retry_after)},
        )
    if isinstance(exc, EngineDead):
        return unavailable("the inference engine is not running", code="engine_dead")
    if isinstance(exc, KVTransferFailed):  # the prefill pod's KV never arrived intact
        return APIError(status_code=502, type=SERVER_ERROR, code="kv_transfer_failed", message=str(exc))
    if isinstance(exc, DuplicateRequestId):
        return bad_request(str(exc), code="duplicate_request_id")
    return bad_request(str(exc))


def _clean_loc(loc: Sequence[int | str]) -> list[str]:
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    return [str(p) for p in parts if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]


def validation_error(exc: RequestValidationError) -> APIError:
    """A 400 built from pydantic's structured errors (never from `str(exc)`, which can carry
    server paths and the whole input). Only the first errors are read: a body with 40,000
    unknown fields (400 KB) has as many errors, and reading all of them into a de-duplicated
    list held the event loop for 10 s; the rest are only counted."""
    errors = list(exc.errors())
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    first_param: str | None = None
    messages: dict[str, None] = {}  # insertion-ordered set
    for err in errors[:MAX_ERRORS_READ]:
        path = _clean_loc(err.get("loc", ()))
        if first_param is None and path:
            first_param = path[0]
        where = ".".join(path)
        if not path and err.get("type") in ("missing", "model_attributes_type", "dict_type"):
            text = "the request body must be a JSON object (Content-Type: application/json)"
        elif err.get("type") == "extra_forbidden":
            text = f"Unrecognized request argument supplied: {where}"
        else:
            text = f"{where}: {err.get('msg', 'invalid value')}" if where else str(err.get("msg", "invalid request"))
        messages[text] = None
    shown = list(itertools.islice(messages, 3)) or ["invalid request"]
    num_errors = int(getattr(exc, "num_errors", len(errors)))  # a reader may hold only the first
    num_more = len(messages) - len(shown) + max(0, num_errors - MAX_ERRORS_READ)
    more = f" (and {num_more} more)" if num_more > 0 else ""
    return bad_request("; ".join(shown) + more, param=first_param)


async def _handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _handle_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc).response()


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    if exc.status_code >= 500:
        kind = SERVER_ERROR
    detail = exc.detail if isinstance(exc.detail, str) else "request failed"
    error = APIError(status_code=exc.status_code, message=detail, type=kind, headers=dict(exc.headers or {}))
    return error.response()


async def _handle_engine(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    return from_engine_error(exc, prompt_param="prompt").response()


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """The catch-all: any exception no other handler took is a bug in the server. The client
    gets a 500 in the OpenAI error shape (never the internals); the traceback goes to the log.
    Starlette calls this from ServerErrorMiddleware, then re-raises for the ASGI server."""
    logger.error(
        "unhandled error on %s %s", request.method, request.url.path, exc_info=(type(exc), exc, exc.__traceback__)
    )
    return APIError(
        status_code=500, type=SERVER_ERROR, code="internal_error", message="internal server error"
    ).response()


def install_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _handle_api_error)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(EngineError, _handle_engine)
    app.add_exception_handler(Exception, _handle_unexpected)
