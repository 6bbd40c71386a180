"""Who may take part in a KV handoff: the per-InferenceService key, or loopback only.

Why: ``kv_transfer_params`` tell a decode pod which host:port to connect to and whose KV to
write into its cache. Taken from a client as they were, they made the decode pod connect
anywhere (a port scanner: open and closed ports answer differently) and let anyone who could
answer on a port inject KV. So handoff parameters must come from our own prefill pods, and
each KV connection must join two of our own pods.

How, with a key (``--handoff-key-file``: the Secret
``<InferenceService>`` + ``contract.HANDOFF_KEY_SECRET_SUFFIX`` that the operator creates and
mounts into the prefill and decode pods of one InferenceService):

- the prefill pod signs the parameters it answers with: an HMAC-SHA256 over a canonical JSON
  encoding of every field (endpoint, request id, prompt length, first token, compat hash, the
  prompt's digest) plus an expiry (``expires_at``, Unix seconds: the KV lease), carried in
  ``signature``; the schema, the signed field set and those bytes are
  :class:`splitserve_contract.handoff.HandoffParams`'s, and the decode pod checks the
  signature over the bytes of the object as it arrived (:meth:`HandoffAuth.verify_params`),
  once, where it parses them;
- the decode pod checks the signature (constant-time compare), the expiry (allowing
  :data:`CLOCK_SKEW_SECONDS` between nodes) and that the compat hash is its own *before* it
  opens any connection; so it connects only to an endpoint one of our prefill pods named for
  itself, and a forged, altered, replayed-late or foreign-pool handoff is a client error;
- on the KV port, FETCH carries a fresh random nonce and a token, HMAC(request id, nonce):
  the prefill pod's server streams nothing (no LAYOUT, no BLOCK, not even whether the request
  exists) to a puller without a valid token; its LAYOUT answer carries a proof,
  HMAC(request id, nonce, the layout header), which the decode pod checks before it accepts
  a single block, so a stranger answering on that address cannot feed it KV.

What is signed binds the prompt: ``prompt_digest`` (``splitserve_contract.block_hash.prompt_digest``
of the token ids whose KV the prefill pod kept) and ``num_prompt_tokens``. The decode pod
recomputes both from its own tokenization of the request it was sent and refuses
(``prompt_mismatch``) parameters computed for any other prompt, before it reserves a block or
opens a connection. Without that check, signed parameters of prompt A presented with a prompt B
of the same length made the decode pod answer with A's continuation and index A's KV in its
prefix cache under B's block hashes, serving every later request that starts with B the wrong
KV (a cross-user cache poisoning). The digest is checked with or without a key: it is no
secret, and it protects the cache, not the connection.

A decode pod behind a Gateway endpoint picker (``--prefill-headers``) sends the client's
request, with the client's API key, to the prefill pod a header names, and a client that reaches
the decode pod can write that header itself. So before anything goes to a named address, the
decode pod asks that address's pod-info route to prove it holds the key: a fresh nonce in,
HMAC(nonce, role, the pod's own HTTP address) out (purpose ``identity``). Only a prefill pod of
the same InferenceService, serving at the very address named, passes (a relay that passes the
nonce on to a real pod gets that pod's address signed, not its own); any other address gets one
GET carrying a random nonce and nothing else, and without a key only loopback addresses are
contacted.

Each MAC is domain-separated by its purpose (``params``, ``fetch``, ``layout``, ``identity``), so one can
never be replayed as another. The BLOCK frames themselves are protected by their CRC (against
corruption) and by this authenticated start of the connection, not by a MAC: an attacker on
the path between two pods is out of scope here (that needs TLS), a stranger is not.

Without a key (a development setup on one machine, or the aggregated role) the handoff is
confined to loopback: a decode pod accepts only parameters naming a loopback endpoint
(127.0.0.0/8, ::1, localhost) and connects nowhere else, and a prefill pod's KV server serves
only loopback peers. This keeps the tests' loopback processes working, and makes the
unauthenticated mode unable to reach, or be reached from, another host. The pods log
a warning at start-up when they run a prefill or decode role without a key.

The key is never logged, echoed or shown in a ``repr``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from splitserve_contract.block_hash import prompt_digest
from splitserve_contract.handoff import (
    COMPAT_HASH,
    EXPIRES_AT,
    NONCE,
    NUM_PROMPT_TOKENS,
    PROMPT_DIGEST,
    PROOF,
    REMOTE_ENDPOINT,
    SIGNATURE,
    TOKEN,
    HandoffParams,
    HandoffParamsError,
    canonical_json,
    signed_bytes_of,
)

MIN_KEY_BYTES = 16
"""A shorter key file is refused at start-up (the operator writes 32 random bytes)."""
CLOCK_SKEW_SECONDS = 30.0
"""How far a decode pod's clock may be behind or ahead of the signing prefill pod's."""
MAX_NONCE_CHARS = 64
_DOMAIN = b"splitserve/kv-handoff/v1"
_MAC_HEX_CHARS = 2 * hashlib.sha256().digest_size


class HandoffRejected(Exception):
    """A handoff or KV connection this pod must not take part in. ``code`` is stable for logs
    and errors: unsigned, bad_signature, expired, compat_mismatch, prompt_mismatch,
    endpoint_not_allowed, malformed, unauthorized (a puller), unauthenticated (a server)."""

    def __init__(self, *, code: str, message: str) -> None:
        super().__init__(f"KV handoff refused ({code}): {message}")
        self.code = code
        self.message = message


def _encoded(encode: Callable[[], bytes]) -> bytes:
    """``encode()``'s canonical bytes; a body no encoding exists for is ``malformed``."""
    try:
        return encode()
    except HandoffParamsError as exc:
        raise HandoffRejected(code="malformed", message=str(exc)) from None


def check_prompt(*, digest: object, num_prompt_tokens: object, prompt_token_ids: Sequence[int]) -> None:
    """Raise HandoffRejected (``prompt_mismatch``) unless the handoff's ``digest`` and
    ``num_prompt_tokens`` name this prompt: the same number of tokens and the same
    :func:`~splitserve_contract.block_hash.prompt_digest`. Part of every handoff check; needs
    no key."""
    if not isinstance(digest, str) or not digest:
        raise HandoffRejected(
            code="prompt_mismatch",
            message=(
                f"the handoff parameters carry no {PROMPT_DIGEST}, so nothing says which prompt their KV belongs to"
            ),
        )
    if num_prompt_tokens != len(prompt_token_ids):
        raise HandoffRejected(
            code="prompt_mismatch",
            message=(
                f"the handoff parameters are for a prompt of {num_prompt_tokens!r} tokens; this "
                f"request's prompt has {len(prompt_token_ids)}"
            ),
        )
    try:
        expected = prompt_digest(prompt_token_ids)
    except ValueError as exc:
        raise HandoffRejected(code="prompt_mismatch", message=str(exc)) from None
    if digest != expected:
        raise HandoffRejected(
            code="prompt_mismatch",
            message=(
                f"the handoff parameters were computed for another prompt of the same length ({PROMPT_DIGEST} differs)"
            ),
        )


def canonical_endpoint(endpoint: str) -> str:
    """``host:port`` spelt one way: an IP literal normalised (IPv6 without brackets, lower
    case, zeros compressed), a name lower-cased; "" when ``endpoint`` is not ``host:port``."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return ""
    host = host.strip("[]").lower()
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))
    return f"{host}:{int(port)}"


def _identity_body(*, nonce: str, role: str, endpoint: str) -> dict[str, str]:
    return {NONCE: nonce, "role": role, "endpoint": canonical_endpoint(endpoint)}


def _is_nonce(nonce: object) -> bool:
    return isinstance(nonce, str) and 0 < len(nonce) <= MAX_NONCE_CHARS and nonce.isascii() and nonce.isalnum()


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP literal, bracketed or not, or ``localhost``) is loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_host(endpoint: str) -> str:
    """The host part of ``host:port`` (IPv6 in brackets or not); "" when there is none."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return ""
    return host.strip("[]")


class HandoffKey:
    """The shared secret of one InferenceService's prefill and decode pods."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a KV handoff key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    @classmethod
    def from_file(cls, path: str | Path) -> HandoffKey:
        """Read the key: the file's bytes as they are (the operator's key is 32 random bytes,
        which may start or end with whitespace bytes), less one trailing newline that a key
        written by hand with an editor carries. Raises ValueError naming the file, never its
        content."""
        try:
            key = Path(path).read_bytes().removesuffix(b"\n")
        except OSError as exc:
            raise ValueError(
                f"cannot read the KV handoff key file {str(path)!r}: {exc.strerror or type(exc).__name__}"
            ) from None
        try:
            return cls(key)
        except ValueError as exc:
            raise ValueError(f"KV handoff key file {str(path)!r}: {exc}") from None

    def __repr__(self) -> str:
        return "HandoffKey(<redacted>)"

    def mac(self, purpose: str, body: Mapping[str, Any]) -> str:
        """Hex HMAC-SHA256 of ``body``'s canonical encoding, bound to ``purpose``."""
        return self.mac_bytes(purpose, _encoded(lambda: canonical_json(body)))

    def mac_bytes(self, purpose: str, data: bytes) -> str:
        """Hex HMAC-SHA256 of ``data`` (canonical bytes), bound to ``purpose``."""
        message = b"\0".join((_DOMAIN, purpose.encode("ascii"), data))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def verify(self, purpose: str, body: Mapping[str, Any], mac: object) -> bool:
        """Constant-time check of ``mac`` (anything a peer sent) against ``body``."""
        return self.verify_bytes(purpose, _encoded(lambda: canonical_json(body)), mac)

    def verify_bytes(self, purpose: str, data: bytes, mac: object) -> bool:
        """Constant-time check of ``mac`` against the canonical bytes ``data``."""
        if not isinstance(mac, str) or len(mac) != _MAC_HEX_CHARS or not mac.isascii():
            return False
        return hmac.compare_digest(self.mac_bytes(purpose, data).encode("ascii"), mac.encode("ascii"))


class HandoffAuth:
    """One pod's handoff policy: authenticated with ``key``, loopback-only without one."""

    def __init__(self, *, key: HandoffKey | None, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._clock = clock

    def __repr__(self) -> str:
        return f"HandoffAuth({'keyed' if self._key is not None else 'loopback only'})"

    @property
    def keyed(self) -> bool:
        return self._key is not None

    # ------------------------------------------------------------------ handoff parameters
    def sign_params(self, params: HandoffParams, *, lifetime_seconds: float) -> HandoffParams:
        """Prefill side: ``params`` with an expiry and their signature over
        :meth:`~HandoffParams.signed_bytes` (unsigned, no expiry, without a key)."""
        unsigned = dataclasses.replace(params, expires_at=0, signature="", received=None)
        if self._key is None:
            return unsigned
        dated = dataclasses.replace(unsigned, expires_at=math.ceil(self._clock() + lifetime_seconds))
        return dataclasses.replace(dated, signature=self._key.mac_bytes("params", dated.signed_bytes()))

    def sign(self, params: Mapping[str, Any], *, lifetime_seconds: float) -> dict[str, Any]:
        """:meth:`sign_params` for a handoff object that is a plain JSON object (tests,
        harnesses): ``params`` plus an expiry and their signature (unchanged without a key)."""
        body = {k: v for k, v in params.items() if k not in (SIGNATURE, EXPIRES_AT)}
        if self._key is None:
            return body
        body[EXPIRES_AT] = math.ceil(self._clock() + lifetime_seconds)
        body[SIGNATURE] = self._key.mac_bytes("params", _encoded(lambda: signed_bytes_of(body)))
        return body

    def verify_params(self, params: HandoffParams, *, compat_hash: str, prompt_token_ids: Sequence[int]) -> None:
        """Decode side, once, where the parameters come in and before any connection: raise
        HandoffRejected unless ``params`` come from a prefill pod of this pool (the signature
        over the bytes that arrived) and were computed for ``prompt_token_ids``, the prompt
        this pod was given (see the module docstring)."""
        self._check(
            endpoint=params.remote_endpoint,
            signature=params.signature or None,
            expires_at=params.expires_at,
            signed=params.signed_bytes,
            params_compat_hash=params.compat_hash,
            compat_hash=compat_hash,
        )
        check_prompt(
            digest=params.prompt_digest, num_prompt_tokens=params.num_prompt_tokens, prompt_token_ids=prompt_token_ids
        )

    def check_params(self, params: Mapping[str, Any], *, compat_hash: str, prompt_token_ids: Sequence[int]) -> None:
        """:meth:`verify_params` for a handoff object that is a plain JSON object, not parsed
        (any value of any field: what a fuzzer or a forger sends)."""
        self._check(
            endpoint=params.get(REMOTE_ENDPOINT),
            signature=params.get(SIGNATURE),
            expires_at=params.get(EXPIRES_AT),
            signed=lambda: signed_bytes_of(params),
            params_compat_hash=params.get(COMPAT_HASH, ""),
            compat_hash=compat_hash,
        )
        check_prompt(
            digest=params.get(PROMPT_DIGEST),
            num_prompt_tokens=params.get(NUM_PROMPT_TOKENS),
            prompt_token_ids=prompt_token_ids,
        )

    def _check(
        self,
        *,
        endpoint: object,
        signature: object,
        expires_at: object,
        signed: Callable[[], bytes],
        params_compat_hash: object,
        compat_hash: str,
    ) -> None:
        """Who may hand over: with a key, a valid unexpired signature over ``signed()``;
        without one, a loopback endpoint; either way this pod's compat hash."""
        if self._key is None:
            if not isinstance(endpoint, str) or not is_loopback_host(endpoint_host(endpoint)):
                raise HandoffRejected(
                    code="endpoint_not_allowed",
                    message=(
                        f"{REMOTE_ENDPOINT} {endpoint!r} is not a loopback address, and this pod has "
                        "no KV handoff key (--handoff-key-file) to authenticate a handoff with"
                    ),
                )
        else:
            if signature is None:
                raise HandoffRejected(
                    code="unsigned",
                    message=(
                        f"the handoff parameters carry no {SIGNATURE}; only this "
                        "InferenceService's prefill pods can hand a request to this pod"
                    ),
                )
            if not self._key.verify_bytes("params", _encoded(signed), signature):
                raise HandoffRejected(
                    code="bad_signature",
                    message=("the handoff parameters are not signed with this InferenceService's key"),
                )
            if not isinstance(expires_at, int) or isinstance(expires_at, bool):
                raise HandoffRejected(code="malformed", message=f"{EXPIRES_AT} must be an integer")
            if self._clock() > expires_at + CLOCK_SKEW_SECONDS:
                raise HandoffRejected(
                    code="expired", message=(f"the handoff parameters expired at {expires_at} (Unix time)")
                )
        if params_compat_hash != compat_hash:
            raise HandoffRejected(
                code="compat_mismatch",
                message=(f"the prefill pod's compat hash {params_compat_hash!r} is not this pod's {compat_hash!r}"),
            )

    # ------------------------------------------------------------------ a named prefill pod
    def identity_proof(self, *, nonce: str, role: str, endpoint: str) -> str | None:
        """Prefill side, at the pod-info route: proof that this pod holds the key, bound to the
        asker's fresh ``nonce``, this pod's ``role`` and the HTTP ``endpoint`` it serves at (its
        own address, never one the asker names: a relay that passes the nonce on to a real pod
        gets a proof for that pod's address, not its own). None without a key, or for a nonce
        no asker of ours sends."""
        if self._key is None or not _is_nonce(nonce) or not endpoint:
            return None
        return self._key.mac("identity", _identity_body(nonce=nonce, role=role, endpoint=endpoint))

    def check_identity(self, *, endpoint: str, nonce: str, role: str, proof: object) -> None:
        """Decode side, before a request (and the client's credentials with it) goes to an
        address an endpoint picker's header named: the pod at ``endpoint`` must prove it holds
        this InferenceService's key for ``nonce``, as a pod of ``role`` serving at that very
        address. Without a key, loopback only. Raises HandoffRejected."""
        if self._key is None:
            self.check_endpoint(endpoint)
            return
        if not self._key.verify("identity", _identity_body(nonce=nonce, role=role, endpoint=endpoint), proof):
            raise HandoffRejected(
                code="unauthenticated",
                message=(
                    f"{endpoint!r} did not prove it is a {role} pod of this InferenceService serving "
                    "at that address (KV handoff key)"
                ),
            )

    # ------------------------------------------------------------------ the KV connection
    def check_endpoint(self, endpoint: str) -> None:
        """Puller side, before connecting: without a key, loopback only."""
        if self._key is None and not is_loopback_host(endpoint_host(endpoint)):
            raise HandoffRejected(
                code="endpoint_not_allowed",
                message=(f"{endpoint!r} is not a loopback address and this pod has no KV handoff key"),
            )

    @staticmethod
    def new_nonce() -> str:
        return secrets.token_hex(16)

    def fetch_credentials(self, *, request_id: str, nonce: str) -> dict[str, str]:
        """Puller side: the fields FETCH carries to prove who asks (none without a key)."""
        if self._key is None:
            return {}
        return {NONCE: nonce, TOKEN: self._key.mac("fetch", {"request_id": request_id, NONCE: nonce})}

    def check_fetch(self, body: Mapping[str, Any], *, peer_host: str) -> str:
        """Server side, before anything is sent: the puller's nonce if it proved it holds the
        key (or, without a key, if it is on loopback); raises HandoffRejected otherwise."""
        if self._key is None:
            if not is_loopback_host(peer_host):
                raise HandoffRejected(
                    code="unauthorized",
                    message=(f"peer {peer_host!r} is not on loopback and this pod has no KV handoff key"),
                )
            return ""
        nonce = body.get(NONCE)
        request_id = body.get("request_id")
        if (
            not isinstance(nonce, str)
            or not 0 < len(nonce) <= MAX_NONCE_CHARS
            or not isinstance(request_id, str)
            or not self._key.verify("fetch", {"request_id": request_id, NONCE: nonce}, body.get(TOKEN))
        ):
            raise HandoffRejected(
                code="unauthorized", message=("the FETCH carries no valid token for this InferenceService's key")
            )
        return nonce

    def layout_proof(self, *, request_id: str, nonce: str, header: Mapping[str, Any]) -> dict[str, str]:
        """Server side: the field LAYOUT carries to prove it comes from a pod with the key."""
        if self._key is None:
            return {}
        body = {"request_id": request_id, NONCE: nonce, "layout": dict(header)}
        return {PROOF: self._key.mac("layout", body)}

    def check_layout(self, header: Mapping[str, Any], *, request_id: str, nonce: str) -> None:
        """Puller side, before any block is accepted: LAYOUT must prove the server holds the
        key and answers this very FETCH (the nonce). No-op without a key."""
        if self._key is None:
            return
        body = {"request_id": request_id, NONCE: nonce, "layout": {k: v for k, v in header.items() if k != PROOF}}
        if not self._key.verify("layout", body, header.get(PROOF)):
            raise HandoffRejected(
                code="unauthenticated", message=("the KV server did not prove it holds this InferenceService's key")
            )
