"""The prefill → decode KV handoff's wire objects, defined once: their field names, their JSON
form, what is signed and the bytes a signature covers.

Why here: the handoff crosses three processes (router, prefill pod, decode pod), and a
request's ``kv_transfer_params`` (:data:`.wire.KV_TRANSFER_PARAMS_FIELD`) used to be a dict
whose field names were string literals in half a dozen modules, turned from dataclass to dict
to signed dict and back several times on its way, and authenticated over a re-serialised copy.
Now each process parses the object once where it comes in (:meth:`HandoffParams.from_json`,
which refuses anything malformed with a :class:`HandoffParamsError` naming the field), passes
the typed value on, and checks a signature over :meth:`HandoffParams.signed_bytes`: the
canonical encoding of the object *as it arrived* (every field it carried but the signature),
never over a copy rebuilt from the typed value.

Two objects, engine-neutral (they name what the handoff needs, not how an engine keeps KV):

- :class:`PrefillRequest`: what a router, or a decode pod driving its own prefill, sends a
  prefill pod: ``{"do_remote_decode": true}`` (compute the prompt, keep its KV for a pull);
- :class:`HandoffParams`: what the prefill pod answers and a decode pod receives: where the KV
  is (``remote_endpoint``, ``remote_request_id``), for which prompt (``num_prompt_tokens``,
  ``prompt_digest``: :func:`.block_hash.prompt_digest` of its token ids), the first token the
  prefill pod sampled, the KV compatibility hash, and with a handoff key ``expires_at`` and
  ``signature`` (HMAC-SHA256 over :meth:`~HandoffParams.signed_bytes`; the key and the MAC
  live in the runtime, ``splitserve_runtime.transfer.auth``). ``kv_layout`` is an engine's own
  description of a parallel pod's ranks: opaque JSON here, signed like every other field.

The KV connection's authentication fields (``nonce``, ``token``, ``proof``) and the pod-info
route's ``identity_proof`` are named here too, so the two ends of each spell them alike.

Standard library only, like the rest of the contract.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

# --------------------------------------------------------------------------- field names
DO_REMOTE_DECODE: Final = "do_remote_decode"
REMOTE_ENDPOINT: Final = "remote_endpoint"
REMOTE_REQUEST_ID: Final = "remote_request_id"
NUM_PROMPT_TOKENS: Final = "num_prompt_tokens"
FIRST_TOKEN_ID: Final = "first_token_id"
COMPAT_HASH: Final = "compat_hash"
PROMPT_DIGEST: Final = "prompt_digest"
"""The name of the prompt whose KV the parameters hand over: ``block_hash.prompt_digest`` of the
token ids the prefill pod computed. A decode pod recomputes it from its own tokenization of the
request and refuses parameters whose digest (or ``num_prompt_tokens``) differs, with or without
a handoff key, before it connects anywhere."""
EXPIRES_AT: Final = "expires_at"
SIGNATURE: Final = "signature"
KV_LAYOUT: Final = "kv_layout"

NONCE: Final = "nonce"
"""KV connection: the puller's fresh random nonce in FETCH (and the pod-info route's query)."""
TOKEN: Final = "token"
"""KV connection: FETCH's HMAC(request id, nonce)."""
PROOF: Final = "proof"
"""KV connection: LAYOUT's HMAC(request id, nonce, layout header)."""
IDENTITY_PROOF: Final = "identity_proof"
"""Pod-info answer: HMAC(nonce, role, the pod's HTTP address): the pod holds the handoff key."""

HANDOFF_FIELDS: Final = frozenset(
    {
        REMOTE_ENDPOINT,
        REMOTE_REQUEST_ID,
        NUM_PROMPT_TOKENS,
        FIRST_TOKEN_ID,
        COMPAT_HASH,
        PROMPT_DIGEST,
        EXPIRES_AT,
        SIGNATURE,
        KV_LAYOUT,
    }
)
"""Every field a :class:`HandoffParams` object may carry; any other is refused."""
SIGNED_FIELDS: Final = HANDOFF_FIELDS - {SIGNATURE}
"""What the signature covers: every field but itself (:meth:`HandoffParams.signed_bytes`)."""


class HandoffParamsError(ValueError):
    """Handoff parameters (or a prefill request) that are not well formed; ``field`` names the
    offending field ("" for the object as a whole)."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def canonical_json(body: Mapping[str, Any]) -> bytes:
    """The one byte encoding a MAC covers: sorted keys, no spaces, ASCII, no NaN. Raises
    HandoffParamsError for a body no such encoding exists for."""
    try:
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
            "ascii"
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise HandoffParamsError(f"cannot be encoded: {exc}") from None


def signed_bytes_of(body: Mapping[str, Any]) -> bytes:
    """The bytes a signature of the handoff object ``body`` covers: the canonical encoding of
    every field it carries but :data:`SIGNATURE`."""
    return canonical_json({k: v for k, v in body.items() if k != SIGNATURE})


# --------------------------------------------------------------------------- prefill request
@dataclass(frozen=True)
class PrefillRequest:
    """What a prefill pod is sent: compute the prompt and keep its KV for a decode pod."""

    do_remote_decode: bool = True

    def to_json(self) -> dict[str, Any]:
        return {DO_REMOTE_DECODE: self.do_remote_decode}

    @staticmethod
    def is_one(raw: Mapping[str, Any]) -> bool:
        """Whether a request's ``kv_transfer_params`` ask for a prefill for remote decode."""
        return raw.get(DO_REMOTE_DECODE) is True


# --------------------------------------------------------------------------- handoff params
def _get(raw: Mapping[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = raw.get(name, default)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HandoffParamsError(f"kv_transfer_params.{name} must be a {kind.__name__}, got {value!r}", field=name)
    return value


@dataclass(frozen=True, kw_only=True)
class HandoffParams:
    """Where a request's prompt KV is and what it is for (see the module docstring)."""

    remote_endpoint: str
    remote_request_id: str
    num_prompt_tokens: int
    first_token_id: int
    compat_hash: str = ""
    prompt_digest: str = ""
    """``block_hash.prompt_digest`` of the prompt the KV was computed for ("": none, which a
    decode pod refuses)."""
    expires_at: int = 0
    """Unix seconds after which the parameters are refused (signed ones only; 0: none)."""
    signature: str = ""
    """HMAC over :meth:`signed_bytes` ("": unsigned)."""
    kv_layout: Mapping[str, Any] | None = None
    """An engine's description of a parallel prefill pod's ranks (None: ``remote_endpoint``
    holds it all); opaque to the contract."""
    received: bytes | None = field(default=None, compare=False, repr=False)
    """:meth:`signed_bytes` of the object as it arrived (None: built here, not parsed)."""

    @staticmethod
    def is_one(raw: Mapping[str, Any]) -> bool:
        """Whether a request's ``kv_transfer_params`` hand over KV (as opposed to asking for it)."""
        return REMOTE_ENDPOINT in raw

    def to_json(self) -> dict[str, Any]:
        """The wire object: the digest and the layout only when set, the expiry and the
        signature only when signed."""
        body: dict[str, Any] = {
            REMOTE_ENDPOINT: self.remote_endpoint,
            REMOTE_REQUEST_ID: self.remote_request_id,
            NUM_PROMPT_TOKENS: self.num_prompt_tokens,
            FIRST_TOKEN_ID: self.first_token_id,
            COMPAT_HASH: self.compat_hash,
        }
        if self.prompt_digest:
            body[PROMPT_DIGEST] = self.prompt_digest
        if self.kv_layout is not None:
            body[KV_LAYOUT] = dict(self.kv_layout)
        if self.expires_at or self.signature:
            body[EXPIRES_AT] = self.expires_at
        if self.signature:
            body[SIGNATURE] = self.signature
        return body

    @classmethod
    def from_json(cls, raw: object) -> HandoffParams:
        """Parse a handoff object as it arrived; raises HandoffParamsError naming the bad
        field (a wrong type, a missing required field, a field this schema does not know, a
        value JSON cannot carry). Keeps the bytes a signature over it covers."""
        if not isinstance(raw, Mapping):
            raise HandoffParamsError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
        unknown = sorted(str(name) for name in raw if name not in HANDOFF_FIELDS)
        if unknown:
            raise HandoffParamsError(f"kv_transfer_params has unknown fields {unknown}", field=unknown[0])
        layout = raw.get(KV_LAYOUT)
        if layout is not None and not isinstance(layout, Mapping):
            raise HandoffParamsError(
                f"kv_transfer_params.{KV_LAYOUT} must be an object, got {layout!r}", field=KV_LAYOUT
            )
        return cls(
            remote_endpoint=_get(raw, REMOTE_ENDPOINT, str),
            remote_request_id=_get(raw, REMOTE_REQUEST_ID, str),
            num_prompt_tokens=_get(raw, NUM_PROMPT_TOKENS, int),
            first_token_id=_get(raw, FIRST_TOKEN_ID, int),
            compat_hash=_get(raw, COMPAT_HASH, str, ""),
            prompt_digest=_get(raw, PROMPT_DIGEST, str, ""),
            expires_at=_get(raw, EXPIRES_AT, int, 0),
            signature=_get(raw, SIGNATURE, str, ""),
            kv_layout=layout,
            received=signed_bytes_of(raw),
        )

    def signed_bytes(self) -> bytes:
        """What the signature covers: the object's bytes as they arrived, or (for one built
        here, to be signed) the canonical encoding of :meth:`to_json` less the signature."""
        return self.received if self.received is not None else signed_bytes_of(self.to_json())
