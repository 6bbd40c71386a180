"""Kubernetes Events about an InferenceService: what the operator did, and what went wrong.

Why our own poster and not :func:`kopf.event`: kopf finds its poster through context
variables that it sets only inside the task processing one watched object. Our reconciles
also run from the Secret watch's thread, from the coalescer's background tasks (which keep
the context of whichever request started them) and from the autoscaler's startup-spawned
loop; there ``kopf.event`` raises LookupError and the Event is lost. Because a blocker's
Warning is posted once, on the transition into it (the next reconcile sees the reason in
status already), a lost post is never repaired. So every Event goes through one
:class:`EventPoster`, installed by :mod:`main` for the process: a bounded queue drained by
one daemon thread, which posts core/v1 Events (the shape kopf posts, so ``kubectl describe``
shows them the same way), retries server errors with back-off, and never blocks a reconcile.

Events are posted with an explicit type and are always posted, unlike kopf's own chatter
about handlers, which ``settings.posting.level`` keeps at WARNING and out of
``kubectl describe``. Before :func:`install` (unit tests, start-up) they are only logged.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, Protocol

from . import kube

logger = logging.getLogger(__name__)

NORMAL: Final = "Normal"
WARNING: Final = "Warning"
MAX_MESSAGE_LENGTH: Final = 1024
QUEUE_CAPACITY: Final = 1000
"""Events waiting to be posted; beyond it new ones are dropped (logged), never blocking."""
RETRY_BACKOFF_SECONDS: Final = (1.0, 2.0, 4.0, 8.0)
"""Pauses between tries of one Event when the API server fails or cannot be reached; a
client error (4xx: the namespace is gone, the Event is invalid) is not retried."""


def _reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata", {})
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
    }


def event_body(
    *,
    obj: Mapping[str, Any],
    type: str,
    reason: str,
    message: str,
    component: str,
    instance: str,
    now: datetime.datetime,
) -> dict[str, Any]:
    """The core/v1 Event about ``obj``: the fields kopf fills, so tools read both alike."""
    stamp = now.isoformat()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"namespace": obj.get("metadata", {}).get("namespace"), "generateName": f"{component}-"},
        "type": type,
        "reason": reason,
        "message": message,
        "action": reason,
        "involvedObject": _reference(obj),
        "source": {"component": component},  # the "From" column of `kubectl describe`
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "count": 1,
    }


class Creator(Protocol):
    """The one call the poster makes (:meth:`kube.Kube.create`)."""

    def create(
        self, *, kind: kube.Kind, namespace: str | None, obj: Mapping[str, Any], field_manager: str | None = None
    ) -> dict[str, Any]: ...


class EventPoster:
    """Posts Events from any thread or task without blocking it (see the module docstring)."""

    def __init__(
        self,
        *,
        api: Creator,
        component: str,
        instance: str,
        capacity: int = QUEUE_CAPACITY,
        backoff_seconds: Sequence[float] = RETRY_BACKOFF_SECONDS,
    ) -> None:
        self._api = api
        self._component = component
        self._instance = instance[:128]
        self._backoff = tuple(backoff_seconds)
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._drain, name="event-poster", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, timeout_seconds: float = 5.0) -> None:
        """Post what is queued (waiting up to ``timeout_seconds``; the thread is a daemon, so
        an API server that keeps failing never holds the process), then stop the thread."""
        try:
            self._queue.put(None, timeout=timeout_seconds)
        except queue.Full:
            return
        self._thread.join(timeout_seconds)

    def submit(self, *, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        body = event_body(
            obj=obj,
            type=type,
            reason=reason,
            message=message,
            component=self._component,
            instance=self._instance,
            now=datetime.datetime.now(datetime.UTC),
        )
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            logger.warning("Event queue full (%d): dropped %s %s", self._queue.maxsize, type, reason)

    def _drain(self) -> None:
        while (body := self._queue.get()) is not None:
            self._post(body)

    def _post(self, body: dict[str, Any]) -> None:
        namespace = body["metadata"]["namespace"]
        for pause in (*self._backoff, None):
            try:
                self._api.create(kind=kube.EVENT, namespace=namespace, obj=body)
                return
            except Exception as exc:  # noqa: BLE001 - an Event is never worth crashing for
                status = getattr(exc, "status", None)
                if pause is None or (isinstance(status, int) and 400 <= status < 500):
                    logger.warning(
                        "Posting Event %s %s failed: %s", body["type"], body["reason"], kube.error_message(exc)
                    )
                    return
            time.sleep(pause)


_poster: EventPoster | None = None


def install(poster: EventPoster | None) -> None:
    """Where :func:`post` sends Events from now on (None: only log them)."""
    global _poster
    _poster = poster


def post(*, obj: Mapping[str, Any], type: Literal["Normal", "Warning"], reason: str, message: str) -> None:
    """Post one Event about ``obj`` (an InferenceService or a child object)."""
    text = message if len(message) <= MAX_MESSAGE_LENGTH else message[: MAX_MESSAGE_LENGTH - 3] + "..."
    meta = obj.get("metadata", {})
    logger.log(
        logging.WARNING if type == WARNING else logging.INFO,
        "%s %s/%s: %s: %s",
        obj.get("kind"),
        meta.get("namespace"),
        meta.get("name"),
        reason,
        text,
    )
    poster = _poster
    if poster is not None:
        poster.submit(obj=obj, type=type, reason=reason, message=text)


def normal(*, obj: Mapping[str, Any], reason: str, message: str) -> None:
    post(obj=obj, type=NORMAL, reason=reason, message=message)


def warning(*, obj: Mapping[str, Any], reason: str, message: str) -> None:
    post(obj=obj, type=WARNING, reason=reason, message=message)
