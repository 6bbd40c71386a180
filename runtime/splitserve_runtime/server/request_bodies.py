"""Turning a request body into its validated request model, off the event loop when large.

FastAPI decodes and validates a body parameter on the event loop; for a large body that held
``/health`` (about 1 s for a crafted 8 MiB body; see :mod:`splitserve_runtime.json_bodies`). The routes therefore take the
raw request, and :class:`RequestReader` runs :func:`parse_request` through a
:class:`~splitserve_runtime.json_bodies.BodyDecoder`: inline for a small body, in the decoder
process for a large one. :func:`parse_request` makes the decisions FastAPI made (JSON only for a
JSON content type or none, an empty body is a missing body, errors located under ``body``), so
the 400s :func:`~.errors.validation_error` builds read as before. It returns a validation
failure as data, at most :data:`~.errors.MAX_ERRORS_READ` errors and their total, so the answer
that crosses back from the process stays small whatever the body held.
"""

from __future__ import annotations

import dataclasses
import email.message
import functools
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from splitserve_runtime.json_bodies import (
    BodyDecoder,
    DecoderBusy,
    DecoderFailed,
    InvalidJSON,
    TooComplex,
    decode_body,
)
from splitserve_runtime.server.errors import MAX_ERRORS_READ, RATE_LIMIT, APIError, unavailable

M = TypeVar("M", bound=BaseModel)


@dataclasses.dataclass(frozen=True)
class InvalidBody:
    """Why a body is not a valid request: FastAPI-shaped error dicts (``loc`` starts with
    ``"body"``; no input, string context) and how many there were in all."""

    errors: list[dict[str, Any]]
    num_errors: int


class BodyValidationError(RequestValidationError):
    """A RequestValidationError that knows how many errors there were beyond those it holds."""

    def __init__(self, invalid: InvalidBody) -> None:
        super().__init__(invalid.errors)
        self.num_errors = invalid.num_errors


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _one_error(kind: str, msg: str, **ctx: str) -> InvalidBody:
    error: dict[str, Any] = {"type": kind, "loc": ("body",), "msg": msg}
    if ctx:
        error["ctx"] = ctx
    return InvalidBody(errors=[error], num_errors=1)


def parse_request(body: bytes, *, content_type: str | None, model: type[M]) -> M | InvalidBody:
    """``body`` as a validated ``model``, or why not. Runs in the decoder process for large
    bodies, so it returns its failures instead of raising them."""
    if not body:
        return _one_error("missing", "Field required")
    if not _is_json(content_type):
        return _one_error("model_attributes_type", "Input should be a valid JSON object")
    try:
        value = decode_body(body)
    except InvalidJSON as exc:  # the 400's code is invalid_json (errors.validation_error)
        return _one_error("json_invalid", "JSON decode error", error=str(exc))
    except TooComplex as exc:
        return _one_error("too_complex", f"the request body {exc}")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = []
        for error in exc.errors(include_url=False, include_input=False)[:MAX_ERRORS_READ]:
            item: dict[str, Any] = {"type": error["type"], "loc": ("body", *error["loc"]), "msg": error["msg"]}
            if "ctx" in error:
                item["ctx"] = {key: str(val) for key, val in error["ctx"].items()}
            errors.append(item)
        return InvalidBody(errors=errors, num_errors=exc.error_count())


class RequestReader:
    """Reads a route's request model from the raw request (see the module docstring)."""

    def __init__(self, decoder: BodyDecoder | None = None) -> None:
        self.decoder = decoder if decoder is not None else BodyDecoder()

    async def read(self, request: Request, model: type[M]) -> M:
        parse = functools.partial(parse_request, content_type=request.headers.get("content-type"), model=model)
        try:
            result = await self.decoder.run(parse, await request.body())
        except DecoderBusy as exc:
            raise APIError(
                status_code=429,
                type=RATE_LIMIT,
                code="rate_limit_exceeded",
                message=str(exc),
                headers={"Retry-After": "1"},
            ) from None
        except DecoderFailed as exc:
            raise unavailable(str(exc), code="decoder_failed") from None
        if isinstance(result, InvalidBody):
            raise BodyValidationError(result)
        return result

    def shutdown(self) -> None:
        self.decoder.shutdown()
