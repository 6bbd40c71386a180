"""The operator's watch of its own Secrets (the KV handoff keys), metadata only.

Why it exists: a ``<isvc>-kv-handoff`` Secret deleted by hand must come back at once, not
at whatever next event happens to reconcile its InferenceService, and a reconcile should not
POST the Secret every time only to learn it is there (:mod:`.handoff_key`).

Why not a kopf watch like the other children's (:mod:`.handlers`): kopf watches whole objects
(and a handler's label filter is applied in the operator), so Secrets' data would reach the
operator. This watch asks the API server for Secrets with the operator's ``managed-by`` label
only, and for their metadata only (``PartialObjectMetadata``): no Secret's data ever reaches the
operator, though its RBAC (``list``, ``watch``) cannot say so.

It runs on a daemon thread: list, then watch from the list's resourceVersion; when the watch
ends (the server's timeout) it resumes from the last resourceVersion it saw, and after an error
or a 410 Gone it lists again, reporting as deleted what the new list lacks. Each change of a
Secret goes to ``on_change`` (the event type and the Secret as metadata, ``apiVersion: v1``,
``kind: Secret``); the initial listing is delivered as ``None`` events, like kopf's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

import splitserve_contract as contract

from . import handoff_key, kube

logger = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS: Final = 60
"""How long one watch request lasts (the server ends it); also bounds how long stopping waits."""
RETRY_SECONDS: Final = 5.0
MAX_RETRY_SECONDS: Final = 60.0
LABEL_SELECTOR: Final = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_VALUE}"

OnChange = Callable[[str | None, Mapping[str, Any]], None]
"""(event type: None for the initial listing, else ADDED / MODIFIED / DELETED; the Secret)."""


class MetadataAPI(Protocol):
    """What the watch uses of :class:`kube.Kube`."""

    def list_metadata(
        self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> tuple[Sequence[dict[str, Any]], str]: ...

    def watch_metadata(
        self,
        *,
        kind: kube.Kind,
        namespace: str | None,
        label_selector: str,
        resource_version: str,
        timeout_seconds: int,
    ) -> Iterator[dict[str, Any]]: ...


class SecretWatch:
    """Watches the operator's Secrets in ``namespace`` (None: all namespaces) until stopped."""

    def __init__(self, *, api: MetadataAPI, namespace: str | None, on_change: OnChange) -> None:
        self._api = api
        self._namespace = namespace
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._known: dict[tuple[str, str], dict[str, Any]] = {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="secret-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (it does at the end of its current request; it is a daemon)."""
        self._stop.set()

    def _run(self) -> None:
        self.run_until_stopped()

    def run_until_stopped(self) -> None:
        """The thread's loop (tests call it directly, with a ``stop`` from ``on_change``)."""
        delay = RETRY_SECONDS
        first = True
        while not self._stop.is_set():
            try:
                resource_version = self._relist(initial=first)
                first = False
                delay = RETRY_SECONDS
                while not self._stop.is_set() and resource_version:
                    resource_version = self._watch(resource_version)
                continue  # stopped, or too old to resume from (410): list again at once
            except kube.ApiException as exc:
                logger.warning("Watching Secrets failed (%s); listing again in %.0fs", kube.error_message(exc), delay)
            except Exception:  # noqa: BLE001 - the watch must outlive any one failure
                logger.exception("Watching Secrets failed; listing again in %.0fs", delay)
            if self._stop.wait(delay):
                return
            delay = min(MAX_RETRY_SECONDS, delay * 2)

    def _relist(self, *, initial: bool) -> str:
        items, resource_version = self._api.list_metadata(
            kind=kube.SECRET, namespace=self._namespace, label_selector=LABEL_SELECTOR
        )
        listed = {self._id(s): s for s in map(handoff_key.as_secret, items)}
        for key, gone in list(self._known.items()):
            if key not in listed:
                self._deliver("DELETED", gone)
        for key, secret in listed.items():
            before = self._known.get(key)
            if initial:
                self._deliver(None, secret)
            elif before is None or _rv(before) != _rv(secret):
                self._deliver("MODIFIED" if before is not None else "ADDED", secret)
        return resource_version

    def _watch(self, resource_version: str) -> str:
        """One watch request; the resourceVersion to resume from, or "" to list again."""
        for event in self._api.watch_metadata(
            kind=kube.SECRET,
            namespace=self._namespace,
            label_selector=LABEL_SELECTOR,
            resource_version=resource_version,
            timeout_seconds=WATCH_TIMEOUT_SECONDS,
        ):
            if self._stop.is_set():
                return ""
            kind = str(event.get("type"))
            obj = event.get("object") or {}
            if kind == "ERROR":  # 410 Gone: too old to resume from
                logger.info("Secret watch expired (%s); listing again", obj.get("message"))
                return ""
            resource_version = _rv(obj) or resource_version
            if kind == "BOOKMARK":
                continue
            self._deliver(kind, handoff_key.as_secret(obj))
        return resource_version

    @staticmethod
    def _id(secret: Mapping[str, Any]) -> tuple[str, str]:
        meta = secret.get("metadata") or {}
        return (str(meta.get("namespace")), str(meta.get("name")))

    def _deliver(self, kind: str | None, secret: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._known.pop(self._id(secret), None)
        else:
            self._known[self._id(secret)] = secret
        try:
            self._on_change(kind, secret)
        except Exception:  # noqa: BLE001
            logger.exception("Handling a Secret event failed")


def _rv(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")
