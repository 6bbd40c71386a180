"""Autoscaling rounds against a real kube-apiserver (with a permissive InferenceService CRD),
with the in-memory Prometheus of :mod:`test_slo_loop`.

Defects pinned here, where only a real API server shows them:

* an SLO ``prior`` of 1e308 (finite, so admitted then; bounded to 60 s per unit now) made the status patch carry ``Infinity``,
  which the API server refuses: every round failed and the status stayed frozen;
* with autoscaling off, raising ``replicas.min`` left the pool's Deployment at its old count.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
from autoscaler_testing import bare_apiserver
from kube_testing import record_events
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry
from test_autoscaler_loop import create_pod, deployment
from test_slo_loop import NAME, NS, busy_prometheus, isvc

import splitserve_contract as contract
from splitserve_operator import kube, naming
from splitserve_operator.autoscaler.loop import run_once
from splitserve_operator.autoscaler.memory import AutoscalerState
from splitserve_operator.autoscaler.metrics import AutoscalerMetrics
from splitserve_operator.autoscaler.slo.store import SloStore

CRD = kube.Kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False)
NAMESPACE = kube.Kind("v1", "Namespace", "namespaces", namespaced=False)
SERVICE_ACCOUNT = kube.Kind("v1", "ServiceAccount", "serviceaccounts")

CLIENTS: list[k8s.ApiClient] = []  # the admin client of the module's API server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kube.Kube]:
    with bare_apiserver(tmp_path_factory.mktemp("autoscaler-apiserver")) as server:
        CLIENTS.append(server.api_client)
        api = kube.Kube(api_client=server.api_client)
        # A permissive CRD with the status subresource, as in test_autoscaler_loop: what is
        # refused here is JSON itself (Infinity), whatever the schema; crds/ has its own tests.
        api.create(
            kind=CRD,
            namespace=None,
            obj={
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{contract.PLURAL}.{contract.API_GROUP}"},
                "spec": {
                    "group": contract.API_GROUP,
                    "scope": "Namespaced",
                    "names": {"kind": contract.KIND, "plural": contract.PLURAL, "singular": contract.KIND.lower()},
                    "versions": [
                        {
                            "name": contract.API_VERSION,
                            "served": True,
                            "storage": True,
                            "subresources": {"status": {}},
                            "schema": {
                                "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                            },
                        }
                    ],
                },
            },
        )
        api.create(kind=NAMESPACE, namespace=None, obj={"metadata": {"name": NS}})
        api.create(kind=SERVICE_ACCOUNT, namespace=NS, obj={"metadata": {"name": "default"}})
        deadline = time.monotonic() + 60
        while True:  # the CRD is served a moment after it is created
            try:
                api.list(kind=kube.INFERENCE_SERVICE, namespace=NS)
                break
            except ApiException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield api


@pytest.fixture(autouse=True)
def _events(monkeypatch: pytest.MonkeyPatch) -> None:
    record_events(monkeypatch)


@pytest.fixture
def service(apiserver: kube.Kube) -> Iterator[dict[str, Any]]:
    """The InferenceService of :func:`test_slo_loop.isvc` (a sane prior), its two pool
    Deployments at 1 replica and one Ready pod each; all deleted afterwards."""
    manifest = isvc()
    manifest["metadata"] = {"name": NAME, "namespace": NS}
    apiserver.create(kind=kube.INFERENCE_SERVICE, namespace=NS, obj=manifest)
    for role in ("prefill", "decode"):
        apiserver.create(
            kind=kube.DEPLOYMENT, namespace=NS, obj=deployment(role, 1), field_manager=contract.FIELD_MANAGER_RECONCILER
        )
        create_pod(apiserver, name=f"{NAME}-{role}-0", role=role, ready=True)
    live = apiserver.get(kind=kube.INFERENCE_SERVICE, namespace=NS, name=NAME)
    assert live is not None
    yield live
    custom, apps, core = k8s.CustomObjectsApi(CLIENTS[0]), k8s.AppsV1Api(CLIENTS[0]), k8s.CoreV1Api(CLIENTS[0])
    custom.delete_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, NS, contract.PLURAL, NAME)
    for role in ("prefill", "decode"):
        apps.delete_namespaced_deployment(naming.child_name(NAME, role), NS)
        core.delete_namespaced_pod(f"{NAME}-{role}-0", NS, grace_period_seconds=0)
    for cm in apiserver.list(kind=kube.CONFIG_MAP, namespace=NS):
        core.delete_namespaced_config_map(str(cm["metadata"]["name"]), NS)


def _round(api: kube.Kube, body: dict[str, Any]) -> None:
    asyncio.run(
        run_once(
            isvc=body,
            api=api,
            prometheus=busy_prometheus(),
            state=AutoscalerState(),
            metrics=AutoscalerMetrics.create(registry=CollectorRegistry()),
            now_seconds=time.time(),
            logger=logging.getLogger("test"),
            slo_store=SloStore(),
        )
    )


def _replicas(api: kube.Kube, role: str) -> int:
    found = api.get(kind=kube.DEPLOYMENT, namespace=NS, name=naming.child_name(NAME, role))
    assert found is not None
    return int(found["spec"]["replicas"])


def test_a_huge_prior_does_not_wedge_the_status(apiserver: kube.Kube, service: dict[str, Any]) -> None:
    """The body the round reads carries the largest prior admission lets through (60 s per unit:
    1e308 is refused now, and wedged the status before), and the API server takes its status
    patch."""
    body = copy.deepcopy(service)
    for key in body["spec"]["autoscaling"]["slo"]["prior"]:
        body["spec"]["autoscaling"]["slo"]["prior"][key] = contract.defaults.SLO_MAX_COEFFICIENT_SECONDS
    _round(apiserver, body)
    live = apiserver.get(kind=kube.INFERENCE_SERVICE, namespace=NS, name=NAME)
    assert live is not None and live["status"]["decode"]["lastDecision"]["model"]
    for role in ("prefill", "decode"):
        model = live["status"][role]["lastDecision"]["model"]
        assert all(math.isfinite(float(v)) for v in model.values()), model
    active = next(c for c in live["status"]["conditions"] if c["type"] == "ScalingActive")
    assert active["status"] == "True", active


def test_with_autoscaling_off_a_raised_min_brings_the_replicas_up(
    apiserver: kube.Kube, service: dict[str, Any]
) -> None:
    patched = apiserver.merge_patch(
        kind=kube.INFERENCE_SERVICE,
        namespace=NS,
        name=NAME,
        patch={"spec": {"autoscaling": {"enabled": False}, "decode": {"replicas": {"min": 3, "max": 8}}}},
    )
    _round(apiserver, patched)
    assert _replicas(apiserver, "decode") == 3 and _replicas(apiserver, "prefill") == 1
    found = apiserver.get(kind=kube.DEPLOYMENT, namespace=NS, name=naming.child_name(NAME, "decode"))
    assert found is not None
    owners = [
        m["manager"]
        for m in found["metadata"].get("managedFields", [])
        if "f:replicas" in (m.get("fieldsV1", {}).get("f:spec") or {})
    ]
    assert owners == [contract.FIELD_MANAGER_AUTOSCALER]  # the one writer of replicas, as with autoscaling on
    live = apiserver.get(kind=kube.INFERENCE_SERVICE, namespace=NS, name=NAME)
    assert live is not None
    assert live["status"]["scalingHistory"][-1] | {"time": None} == {
        "time": None,
        "pool": "decode",
        "from": 1,
        "to": 3,
        "reason": "AtMinReplicas",
    }
    version = live["metadata"]["resourceVersion"]
    _round(apiserver, live)  # nothing left to do: no write at all
    again = apiserver.get(kind=kube.INFERENCE_SERVICE, namespace=NS, name=NAME)
    assert again is not None and again["metadata"]["resourceVersion"] == version
