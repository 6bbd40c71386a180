"""Where the SLO controller's memory lives: a ConfigMap ``<isvc>-slo-state`` per InferenceService.

Why a ConfigMap and not memory alone: the fitted step model (:class:`.state.SloState`) is
minutes to hours of observations, and an operator restart (an upgrade, a leader change) must
not send every service back to its prior. Why not the status: the fit is machine state of a
few kilobytes, rewritten every round; status is for humans and ``kubectl get`` (the headline
numbers are there anyway, in ``status.<pool>.lastDecision.model``).

The ConfigMap carries the key :data:`STATE_KEY` (``SloState.to_json()``), the
``app.kubernetes.io/managed-by`` label, and a *non-controller* ownerReference to the
InferenceService: the garbage collector deletes it with the service, while the reconciler's
child watch (which follows controller references only, :func:`...handlers.owner_key`) never
reconciles the service for our own writes.

Requests: one GET the first time a service is seen by this process (then the state is kept in
memory), and one server-side apply per round that changed the state, at most every
``min_save_interval_seconds``; the final state of a round that was not saved is saved by a
later one. A corrupt or foreign ConfigMap gives a fresh state (``SloState.from_json`` never
raises), and a failed read or write is logged and retried later, never fails the round.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Final

import splitserve_contract as contract

from ... import kube, naming
from ..memory import ServiceKey
from .state import SloState

STATE_KEY: Final = "state.json"
"""The ConfigMap data key holding the state."""
DEFAULT_MIN_SAVE_INTERVAL_SECONDS: Final = 60.0
"""A changed state is written at most this often (the fit moves slowly; a crash loses at most
this much of it)."""

logger = logging.getLogger(__name__)


def config_map(*, namespace: str, isvc_name: str, isvc_uid: str, state_json: str) -> dict[str, Any]:
    """The whole ConfigMap the store applies (pure)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": naming.slo_state_config_map_name(isvc_name),
            "namespace": namespace,
            "labels": {contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE, contract.LABEL_INSTANCE: isvc_name},
            "ownerReferences": [
                {
                    "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
                    "kind": contract.KIND,
                    "name": isvc_name,
                    "uid": isvc_uid,
                    "controller": False,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "data": {STATE_KEY: state_json},
    }


@dataclasses.dataclass
class _Entry:
    state: SloState
    saved_json: str | None
    """What the ConfigMap holds (as far as this process knows); None: nothing yet."""
    saved_at: float | None
    """``now_seconds`` of the last write; None: never written by this process."""


@dataclasses.dataclass
class SloStore:
    """Each InferenceService's :class:`SloState`, in memory and in its ConfigMap."""

    min_save_interval_seconds: float = DEFAULT_MIN_SAVE_INTERVAL_SECONDS
    entries: dict[ServiceKey, _Entry] = dataclasses.field(default_factory=dict)

    def load(self, *, api: kube.KubeAPI, namespace: str, name: str) -> SloState:
        """The service's state: the one in memory, else the ConfigMap's (one GET), else fresh."""
        key = (namespace, name)
        entry = self.entries.get(key)
        if entry is None:
            try:
                saved_json = self._read(api=api, namespace=namespace, name=name)
            except kube.ApiException as exc:
                # Not remembered: the next round reads again rather than overwrite a good fit.
                logger.warning("Could not read the SLO state of %s/%s: %s", namespace, name, kube.error_message(exc))
                return SloState.fresh()
            state = SloState.from_json(saved_json) if saved_json is not None else SloState.fresh()
            entry = _Entry(state=state, saved_json=saved_json, saved_at=None)
            self.entries[key] = entry
        return entry.state

    def save(
        self, *, api: kube.KubeAPI, namespace: str, name: str, uid: str, now_seconds: float, force: bool = False
    ) -> bool:
        """Write the state when it changed since the last write and the last write is at least
        ``min_save_interval_seconds`` old (``force``: whenever it changed). True when written."""
        entry = self.entries.get((namespace, name))
        if entry is None:
            return False
        text = entry.state.to_json()
        if text == entry.saved_json:
            return False
        if not force and entry.saved_at is not None and now_seconds - entry.saved_at < self.min_save_interval_seconds:
            return False
        try:
            api.apply(
                obj=config_map(namespace=namespace, isvc_name=name, isvc_uid=uid, state_json=text),
                field_manager=contract.FIELD_MANAGER_AUTOSCALER,
                force=True,
            )
        except kube.ApiException as exc:
            logger.warning("Could not save the SLO state of %s/%s: %s", namespace, name, kube.error_message(exc))
            return False
        entry.saved_json, entry.saved_at = text, now_seconds
        return True

    def forget(self, *, namespace: str, name: str) -> None:
        """Drop the in-memory state (on deletion; the ConfigMap goes with its owner)."""
        self.entries.pop((namespace, name), None)

    @staticmethod
    def _read(*, api: kube.KubeAPI, namespace: str, name: str) -> str | None:
        found: Mapping[str, Any] | None = api.get(
            kind=kube.CONFIG_MAP, namespace=namespace, name=naming.slo_state_config_map_name(name)
        )
        if found is None:
            return None
        value = (found.get("data") or {}).get(STATE_KEY)
        return value if isinstance(value, str) else None
