"""Reading a client's request body in the router: decoded off the event loop when large.

The router forwards a body it has decoded (it strips the client's ``kv_transfer_params``, reads
the prompt for affinity and adds the handoff), so it decodes every body. A large one is decoded
in :class:`~splitserve_runtime.json_bodies.BodyDecoder`'s process (decoded on the loop, 8 MiB of tiny
arrays held the router's loop about 1 s), and :func:`decode_client_body` refuses there what the
router must not forward: a body that is not JSON (``invalid_json``, as the pods say: nested too
deep or an over-long integer included, :func:`~splitserve_runtime.json_bodies.decode_body`) or
not a JSON object, one with more arrays and objects than any request needs, and one holding a
lone UTF-16 surrogate (valid JSON, ``"\\ud800"``, but no
Unicode text: the router could not re-encode it, and the pods refuse it anyway). Refusals come
back as data (:class:`BodyRefusal`) so the answer that crosses from the process stays small.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from splitserve_runtime.json_bodies import InvalidJSON, TooComplex, decode_body

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


@dataclasses.dataclass(frozen=True)
class BodyRefusal:
    """Why a body is refused with a 400 (``code`` None for a generic invalid request)."""

    message: str
    code: str | None = None


def _holds_lone_surrogate(raw: bytes, body: dict[str, Any]) -> bool:
    """Only a body with a surrogate escape is re-encoded, to tell a lone one from a pair (an
    escaped emoji)."""
    if not _SURROGATE_ESCAPE.search(raw):
        return False
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def decode_client_body(raw: bytes) -> dict[str, Any] | BodyRefusal:
    """The client's body as a JSON object, or why the router refuses it."""
    try:
        body = decode_body(raw)
    except InvalidJSON as exc:
        return BodyRefusal(f"request body is not valid JSON: {exc}", code="invalid_json")
    except TooComplex as exc:
        return BodyRefusal(f"request body {exc}")
    if not isinstance(body, dict):
        return BodyRefusal("request body must be a JSON object")
    if _holds_lone_surrogate(raw, body):
        return BodyRefusal(
            "request body is not valid Unicode text: it holds a lone UTF-16 surrogate", code="invalid_text"
        )
    return body
