"""What the operator sends to the API server: every request counted by verb and resource
(``splitserve_operator_api_requests_total``), and a status write that reuses the object the
reconcile read instead of reading it again."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from typing import Any, cast

from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

import splitserve_contract as contract
from splitserve_operator import kube, main, status
from splitserve_operator.status import ConditionUpdate

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


class _Response:
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = "OK" if status < 300 else "Error"
        self._data = json.dumps(body).encode()

    def read(self) -> bytes:
        return self._data


class _FakeClient:
    """The two ApiClient calls :class:`kube.Kube` makes; 404 for names starting "missing"."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def param_serialize(
        self,
        *,
        method: str,
        resource_path: str,
        query_params: list[tuple[str, str]],
        header_params: dict[str, str],
        body: Any,
        auth_settings: list[str],
    ) -> tuple[Any, ...]:
        return method, resource_path, header_params, body, None

    def call_api(
        self, method: str, url: str, *, header_params: dict[str, str], body: Any, _request_timeout: float
    ) -> _Response:
        self.sent.append((method, url))
        if url.rsplit("/", 1)[-1].startswith("missing"):
            return _Response(404, {"kind": "Status", "message": "not found"})
        return _Response(200, {"items": []} if method == "GET" and url.endswith("s") else {"metadata": {}})


def test_every_request_is_counted_by_verb_and_resource() -> None:
    registry = CollectorRegistry()
    client = _FakeClient()
    api = kube.Kube(api_client=cast(k8s_client.ApiClient, client), on_request=main.count_requests(registry))
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "n"}}
    api.get(kind=kube.DEPLOYMENT, namespace="n", name="d")
    assert api.get(kind=kube.DEPLOYMENT, namespace="n", name="missing") is None  # a 404 counts too
    api.list(kind=kube.POD, namespace="n", label_selector="a=b")
    api.apply(obj=deployment, field_manager="m", force=True)
    api.merge_patch(kind=kube.INFERENCE_SERVICE, namespace="n", name="i", patch={}, subresource="status")
    api.create(kind=kube.SECRET, namespace="n", obj={"metadata": {"name": "s"}})
    api.replace(kind=kube.LEASE, namespace="n", name="l", obj={})
    counted = {
        (s.labels["verb"], s.labels["resource"]): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == contract.OperatorMetric.API_REQUESTS_TOTAL
    }
    assert counted == {
        ("get", "deployments"): 2,
        ("list", "pods"): 1,
        ("apply", "deployments"): 1,
        ("patch", f"{contract.PLURAL}/status"): 1,
        ("create", "secrets"): 1,
        ("update", "leases"): 1,
    }
    assert len(client.sent) == 7


class _StatusKube:
    """An InferenceService whose status the test reads and writes; counts reads."""

    def __init__(self, *, conflict_once: bool = False) -> None:
        self.obj: dict[str, Any] = {"metadata": {"name": "a", "namespace": "n", "resourceVersion": "7"}, "status": {}}
        self.gets = 0
        self.patches: list[Mapping[str, Any]] = []
        self.conflict_once = conflict_once

    def get(self, *, kind: kube.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return json.loads(json.dumps(self.obj))  # type: ignore[no-any-return]

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
        self.patches.append(patch)
        if patch["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        self.obj["status"] = {**self.obj["status"], **patch["status"]}
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
        return self.obj


def test_a_status_write_reuses_the_object_just_read() -> None:
    api = _StatusKube()
    live = api.get(kind=kube.INFERENCE_SERVICE, namespace="n", name="a")
    api.gets = 0
    status.patch_status(api=api, namespace="n", name="a", fields={"endpoint": "e"}, live=live, clock=lambda: T0)
    assert api.gets == 0 and len(api.patches) == 1
    # nothing changed: neither a read nor a write
    again = api.get(kind=kube.INFERENCE_SERVICE, namespace="n", name="a")
    api.gets = 0
    status.patch_status(api=api, namespace="n", name="a", fields={"endpoint": "e"}, live=again, clock=lambda: T0)
    assert api.gets == 0 and len(api.patches) == 1


def test_a_stale_copy_costs_one_conflict_and_a_fresh_read() -> None:
    api = _StatusKube()
    stale = api.get(kind=kube.INFERENCE_SERVICE, namespace="n", name="a")
    api.obj["metadata"]["resourceVersion"] = "8"  # someone wrote meanwhile
    api.obj["status"]["conditions"] = [{"type": "ScalingActive", "status": "True", "reason": "x"}]
    api.gets = 0
    written = status.patch_status(
        api=api,
        namespace="n",
        name="a",
        conditions=[ConditionUpdate("Ready", "True", "Reconciled")],
        live=stale,
        clock=lambda: T0,
    )
    assert api.gets == 1 and len(api.patches) == 2
    assert written is not None and {c["type"] for c in written["conditions"]} == {"ScalingActive", "Ready"}
