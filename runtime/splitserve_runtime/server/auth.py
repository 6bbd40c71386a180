"""The pod's API-key check: the shared implementation in :mod:`splitserve_runtime.auth`.

Re-exported here so ``server.app`` keeps importing ``server.auth``; the router uses the same
module, so a pod and the router accept and reject exactly the same ``Authorization`` headers.
"""

from __future__ import annotations

from splitserve_runtime.auth import (
    OPEN_PATHS,
    SERVER_OPEN_PATHS,
    APIKeyCheck,
    APIKeyMiddleware,
    send_unauthorized,
)

__all__ = ["OPEN_PATHS", "SERVER_OPEN_PATHS", "APIKeyCheck", "APIKeyMiddleware", "send_unauthorized"]
