"""One autoscaling round end to end: a real kube-apiserver (with etcd, no controllers), the
generated CRD, and a real Prometheus scraping fake pods' gauges.

The test plays the missing controllers itself: it creates the pool Deployments and their
pods, and sets the pods' status (Ready, or Pending for lack of GPUs) through the status
subresource. Then it checks what :func:`run_once` wrote: ``spec.replicas`` owned by the
autoscaler's field manager, deletion costs before a scale-down, the decisions, history and
conditions in status, and no write at all in dry run or while paused.

Binaries are the harness' builds (etcd, kube-apiserver, Prometheus). Nothing here sleeps to
order events: the tests wait for Prometheus' window to hold the new values, for the loop's
rounds and ticks (counted through its injected clock), or for objects to change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from autoscaler_testing import (
    FakePod,
    bare_apiserver,
    free_port,
    running_prometheus,
    wait_for_window,
    wait_until,
)
from kubernetes import client as k8s
from prometheus_api_client import PrometheusConnect
from prometheus_client import CollectorRegistry

from splitserve_contract import (
    ANNOTATION_POD_DELETION_COST,
    API_GROUP,
    API_VERSION,
    FIELD_MANAGER_AUTOSCALER,
    FIELD_MANAGER_RECONCILER,
    KIND,
    PLURAL,
    Metric,
)
from splitserve_operator import events as operator_events
from splitserve_operator import kube, naming
from splitserve_operator.autoscaler.loop import make_prometheus, register, run_once
from splitserve_operator.autoscaler.memory import AutoscalerState
from splitserve_operator.autoscaler.metrics import AutoscalerMetrics

NS = "ns"
NS_KOPF = "kopf"
CRD = kube.Kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False)
NAMESPACE = kube.Kind("v1", "Namespace", "namespaces", namespaced=False)
SERVICE_ACCOUNT = kube.Kind("v1", "ServiceAccount", "serviceaccounts")
EVENT = kube.EVENT
CLIENTS: list[k8s.ApiClient] = []  # the admin client of the module's API server
NAME = "svc"

pytestmark = pytest.mark.slow


def gauges(*, waiting: float, running: float, kv: float) -> dict[str, float]:
    return {
        Metric.REQUESTS_WAITING: waiting,
        Metric.REQUESTS_RUNNING: running,
        Metric.KV_CACHE_USAGE_RATIO: kv,
        Metric.PROMPT_TOKENS_WAITING: 0.0,
    }


POD_A = FakePod(NS, "svc-decode-a", "decode", gauges(waiting=6, running=5, kv=0.9))
POD_B = FakePod(NS, "svc-decode-b", "decode", gauges(waiting=4, running=3, kv=0.5))
POD_C = FakePod(NS, "svc-prefill-c", "prefill", gauges(waiting=12, running=1, kv=0.1))


@dataclasses.dataclass(frozen=True)
class Cluster:
    api: kube.Kube
    url: str
    pki: Any

    def login(self, **_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(
            server=self.url,
            ca_path=str(self.pki.ca_cert),
            certificate_path=str(self.pki.admin.cert),
            private_key_path=str(self.pki.admin.key),
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with bare_apiserver(tmp_path_factory.mktemp("cluster")) as server:
        api_client = server.api_client
        CLIENTS.append(api_client)
        # A permissive CRD with the status subresource: this test is about the autoscaler,
        # which validates objects itself (InferenceService.parse); crds/ has its own tests.
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
            "spec": {
                "group": API_GROUP,
                "scope": "Namespaced",
                "names": {"kind": KIND, "plural": PLURAL, "singular": KIND.lower()},
                "versions": [
                    {
                        "name": API_VERSION,
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                ],
            },
        }
        api = kube.Kube(api_client=api_client)
        api.create(kind=CRD, namespace=None, obj=crd)
        # no controller-manager here: create the ServiceAccounts pods need
        for namespace in (NS, NS_KOPF):
            api.create(kind=NAMESPACE, namespace=None, obj={"metadata": {"name": namespace}})
            api.create(kind=SERVICE_ACCOUNT, namespace=namespace, obj={"metadata": {"name": "default"}})
        yield Cluster(api=api, url=server.url, pki=server.pki)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusConnect]:
    with running_prometheus(pods=[POD_A, POD_B, POD_C], workdir=tmp_path_factory.mktemp("prometheus")) as client:
        yield client


def isvc_manifest(*, namespace: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": "splitserve.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"uri": "hf://splitserve/tiny-llama"},
            "mode": "Disaggregated",
            "prefill": {"replicas": {"min": 1, "max": 4}, "resources": {"gpus": 1}},
            "decode": {"replicas": {"min": 1, "max": 8}, "resources": {"gpus": 1}},
            "autoscaling": {
                "interval": "5s",
                "prefill": {"targetQueueDepth": 4},
                "decode": {"targetKVCacheUtilization": 0.8, "targetQueueDepth": 2},
                "behavior": {"scaleDown": {"stabilizationSeconds": 0, "maxStep": 1}},
                "gpuBudget": 8,
            },
        },
    }


def deployment(role: str, replicas: int, *, namespace: str = NS) -> dict[str, Any]:
    labels = naming.labels(NAME, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": naming.child_name(NAME, role), "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": naming.selector_labels(NAME, role)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "runtime", "image": "splitserve:test"}]},
            },
        },
    }


def create_pod(api: kube.Kube, *, name: str, role: str, ready: bool, namespace: str = NS) -> None:
    api.create(
        kind=kube.POD,
        namespace=namespace,
        obj={
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": naming.labels(NAME, role)},
            "spec": {"containers": [{"name": "runtime", "image": "splitserve:test"}]},
        },
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if ready:
        pod_status = {
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Ready", "status": "True", "lastTransitionTime": now},
            ],
        }
    else:
        pod_status = {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "lastTransitionTime": now,
                    "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
                }
            ],
        }
    api.merge_patch(kind=kube.POD, namespace=namespace, name=name, patch={"status": pod_status}, subresource="status")


def replicas_and_owner(api: kube.Kube, role: str) -> tuple[int, list[str]]:
    obj = api.get(kind=kube.DEPLOYMENT, namespace=NS, name=naming.child_name(NAME, role))
    assert obj is not None
    owners = [
        m["manager"]
        for m in obj["metadata"].get("managedFields", [])
        if "f:replicas" in (m.get("fieldsV1", {}).get("f:spec") or {})
    ]
    return int(obj["spec"]["replicas"]), owners


def isvc(api: kube.Kube, *, namespace: str = NS) -> dict[str, Any]:
    obj = api.get(kind=kube.INFERENCE_SERVICE, namespace=namespace, name=NAME)
    assert obj is not None
    return obj


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


async def test_rounds_scale_record_and_hold(cluster: Cluster, prometheus: PrometheusConnect) -> None:
    api = cluster.api
    log = logging.getLogger("test-autoscaler")
    state = AutoscalerState()
    metrics = AutoscalerMetrics.create(registry=CollectorRegistry())
    api.create(kind=kube.INFERENCE_SERVICE, namespace=NS, obj=isvc_manifest())
    for role, replicas in (("prefill", 1), ("decode", 3)):
        api.create(
            kind=kube.DEPLOYMENT, namespace=NS, obj=deployment(role, replicas), field_manager=FIELD_MANAGER_RECONCILER
        )
    create_pod(api, name=POD_C.name, role="prefill", ready=True)
    create_pod(api, name=POD_A.name, role="decode", ready=True)
    create_pod(api, name=POD_B.name, role="decode", ready=True)
    create_pod(api, name="svc-decode-pending", role="decode", ready=False)

    async def round_() -> dict[str, Any]:
        decisions = await run_once(
            isvc=isvc(api),
            api=api,
            prometheus=prometheus,
            state=state,
            metrics=metrics,
            now_seconds=time.time(),
            logger=log,
            scrape_interval_seconds=1,
            window_seconds=2,
        )
        return {d.pool: d for d in decisions}

    # Round 1: prefill queue 12 on 1 pod (target 4) -> 3, step-limited to 2. Decode queue
    # 10/2 ready = 5 per pod (target 2) wants 5, but a pod is Pending for GPUs: held at 3.
    d = await round_()
    assert (d["prefill"].result, d["prefill"].reason) == (2, "ScaledUp"), d["prefill"].formula
    assert (d["decode"].result, d["decode"].reason) == (3, "PendingPods"), d["decode"].formula
    assert replicas_and_owner(api, "prefill") == (2, [FIELD_MANAGER_AUTOSCALER])
    assert replicas_and_owner(api, "decode")[0] == 3
    obj = isvc(api)
    assert obj["status"]["prefill"]["lastDecision"]["reason"] == "ScaledUp"
    assert obj["status"]["prefill"]["desiredReplicas"] == 2
    assert obj["status"]["decode"]["lastDecision"]["inputs"]["pendingReplicas"] == 1
    assert [(e["pool"], e["from"], e["to"]) for e in obj["status"]["scalingHistory"]] == [("prefill", 1, 2)]
    assert condition(obj, "MetricsHealthy")["status"] == "True"
    assert condition(obj, "ScalingActive")["status"] == "True"
    assert metrics.desired_replicas.labels(NS, NAME, "prefill")._value.get() == 2

    # Round 2: decode goes idle. The Pending pod is dropped for free, one Ready pod by the
    # step: 3 -> 1. Before that, the busier pod (b: 3 running) gets the higher deletion cost.
    for pod in (POD_A, POD_B):
        pod.set(Metric.REQUESTS_WAITING, 0)
        pod.set(Metric.KV_CACHE_USAGE_RATIO, 0.1)
    POD_A.set(Metric.REQUESTS_RUNNING, 0)
    wait_for_window(
        prometheus,
        window_seconds=2,
        values={  # the 2 s window holds only the new values
            (POD_A.name, Metric.REQUESTS_WAITING): 0,
            (POD_B.name, Metric.REQUESTS_WAITING): 0,
            (POD_A.name, Metric.KV_CACHE_USAGE_RATIO): 0.1,
            (POD_B.name, Metric.KV_CACHE_USAGE_RATIO): 0.1,
            (POD_A.name, Metric.REQUESTS_RUNNING): 0,
        },
    )
    d = await round_()
    assert (d["decode"].result, d["decode"].reason) == (1, "ScaledDown"), d["decode"].formula
    assert d["prefill"].result == 3  # still 1 ready pod with 12 waiting: 3 wanted
    assert replicas_and_owner(api, "decode") == (1, [FIELD_MANAGER_AUTOSCALER])
    costs = {
        p: api.get(kind=kube.POD, namespace=NS, name=p)["metadata"]["annotations"][ANNOTATION_POD_DELETION_COST]  # type: ignore[index]
        for p in (POD_A.name, POD_B.name)
    }
    assert costs == {POD_A.name: "0", POD_B.name: "300"}

    # Round 3: Prometheus unreachable -> replicas held, MetricsHealthy=False QueryFailed.
    broken = make_prometheus(url=f"http://127.0.0.1:{free_port()}")
    decisions = await run_once(
        isvc=isvc(api),
        api=api,
        prometheus=broken,
        state=state,
        metrics=metrics,
        now_seconds=time.time(),
        logger=log,
        scrape_interval_seconds=1,
    )
    assert {x.reason for x in decisions} == {"MetricsUnavailable"}
    obj = isvc(api)
    assert (condition(obj, "MetricsHealthy")["status"], condition(obj, "MetricsHealthy")["reason"]) == (
        "False",
        "QueryFailed",
    )
    assert condition(obj, "ScalingActive")["reason"] == "MetricsUnavailable"
    assert set(obj["status"]["decode"]["lastDecision"]["inputs"]) == {
        "currentReplicas",
        "readyReplicas",
        "pendingReplicas",
    }  # the last round's numbers are gone
    assert replicas_and_owner(api, "prefill")[0] == 3 and replicas_and_owner(api, "decode")[0] == 1

    # Round 4: dry run, decode busy again (the Pending pod is gone): 2 recommended, recorded,
    # nothing written to the Deployment.
    api.merge_patch(
        kind=kube.INFERENCE_SERVICE, namespace=NS, name=NAME, patch={"spec": {"autoscaling": {"dryRun": True}}}
    )
    k8s.CoreV1Api(CLIENTS[0]).delete_namespaced_pod(name="svc-decode-pending", namespace=NS, grace_period_seconds=0)
    POD_A.set(Metric.REQUESTS_WAITING, 6)
    wait_for_window(prometheus, window_seconds=2, values={(POD_A.name, Metric.REQUESTS_WAITING): 6})
    d = await round_()
    assert (d["decode"].result, d["decode"].write) == (2, False), d["decode"].formula
    assert replicas_and_owner(api, "decode")[0] == 1
    obj = isvc(api)
    assert obj["status"]["decode"]["lastDecision"]["result"] == 2
    assert obj["status"]["scalingHistory"][-1] | {"time": None} == {
        "time": None,
        "pool": "decode",
        "from": 1,
        "to": 2,
        "reason": "DryRun",
    }
    assert condition(obj, "ScalingActive")["reason"] == "DryRun"
    assert condition(obj, "MetricsHealthy")["status"] == "True"

    # Round 5: paused -> no write at all.
    api.merge_patch(
        kind=kube.INFERENCE_SERVICE,
        namespace=NS,
        name=NAME,
        patch={
            "metadata": {"annotations": {"splitserve.dev/paused": "true"}},
            "spec": {"autoscaling": {"dryRun": False}},
        },
    )
    before = isvc(api)["metadata"]["resourceVersion"]
    assert await round_() == {}
    assert isvc(api)["metadata"]["resourceVersion"] == before
    assert replicas_and_owner(api, "decode")[0] == 1


async def test_registered_loop_runs_rounds_without_finalizer_and_pauses_without_writes(
    cluster: Cluster, prometheus: PrometheusConnect
) -> None:
    """The kopf wiring: ``register`` on a fresh registry, kopf running against the API server.
    Nothing exports metrics for this namespace, so each round holds with NoData and says so
    in status and in a Warning Event. kopf puts no finalizer on the object, pausing it stops
    every write at once (kopf's own included), a deleted object is forgotten, and kopf's
    cleanup stops the loop."""
    api = cluster.api
    manifest = isvc_manifest(namespace=NS_KOPF)
    manifest["spec"]["autoscaling"]["interval"] = "2s"
    api.create(kind=kube.INFERENCE_SERVICE, namespace=NS_KOPF, obj=manifest)
    for role in ("prefill", "decode"):
        api.create(
            kind=kube.DEPLOYMENT,
            namespace=NS_KOPF,
            obj=deployment(role, 1, namespace=NS_KOPF),
            field_manager=FIELD_MANAGER_RECONCILER,
        )
        create_pod(api, name=f"{NAME}-{role}-0", role=role, ready=True, namespace=NS_KOPF)
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(cluster.login)
    ticks = 0

    def counting_clock() -> float:
        """The loop's monotonic clock, read once per tick: counts the ticks."""
        nonlocal ticks
        ticks += 1
        return time.monotonic()

    loop = register(
        registry=registry,
        api=api,
        prometheus_url=prometheus.url,
        metrics_registry=CollectorRegistry(),
        base_tick_seconds=1.0,
        scrape_interval_seconds=1,
        clock=counting_clock,
    )
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.WARNING
    poster = operator_events.EventPoster(api=api, component="test", instance="test")  # as main does
    poster.start()
    operator_events.install(poster)
    stop = asyncio.Event()
    operator = asyncio.create_task(
        kopf.operator(registry=registry, settings=settings, standalone=True, namespaces=[NS_KOPF], stop_flag=stop)
    )
    key = (NS_KOPF, NAME)

    async def warning_events() -> list[dict[str, Any]]:
        found = await asyncio.to_thread(api.list, kind=EVENT, namespace=NS_KOPF)
        return [
            e
            for e in found
            if e.get("reason") == "MetricsUnhealthy" and e.get("involvedObject", {}).get("name") == NAME
        ]

    def round_just_finished(after: float) -> bool:
        """A round that started (on the loop's clock) later than ``after`` is done, and the
        next one is not due for a while."""
        task, last = loop.rounds.get(key), loop.state.last_run_seconds.get(key)
        return task is not None and task.done() and last is not None and last > after and time.monotonic() - last < 1.0

    async def between_rounds(after: float = 0.0) -> float:
        """Wait until a round that started later than ``after`` has just finished; returns
        when it started."""
        await wait_until(
            lambda: round_just_finished(after), timeout_seconds=10, poll_seconds=0.02, what="a round to finish"
        )
        return loop.state.last_run_seconds[key]

    def paused_in_loop() -> bool:
        annotations = loop.bodies.get(key, {}).get("metadata", {}).get("annotations") or {}
        return annotations.get("splitserve.dev/paused") == "true"

    try:
        await wait_until(warning_events, timeout_seconds=30, poll_seconds=0.5, what="a MetricsUnhealthy Event")
        obj = isvc(api, namespace=NS_KOPF)
        healthy = condition(obj, "MetricsHealthy")
        assert (healthy["status"], healthy["reason"]) == ("False", "NoData"), healthy
        assert obj["status"]["decode"]["lastDecision"]["reason"] == "MetricsUnavailable"
        events = await warning_events()
        assert events and events[0]["type"] == "Warning" and "NoData" in events[0]["message"]
        assert key in loop.bodies and key in loop.state.last_run_seconds
        assert obj["metadata"].get("finalizers") in (None, []), obj["metadata"]["finalizers"]

        # Unpaused, rounds (each 2 s) that decide what the last one did write nothing: an idle
        # service's resourceVersion stays put over three intervals (it changed every interval,
        # only lastDecision.time moving, waking every GitOps watcher).
        first = await between_rounds()
        version = isvc(api, namespace=NS_KOPF)["metadata"]["resourceVersion"]
        second = first
        for _ in range(3):
            second = await between_rounds(after=second)
        assert isvc(api, namespace=NS_KOPF)["metadata"]["resourceVersion"] == version
        # Paused right after a round, nothing writes to it: not the loop, not kopf.
        paused = await asyncio.to_thread(
            api.merge_patch,
            kind=kube.INFERENCE_SERVICE,
            namespace=NS_KOPF,
            name=NAME,
            patch={"metadata": {"annotations": {"splitserve.dev/paused": "true"}}},
        )
        assert paused is not None
        await wait_until(paused_in_loop, what="the loop to see the pause")
        seen_at = ticks
        # four ticks (1 s each) span more than the 2 s interval: a round would have started
        await wait_until(lambda: ticks >= seen_at + 4, what="four ticks")
        obj = isvc(api, namespace=NS_KOPF)
        assert obj["metadata"]["resourceVersion"] == paused["metadata"]["resourceVersion"]
        assert obj["metadata"].get("finalizers") in (None, [])
        assert loop.state.last_run_seconds[key] == second  # no round even started
        # Unpaused, the rounds resume.
        await asyncio.to_thread(
            api.merge_patch,
            kind=kube.INFERENCE_SERVICE,
            namespace=NS_KOPF,
            name=NAME,
            patch={"metadata": {"annotations": {"splitserve.dev/paused": None}}},
        )
        await between_rounds(after=second)
        # Deleted (no finalizer: gone at once), the object is forgotten, state and all.
        await asyncio.to_thread(
            k8s.CustomObjectsApi(CLIENTS[0]).delete_namespaced_custom_object,
            API_GROUP,
            API_VERSION,
            NS_KOPF,
            PLURAL,
            NAME,
        )
        await wait_until(lambda: key not in loop.bodies, what="the deletion to reach the loop")
        assert key not in loop.bodies and key not in loop.rounds and key not in loop.state.last_run_seconds
    finally:
        stop.set()
        await asyncio.wait_for(operator, timeout=30)
        operator_events.install(None)
        poster.stop()
    assert loop.ticker is None and not loop.rounds  # kopf's cleanup stopped the loop
