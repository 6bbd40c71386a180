"""An in-memory API server for whole-reconcile tests (a fake of :class:`kube.KubeAPI`, so no
``type: ignore`` is needed), the InferenceServices they reconcile and an Event recorder.

The fake keeps one namespace. ``apply`` merges like a very small server-side apply and gives
Deployments a status from ``ready_replicas`` and ``deployment_conditions``; ``create`` answers
409 AlreadyExists for an object that exists; ``errors`` makes the next writes of an object
fail with a given API error; ``writes`` records every write (kind/name, verb), and each
metadata-only list (kind, "list metadata")."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

import splitserve_contract as contract
from splitserve_operator import events, kube, reconcile

SETTINGS = reconcile.ReconcileSettings(runtime_image="splitserve:test")
NAME = "tiny"
NAMESPACE = "n"


def api_error(status: int, reason: str, message: str) -> ApiException:
    """An API error as the client raises it, with the server's Status body."""
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": status,
    }
    return ApiException(status=status, reason=reason, body=json.dumps(body))


class FakeKube:
    """An in-memory API server for one namespace: enough of :class:`kube.KubeAPI`."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.ready_replicas = 0
        self.deployment_conditions: dict[str, list[dict[str, Any]]] = {}
        """Deployment name -> its status.conditions."""
        self.errors: dict[str, ApiException] = {}
        """"Kind/name" -> the error every apply or create of that object raises."""
        self.writes: list[tuple[str, str]] = []

    def get(self, *, kind: kube.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind.kind, name))
        return copy.deepcopy(found) if found is not None else None

    def list(self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        return copy.deepcopy(self.pods) if kind is kube.POD else []

    def list_metadata(
        self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> tuple[Sequence[dict[str, Any]], str]:
        """Objects of ``kind`` as ``PartialObjectMetadata`` (a ``metadata.name=`` field selector only)."""
        self.writes.append((kind.kind, "list metadata"))
        name = field_selector.removeprefix("metadata.name=") if field_selector else None
        return (
            [
                {
                    "apiVersion": "meta.k8s.io/v1",
                    "kind": "PartialObjectMetadata",
                    "metadata": copy.deepcopy(obj.get("metadata") or {}),
                }
                for (k, n), obj in self.objects.items()
                if k == kind.kind and name in (None, n)
            ],
            "1",
        )

    def _fail(self, kind: str, name: str) -> None:
        error = self.errors.get(f"{kind}/{name}")
        if error is not None:
            raise error

    def apply(self, *, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]:
        kind, name = str(obj["kind"]), str(obj["metadata"]["name"])
        self.writes.append((f"{kind}/{name}", "apply"))
        self._fail(kind, name)
        live = self.objects.setdefault((kind, name), {"metadata": {"generation": 1, "resourceVersion": "1"}})
        for field, value in obj.items():
            if isinstance(value, dict) and isinstance(live.get(field), dict):
                live[field] = {**live[field], **copy.deepcopy(value)}
            else:
                live[field] = copy.deepcopy(value)
        if kind == "Deployment":
            replicas = int(live["spec"].get("replicas", 1))
            live["status"] = {
                "observedGeneration": 1,
                "replicas": replicas,
                "updatedReplicas": replicas,
                "availableReplicas": self.ready_replicas,
                "readyReplicas": self.ready_replicas,
                "conditions": copy.deepcopy(self.deployment_conditions.get(name, [])),
            }
        return copy.deepcopy(live)

    def create(
        self, *, kind: kube.Kind, namespace: str | None, obj: Mapping[str, Any], field_manager: str | None = None
    ) -> dict[str, Any]:
        name = str(obj["metadata"]["name"])
        self.writes.append((f"{kind.kind}/{name}", "create"))
        self._fail(kind.kind, name)
        if (kind.kind, name) in self.objects:
            raise api_error(409, "AlreadyExists", f'{kind.plural} "{name}" already exists')
        self.objects[(kind.kind, name)] = copy.deepcopy(dict(obj))
        return copy.deepcopy(dict(obj))

    def merge_patch(
        self,
        *,
        kind: kube.Kind,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        self.writes.append((f"{kind.kind}/{name}", f"patch {subresource or ''}".strip()))
        live = self.objects[(kind.kind, name)]
        status = dict(live.get("status") or {})
        for key, value in dict(patch.get("status") or {}).items():
            if value is None:
                status.pop(key, None)
            elif isinstance(value, dict) and isinstance(status.get(key), dict):
                status[key] = {**status[key], **value}
            else:
                status[key] = value
        live["status"] = status
        return copy.deepcopy(live)


def isvc_obj(*, mode: str = "Aggregated", generation: int = 1, **pool: Any) -> dict[str, Any]:
    """An InferenceService named :data:`NAME`; ``pool`` goes into each pool's spec."""
    pool_spec = {"replicas": {"min": 1, "max": 1}, "resources": {"gpus": 0}, **pool}
    pools = (
        {"aggregated": pool_spec}
        if mode == "Aggregated"
        else {"prefill": copy.deepcopy(pool_spec), "decode": copy.deepcopy(pool_spec)}
    )
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "metadata": {
            "name": NAME,
            "namespace": NAMESPACE,
            "uid": "uid-1",
            "generation": generation,
            "resourceVersion": "1",
        },
        "spec": {"model": {"uri": "hf://nobody/not-in-cache"}, "mode": mode, **pools},
    }


def run(fake: FakeKube, obj: dict[str, Any] | None = None) -> tuple[reconcile.Result, dict[str, dict[str, Any]]]:
    """Reconcile the stored InferenceService (``obj`` replaces it first, status kept);
    the result and its conditions by type."""
    key = (contract.KIND, NAME)
    if obj is not None:
        status = (fake.objects.get(key) or {}).get("status")
        fake.objects[key] = copy.deepcopy(obj) | ({"status": status} if status else {})
    fake.objects.setdefault(key, isvc_obj())
    live = fake.get(kind=kube.INFERENCE_SERVICE, namespace=NAMESPACE, name=NAME)
    assert live is not None
    result = reconcile.reconcile(api=fake, obj=live, settings=SETTINGS, nodes=reconcile.NodeCache())
    conditions = (fake.objects[key].get("status") or {}).get("conditions") or []
    return result, {c["type"]: c for c in conditions}


def record_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """Events the reconciler posts, as (type, reason, message), instead of posting them."""
    out: list[tuple[str, str, str]] = []

    def post(*, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        out.append((type, reason, message))

    monkeypatch.setattr(events, "post", post)
    return out
