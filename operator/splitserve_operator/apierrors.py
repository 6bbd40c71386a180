"""Which API errors a retry can fix, and which only a new spec can.

A write the API server refuses because of what it says fails the same way on every retry,
until the InferenceService's spec changes. Retrying it with back-off forever (an Event every
few minutes, ``Reconciling=True`` for ever) hides a spec that can never apply; the reconciler
instead reports it as ``Stalled=True``/``InvalidSpec`` with the API server's message and
waits for the next generation. Permanent, as the API server answers them:

* 422 Invalid: the object breaks validation (``resources.requests[memory]: must be greater
  than or equal to 0``, a node selector term with ``operator: In`` and no values);
* 400 BadRequest: the body cannot be decoded for the kind (strict field validation);
* 500 whose message is ``failed to create typed patch object``: server-side apply could not
  even match the patch to the kind's schema (an unknown field, a string where an object
  belongs). The API server answers a 500 here, but nothing about it is transient.

Everything else may pass on a retry and is retried with back-off: other 5xx, 409 conflicts,
429 throttling, 403 (RBAC or a quota an administrator may change), 404 (a namespace still
being created), timeouts and connection errors.
"""

from __future__ import annotations

import json
from typing import Final

from . import kube

PERMANENT_STATUSES: Final = frozenset({400, 422})
TYPED_PATCH_FAILURE: Final = "failed to create typed patch object"
"""The start of the message server-side apply gives (with a 500) for a patch that does not
fit the kind's schema."""


def status_message(exc: kube.ApiException) -> str:
    """The message of the API server's Status in ``exc``'s body ("" without one)."""
    try:
        body = json.loads(exc.body or "")
    except (ValueError, TypeError):
        return str(exc.body or "")
    return str(body.get("message", "")) if isinstance(body, dict) else ""


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` would recur on every retry of the same write (see the module docstring)."""
    if not isinstance(exc, kube.ApiException):
        return False
    if exc.status in PERMANENT_STATUSES:
        return True
    return exc.status == 500 and TYPED_PATCH_FAILURE in status_message(exc)
