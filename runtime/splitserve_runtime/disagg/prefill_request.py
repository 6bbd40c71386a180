"""The prefill-only request of the prefill → decode handoff, written once for its two senders.

Two processes drive a prefill pod: the builtin router (:mod:`splitserve_runtime.router.proxy`),
and a decode pod whose request names a prefill pod in a header, as a Gateway API Inference
Extension endpoint picker does (:mod:`.prefiller`). Both send the client's own request with
``max_tokens: 1``, ``stream: false`` and the :class:`~splitserve_contract.handoff.PrefillRequest`
as its :data:`~splitserve_contract.KV_TRANSFER_PARAMS_FIELD`, and take the handoff parameters
from the answer, parsed once into :class:`~splitserve_contract.handoff.HandoffParams`; the
decode pod verifies them (signature, expiry, compat hash, prompt) before it pulls. Keeping the
body and the answer's reading here means a prefill pod cannot tell, and need not know, which of
the two asked.

Standard library and the contract only: the router and the server sit side by side above this
module, and the router does not load the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD
from splitserve_contract.handoff import HandoffParams, HandoffParamsError, PrefillRequest

FORWARDED_HEADERS: Final = ("authorization", "x-session-id", "openai-organization", "openai-project")
"""Client headers a prefill (or decode) pod gets along with the request (the API key among them)."""

DROPPED_FIELDS: Final = ("max_completion_tokens", "stream_options", "min_tokens")
"""Fields of the client's request that do not apply to a one-token, unstreamed prefill."""


def prefill_request_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request body (a completion or a chat completion) as the prefill-only
    request: one token, not streamed, KV kept for a decode pod to pull."""
    out = {k: v for k, v in body.items() if k not in DROPPED_FIELDS}
    out.update({"max_tokens": 1, "stream": False, KV_TRANSFER_PARAMS_FIELD: PrefillRequest().to_json()})
    return out


def handoff_params(answer: object) -> HandoffParams | None:
    """The handoff parameters in a prefill pod's (decoded JSON) answer, parsed; None when it
    has none. Raises HandoffParamsError for parameters that are not well formed."""
    params = answer.get(KV_TRANSFER_PARAMS_FIELD) if isinstance(answer, dict) else None
    return HandoffParams.from_json(params) if isinstance(params, dict) else None


__all__ = ["DROPPED_FIELDS", "FORWARDED_HEADERS", "HandoffParamsError", "handoff_params", "prefill_request_body"]
