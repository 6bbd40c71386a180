"""Optional API-key check, deny by default: the one implementation the pods and the router share.

When a key is configured (env `SPLITSERVE_API_KEY`, see `contract.ENV_API_KEY`) every HTTP
route needs ``Authorization: Bearer <key>`` except the probe, scrape and pod-info paths given
as ``open_paths`` (:data:`SERVER_OPEN_PATHS` for a runtime pod, :data:`ROUTER_OPEN_PATHS` for
the router). The check is an allow-list of open paths, not a list of guarded prefixes, so a
route added later is protected without anyone remembering to protect it (vLLM's prefix list
leaked /tokenize, /invocations, ...).

The auth scheme is matched case-insensitively (RFC 7235 section 2.1: ``bearer``, ``BEARER``
and ``Bearer`` are the same scheme). The comparison hashes both sides with SHA-256 and uses
:func:`hmac.compare_digest`, so neither the key's content nor its length leaks through timing.
The key is never logged and never echoed in an error. A key variable that is set but empty
stops the process at start-up (:func:`api_key_from_env`), instead of silently serving everyone. A rejection is a 401 in the OpenAI error
shape with ``WWW-Authenticate: Bearer``. Written as pure ASGI middleware (not
BaseHTTPMiddleware) so streaming responses and disconnect detection are untouched.

This module sits at the top of ``splitserve_runtime``, outside the layers, so that both
``server`` and ``router`` (which must not import each other) can use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve_contract import ENV_API_KEY, INFO_PATH, METRICS_PATH

SERVER_OPEN_PATHS = frozenset({"/health", "/ready", METRICS_PATH, INFO_PATH})
"""A pod's open paths: probes, the Prometheus scrape and the router's pod-info poll. None
carries a secret or serves the model, and the kubelet, Prometheus and the router's health
poller send no key."""

ROUTER_OPEN_PATHS = frozenset({"/health", "/ready", METRICS_PATH})
"""The router's open paths: probes and the Prometheus scrape (it has no pod-info route)."""

OPEN_PATHS = SERVER_OPEN_PATHS
"""Kept for callers of the former ``server.auth.OPEN_PATHS``."""

UNAUTHORIZED_MESSAGE = "Missing or incorrect API key. Send it as 'Authorization: Bearer <key>'."


class APIKeyConfigError(ValueError):
    """An API key is configured but unusable: the process must not start (serving without the
    key the operator asked for would answer every client)."""


def api_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The API key of this process: None when ``SPLITSERVE_API_KEY`` is not set (no key is
    required), its value when it is. Set but empty or only whitespace (an empty Secret value, or
    an env entry that replaced the Secret reference) raises :class:`APIKeyConfigError`: an empty
    key must never mean "no key", which is what ``os.environ.get(...) or None`` made it."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_API_KEY)
    if value is None:
        return None
    if not value.strip():
        raise APIKeyConfigError(
            f"{ENV_API_KEY} is set but empty: refusing to serve without the API key (check the "
            "Secret named by spec.runtime.apiKeySecretRef, or unset the variable to serve without one)"
        )
    return value


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class APIKeyCheck:
    """The key comparison alone, for callers that are not ASGI middleware."""

    def __init__(self, *, api_key: str) -> None:
        if not api_key:
            raise ValueError("an API key check needs a non-empty api_key")
        self._expected = _digest(api_key.encode())

    def __repr__(self) -> str:  # never show the key (or its digest) in a log or traceback
        return "APIKeyCheck(<redacted>)"

    def is_authorized(self, *, authorization: bytes | None) -> bool:
        """True when ``authorization`` is ``<bearer, any case> <key>``."""
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self._expected)


class APIKeyMiddleware:
    """Rejects HTTP requests without the right bearer token with a 401 in the OpenAI shape."""

    def __init__(self, app: ASGIApp, *, api_key: str, open_paths: Iterable[str] = SERVER_OPEN_PATHS) -> None:
        if not api_key:
            raise ValueError("APIKeyMiddleware needs a non-empty api_key")
        self._app = app
        self._check = APIKeyCheck(api_key=api_key)
        self._open_paths = frozenset(open_paths)

    def __repr__(self) -> str:
        return f"APIKeyMiddleware(open_paths={sorted(self._open_paths)})"

    def is_authorized(self, *, authorization: bytes | None) -> bool:
        return self._check.is_authorized(authorization=authorization)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in self._open_paths:
            await self._app(scope, receive, send)
            return
        authorization: bytes | None = None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                authorization = value
                break
        if self.is_authorized(authorization=authorization):
            await self._app(scope, receive, send)
            return
        await send_unauthorized(send)


def unauthorized_body() -> bytes:
    return json.dumps(
        {
            "error": {
                "message": UNAUTHORIZED_MESSAGE,
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    ).encode()


async def send_unauthorized(send: Send) -> None:
    body = unauthorized_body()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
