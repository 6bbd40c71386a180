"""Optional API-key check, deny by default.

When a key is configured (env `SPLITSERVE_API_KEY`, see `contract.ENV_API_KEY`) every HTTP
route needs ``Authorization: Bearer <key>`` except the probe, scrape and pod-info paths in
:data:`OPEN_PATHS`. The check is an allow-list of open paths, not a list of guarded
prefixes, so a route added later is protected without anyone remembering to protect it
(vLLM's prefix list leaked /tokenize, /invocations, ...).

The comparison hashes both sides with SHA-256 and uses :func:`hmac.compare_digest`, so
neither the key's content nor its length leaks through timing. The key is never logged and
never echoed in an error. Written as pure ASGI middleware (not BaseHTTPMiddleware) so
streaming responses and disconnect detection are untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve_contract import INFO_PATH, METRICS_PATH

OPEN_PATHS = frozenset({"/health", "/ready", METRICS_PATH, INFO_PATH})
"""Probes, the Prometheus scrape and the router's pod-info poll: none carries a secret or
serves the model, and the kubelet, Prometheus and the router's health poller send no key."""


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class APIKeyMiddleware:
    """Rejects HTTP requests without the right bearer token with a 401 in the OpenAI shape."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        if not api_key:
            raise ValueError("APIKeyMiddleware needs a non-empty api_key")
        self._app = app
        self._expected = _digest(api_key.encode())

    def is_authorized(self, *, authorization: bytes | None) -> bool:
        if authorization is None:
            return False
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
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
        await _send_unauthorized(send)


async def _send_unauthorized(send: Send) -> None:
    body = json.dumps({"error": {
        "message": "Missing or incorrect API key. Send it as 'Authorization: Bearer <key>'.",
        "type": "authentication_error", "param": None, "code": "invalid_api_key",
    }}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]})
    await send({"type": "http.response.body", "body": body})
