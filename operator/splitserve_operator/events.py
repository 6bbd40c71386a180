"""Kubernetes Events about an InferenceService: what the operator did, and what went wrong.

Events go through kopf's own poster (:func:`kopf.event`), which queues them and retries
failed posts in the background, so an unreachable API server never blocks a reconcile on
event posting. We call :func:`kopf.event` directly with an explicit type, not
``kopf.info``/``kopf.warn``: those obey ``settings.posting.level``, which the operator sets to
WARNING so that kopf's *own* chatter about handlers stays out of ``kubectl describe``, while
ours (the significant actions: children created/updated, conflicts, capacity problems,
leader changes) is always posted.

Outside a kopf handler context (unit tests, start-up) the event is only logged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any, Final, Literal

import kopf

logger = logging.getLogger(__name__)

NORMAL: Final = "Normal"
WARNING: Final = "Warning"
MAX_MESSAGE_LENGTH: Final = 1024


def _reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata", {})
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")},
    }


def post(*, obj: Mapping[str, Any], type: Literal["Normal", "Warning"], reason: str, message: str) -> None:
    """Post one Event about ``obj`` (an InferenceService or a child object)."""
    text = message if len(message) <= MAX_MESSAGE_LENGTH else message[: MAX_MESSAGE_LENGTH - 3] + "..."
    meta = obj.get("metadata", {})
    logger.log(logging.WARNING if type == WARNING else logging.INFO, "%s %s/%s: %s: %s",
               obj.get("kind"), meta.get("namespace"), meta.get("name"), reason, text)
    # Outside a kopf context (LookupError) the log line above is all we can do.
    with contextlib.suppress(LookupError):
        kopf.event(_reference(obj), type=type, reason=reason, message=text)  # type: ignore[arg-type]


def normal(*, obj: Mapping[str, Any], reason: str, message: str) -> None:
    post(obj=obj, type=NORMAL, reason=reason, message=message)


def warning(*, obj: Mapping[str, Any], reason: str, message: str) -> None:
    post(obj=obj, type=WARNING, reason=reason, message=message)
