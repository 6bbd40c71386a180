"""Multi-node pools end to end: the operator renders a pool whose replicas span several nodes
(``resources.gpusPerNode`` below ``resources.gpus``) as a LeaderWorkerSet, the real LWS
controller (``sigs.k8s.io/lws`` v0.7.0 built from its module, :mod:`splitserve_e2e.lws`) makes
each replica a group of pods, and the operator counts and scales groups.

One cluster-scoped operator (the chart, a container from the image built from this tree, under
its ServiceAccount: the chart's RBAC is what it gets; :func:`~splitserve_e2e.realnode.real_node_stack`)
serves two namespaces:

* on the kwok GPU nodes (no containers; kwok marks pods Running and Ready): an Aggregated pool of
  ``gpus: 2, gpusPerNode: 1, tensor: 2`` is an LWS of size 2 whose groups are a leader and a
  worker of one GPU each, carrying the LWS env; the pool's Service has the leaders only; the
  status counts groups; raising ``replicas.min`` makes the autoscaler (its field manager) scale
  the LWS to 2 groups (4 pods) and lowering ``replicas.max`` back to 1; a deleted LWS is put
  back by the operator;
* on the kubelet node (containers; the runtime computes on the CPU, the node advertises 4
  ``nvidia.com/gpu``): the same pool of the tiny model is a leader and a worker pod whose ranks
  meet over the leader's DNS name (cluster DNS on the node) and rendezvous port; it becomes
  Ready and a completion through the router is served.

The CEL rules of ``gpusPerNode`` are checked against this API server too (server-side dry runs,
and an update of an existing pool for the transition rule).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, condition, get_isvc, router_endpoints
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.kwok import KWOK_NODE_LABEL, KWOK_NODE_LABEL_VALUE, kwok_toleration
from splitserve_e2e.lws import (
    GROUP_SIZE_ENV,
    LEADER_ADDRESS_ENV,
    SET_NAME_LABEL,
    WORKER_INDEX_ENV,
    WORKER_INDEX_LABEL,
    LwsController,
    start_lws,
)
from splitserve_e2e.realnode import (
    ISVC_NAME,
    Stack,
    explained,
    isvc_for_node,
    log,
    real_node_stack,
    wait,
)
from splitserve_e2e.stack import SERVED_NAME, ModelHub
from splitserve_operator import leader_worker_set
from splitserve_operator.api import rules

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

LWS_API_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
ENGINE = f"{ISVC_NAME}-engine"
KWOK_SECONDS = 180.0
"""kwok pools converge in seconds; the bound absorbs a loaded 2-core machine."""
READY_SECONDS = 600.0
MULTI_NODE_POOL: dict[str, Any] = {"resources": {"gpus": 2, "gpusPerNode": 1}, "parallelism": {"tensor": 2}}


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def stack(cluster: LocalCluster, image: str, local_hub: LocalHub, model_hub: ModelHub) -> Iterator[Stack]:
    """The cluster-scoped operator with two workload namespaces: kwok (``workloads[0]``) and the
    kubelet node (``workloads[1]``)."""
    suffix = uuid.uuid4().hex[:4]
    with real_node_stack(
        cluster=cluster,
        image=image,
        hub=local_hub,
        model_hub=model_hub,
        workloads=[f"multinode-kwok-{suffix}", f"multinode-node-{suffix}"],
    ) as result:
        yield result


@pytest.fixture(scope="module")
def lws(cluster: LocalCluster, stack: Stack) -> Iterator[LwsController]:
    controller = start_lws(cluster)
    stack.figures["LWS controller start (CRD Established, webhooks answer)"] = f"{controller.start_seconds:.1f}s"
    yield controller
    controller.stop()


def _lws(cluster: LocalCluster, namespace: str, name: str = ENGINE) -> dict[str, Any] | None:
    result = cluster.kubectl(
        "get",
        f"{LWS_PLURAL}.{LWS_API_GROUP}",
        name,
        "-n",
        namespace,
        "-o",
        "json",
        "--show-managed-fields",
        check=False,
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


def _pods(cluster: LocalCluster, namespace: str) -> list[Any]:
    core: Any = cluster.core()
    pods = core.list_namespaced_pod(namespace, label_selector=f"{SET_NAME_LABEL}={ENGINE}").items
    return sorted((p for p in pods if p.metadata.deletion_timestamp is None), key=lambda p: p.metadata.name)


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def _pool_status(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    return dict(
        (get_isvc(cluster=cluster, namespace=namespace, name=ISVC_NAME).get("status") or {}).get("aggregated") or {}
    )


def _wait_groups(cluster: LocalCluster, namespace: str, groups: int, *, timeout: float = KWOK_SECONDS) -> list[Any]:
    """``groups`` groups of 2 pods, all bound and Ready, and the status saying so."""

    def converged() -> list[Any] | None:
        pods = _pods(cluster, namespace)
        if len(pods) != 2 * groups or not all(p.spec.node_name and _ready(p) for p in pods):
            return None
        status = _pool_status(cluster, namespace)
        if (status.get("readyReplicas"), status.get("desiredReplicas")) != (groups, groups):
            return None
        return pods

    found: list[Any] = wait(
        cluster, converged, timeout=timeout, what=f"{groups} ready groups of 2 pods in {namespace}", interval=1.0
    )
    return found


@pytest.fixture(scope="module")
def on_kwok(cluster: LocalCluster, stack: Stack, lws: LwsController) -> Stack:
    """The kwok multi-node InferenceService applied, one group up and counted."""
    namespace = stack.workloads[0]
    manifest = isvc_for_node(stack, namespace=namespace, mode="Aggregated", cpu="100m")
    manifest["spec"]["aggregated"].update(
        MULTI_NODE_POOL,
        replicas={"min": 1, "max": 3},
        tolerations=[kwok_toleration()],
        nodeSelector={KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE},
    )
    manifest["spec"]["aggregated"]["resources"]["cpu"] = "100m"
    started = time.monotonic()
    with explained(cluster, stack.namespaces):
        apply_object(cluster=cluster, obj=manifest)
        _wait_groups(cluster, namespace, 1)
        stack.figures["kwok multi-node pool apply -> 1 group of 2 pods Ready"] = f"{time.monotonic() - started:.1f}s"
    return stack


# --------------------------------------------------------------------------- admission
def _dry_run(cluster: LocalCluster, namespace: str, pool: dict[str, Any], **spec: Any) -> str:
    obj = {
        "apiVersion": "splitserve.dev/v1alpha1",
        "kind": contract.KIND,
        "metadata": {"name": "cel-probe", "namespace": namespace},
        "spec": {"model": {"uri": "hf://org/model"}, "mode": "Aggregated", "aggregated": pool, **spec},
    }
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input_text=json.dumps(obj), check=False)
    return "" if result.returncode == 0 else result.stderr


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"resources": {"gpus": 0, "gpusPerNode": 1}}, rules.GPUS_PER_NODE_RULE_MESSAGE),
        ({"resources": {"gpus": 3, "gpusPerNode": 2}}, rules.GPUS_PER_NODE_RULE_MESSAGE),
        (
            {"resources": {"gpus": 4, "gpusPerNode": 2}, "parallelism": {"tensor": 2}},
            rules.MULTI_NODE_PARALLELISM_RULE_MESSAGE,
        ),
        ({"resources": {"gpus": 2, "gpusPerNode": 0}, "parallelism": {"tensor": 2}}, "gpusPerNode"),
    ],
)
def test_the_api_server_refuses_pools_that_cannot_be_split_over_nodes(
    cluster: LocalCluster, stack: Stack, pool: dict[str, Any], message: str
) -> None:
    refused = _dry_run(cluster, stack.workloads[0], pool)
    assert message in refused, refused


def test_the_api_server_accepts_multi_node_pools_and_refuses_switching(cluster: LocalCluster, stack: Stack) -> None:
    namespace = stack.workloads[0]
    assert (
        _dry_run(
            cluster,
            namespace,
            {"resources": {"gpus": 16, "gpusPerNode": 8}, "parallelism": {"tensor": 8, "pipeline": 2}},
        )
        == ""
    )
    draft = _dry_run(
        cluster, namespace, MULTI_NODE_POOL, engine={"speculative": {"method": "draft", "draftModel": "hf://org/draft"}}
    )
    assert rules.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE in draft, draft
    # the transition rule: a paused object (the operator leaves it alone) whose pool turns single-node
    obj: dict[str, Any] = {
        "apiVersion": "splitserve.dev/v1alpha1",
        "kind": contract.KIND,
        "metadata": {"name": "switch", "namespace": namespace, "annotations": {contract.ANNOTATION_PAUSED: "true"}},
        "spec": {"model": {"uri": "hf://org/model"}, "mode": "Aggregated", "aggregated": MULTI_NODE_POOL},
    }
    apply_object(cluster=cluster, obj=obj)
    try:
        obj["spec"]["aggregated"] = {"resources": {"gpus": 2}, "parallelism": {"tensor": 2}}
        result = cluster.kubectl(
            "apply", "--server-side", "--dry-run=server", "-f", "-", input_text=json.dumps(obj), check=False
        )
        assert result.returncode != 0 and rules.MULTI_NODE_IMMUTABLE_RULE_MESSAGE in result.stderr, result.stderr
        # the group size may change
        obj["spec"]["aggregated"] = {"resources": {"gpus": 4, "gpusPerNode": 1}, "parallelism": {"tensor": 4}}
        result = cluster.kubectl(
            "apply", "--server-side", "--dry-run=server", "-f", "-", input_text=json.dumps(obj), check=False
        )
        assert result.returncode == 0, result.stderr
    finally:
        cluster.kubectl(
            "delete", "inferenceservices.splitserve.dev", "switch", "-n", namespace, "--wait=false", check=False
        )


# --------------------------------------------------------------------------- kwok
def test_a_multi_node_pool_is_an_lws_whose_groups_are_leader_and_worker(cluster: LocalCluster, on_kwok: Stack) -> None:
    namespace = on_kwok.workloads[0]
    with explained(cluster, on_kwok.namespaces):
        lws = _lws(cluster, namespace)
        assert lws is not None
        assert not cluster.kubectl(
            "get", "deployment", ENGINE, "-n", namespace, "--ignore-not-found", "-o", "name"
        ).stdout.strip()
        spec = lws["spec"]
        assert spec["leaderWorkerTemplate"]["size"] == 2 and spec["replicas"] == 1
        assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert lws["metadata"]["ownerReferences"][0]["kind"] == contract.KIND
        pods = _pods(cluster, namespace)
        by_name = {p.metadata.name: p for p in pods}
        assert sorted(by_name) == [f"{ENGINE}-0", f"{ENGINE}-0-1"]
        assert len({p.spec.node_name for p in pods}) >= 1
        for name, worker in ((f"{ENGINE}-0", "0"), (f"{ENGINE}-0-1", "1")):
            pod = by_name[name]
            assert pod.metadata.labels[WORKER_INDEX_LABEL] == worker
            (container,) = pod.spec.containers
            env = {e.name: e.value for e in container.env or []}
            assert (env[WORKER_INDEX_ENV], env[GROUP_SIZE_ENV]) == (worker, "2")
            assert env[LEADER_ADDRESS_ENV] == f"{ENGINE}-0.{ENGINE}-0.{namespace}"
            assert container.args[container.args.index("--nnodes") + 1] == "2"
            assert container.resources.limits["nvidia.com/gpu"] == "1"
        # the pool's Service has the leader only: the router never sends a request to a worker
        core: Any = cluster.core()
        service = core.read_namespaced_service(ENGINE, namespace)
        assert service.spec.selector[WORKER_INDEX_LABEL] == "0"
        leader_ip = by_name[f"{ENGINE}-0"].status.pod_ip
        assert leader_ip  # kwok gives its pods addresses from --cidr
        endpoints = wait(
            cluster,
            lambda: cluster.endpoints_of(namespace=namespace, service=ENGINE, port_name=contract.HTTP_PORT_NAME),
            timeout=60,
            what=f"endpoints of Service {ENGINE}",
        )
        assert endpoints == [f"{leader_ip}:{contract.HTTP_PORT}"], endpoints
        status = _pool_status(cluster, namespace)
        assert (status["replicas"], status["readyReplicas"], status["summary"]) == (1, 1, "1/1")
        log(f"kwok: LWS {ENGINE} size 2, pods {sorted(by_name)} on {sorted({p.spec.node_name for p in pods})}")


def _generation(cluster: LocalCluster, namespace: str) -> int:
    found = _lws(cluster, namespace)
    assert found is not None
    return int(found["metadata"]["generation"])


def test_replicas_bounds_scale_groups_through_the_autoscaler(cluster: LocalCluster, on_kwok: Stack) -> None:
    """Each scaling is one write of the LWS (the autoscaler's): the reconciles that every event
    of the new and the removed pods triggers leave the LWS alone (every write of one bumps its
    generation, see leader_worker_set.apply_unless_held)."""
    namespace = on_kwok.workloads[0]
    patch = cluster.kubectl
    with explained(cluster, on_kwok.namespaces):
        generation = _generation(cluster, namespace)
        started = time.monotonic()
        patch(
            "patch",
            "inferenceservices.splitserve.dev",
            ISVC_NAME,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"aggregated": {"replicas": {"min": 2, "max": 3}}}}),
        )
        pods = _wait_groups(cluster, namespace, 2)
        on_kwok.figures["kwok: replicas.min 1 -> 2 groups Ready"] = f"{time.monotonic() - started:.1f}s"
        assert sorted(p.metadata.name for p in pods) == [f"{ENGINE}-0", f"{ENGINE}-0-1", f"{ENGINE}-1", f"{ENGINE}-1-1"]
        lws = _lws(cluster, namespace)
        assert lws is not None and lws["spec"]["replicas"] == 2
        managers = {
            e["manager"]
            for e in lws["metadata"]["managedFields"]
            if "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})
        }
        assert managers == {contract.FIELD_MANAGER_AUTOSCALER}, managers
        history = (get_isvc(cluster=cluster, namespace=namespace, name=ISVC_NAME).get("status") or {}).get(
            "scalingHistory"
        ) or []
        assert any(e["pool"] == "aggregated" and (e["from"], e["to"]) == (1, 2) for e in history), history
        assert lws["metadata"]["generation"] == generation + 1
        started = time.monotonic()
        patch(
            "patch",
            "inferenceservices.splitserve.dev",
            ISVC_NAME,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"aggregated": {"replicas": {"min": 1, "max": 1}}}}),
        )
        _wait_groups(cluster, namespace, 1)
        on_kwok.figures["kwok: replicas.max 1 -> 1 group left"] = f"{time.monotonic() - started:.1f}s"
        assert [p.metadata.name for p in _pods(cluster, namespace)] == [f"{ENGINE}-0", f"{ENGINE}-0-1"]
        assert _generation(cluster, namespace) == generation + 2


def test_a_deleted_lws_is_put_back(cluster: LocalCluster, on_kwok: Stack) -> None:
    namespace = on_kwok.workloads[0]
    with explained(cluster, on_kwok.namespaces):
        before = _lws(cluster, namespace)
        assert before is not None
        cluster.kubectl("delete", f"{LWS_PLURAL}.{LWS_API_GROUP}", ENGINE, "-n", namespace, "--wait=false")

        def recreated() -> dict[str, Any] | None:
            found = _lws(cluster, namespace)
            return found if found and found["metadata"]["uid"] != before["metadata"]["uid"] else None

        started = time.monotonic()
        wait(cluster, recreated, timeout=KWOK_SECONDS, what=f"LWS {ENGINE} re-created", interval=1.0)
        _wait_groups(cluster, namespace, 1)
        on_kwok.figures["kwok: deleted LWS -> re-created, group Ready"] = f"{time.monotonic() - started:.1f}s"


# --------------------------------------------------------------------------- the kubelet node
@pytest.fixture(scope="module")
def on_node(cluster: LocalCluster, stack: Stack, lws: LwsController) -> Stack:
    """The tiny model as a group of two one-GPU pods (tensor 2: one rank each) on the kubelet
    node, Ready."""
    namespace = stack.workloads[1]
    manifest = isvc_for_node(stack, namespace=namespace, mode="Aggregated", cpu="300m", memory="2Gi")
    pool = manifest["spec"]["aggregated"]
    pool.update(MULTI_NODE_POOL, replicas={"min": 1, "max": 1})
    pool["resources"] = {**MULTI_NODE_POOL["resources"], "cpu": "300m", "memory": "2Gi"}
    manifest["spec"]["autoscaling"]["enabled"] = False
    started = time.monotonic()
    with explained(cluster, stack.namespaces):
        apply_object(cluster=cluster, obj=manifest)

        def ready() -> dict[str, Any] | None:
            obj = get_isvc(cluster=cluster, namespace=namespace, name=ISVC_NAME)
            if (condition(obj, "Ready") or {}).get("status") != "True":
                return None
            return obj if router_endpoints(cluster=cluster, namespace=namespace, name=ISVC_NAME) else None

        wait(
            cluster, ready, timeout=READY_SECONDS, what=f"InferenceService {namespace}/{ISVC_NAME} Ready", interval=2.0
        )
    seconds = time.monotonic() - started
    stack.figures["kubelet node: multi-node pool (2 pods) apply -> Ready"] = f"{seconds:.1f}s"
    log(f"{namespace}/{ISVC_NAME} (a group of 2 pods) Ready in {seconds:.1f}s")
    return stack


def test_a_group_of_two_pods_serves_through_the_router(cluster: LocalCluster, on_node: Stack) -> None:
    namespace = on_node.workloads[1]
    with explained(cluster, on_node.namespaces):
        pods = {p.metadata.name: p for p in _pods(cluster, namespace)}
        assert sorted(pods) == [f"{ENGINE}-0", f"{ENGINE}-0-1"]
        assert all(_ready(p) and p.status.phase == "Running" for p in pods.values())
        status = _pool_status(cluster, namespace)
        assert (status["readyReplicas"], status["summary"]) == (1, "1/1")
        # the worker holds ranks only: its probes answer, the OpenAI API is the leader's
        worker_ip = pods[f"{ENGINE}-0-1"].status.pod_ip
        assert httpx.get(f"http://{worker_ip}:{contract.HTTP_PORT}/ready", timeout=10.0).status_code == 200
        assert httpx.get(f"http://{worker_ip}:{contract.HTTP_PORT}/v1/models", timeout=10.0).status_code != 200
        (router,) = router_endpoints(cluster=cluster, namespace=namespace, name=ISVC_NAME)[:1]
        url = router if router.startswith("http") else f"http://{router}"
        started = time.monotonic()
        response = httpx.post(
            f"{url}/v1/completions",
            timeout=120.0,
            json={"model": SERVED_NAME, "prompt": "Two pods, one replica:", "max_tokens": 8, "temperature": 0},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"], body
        assert body["usage"]["completion_tokens"] >= 1, body
        on_node.figures["kubelet node: completion through the router (2-pod replica)"] = (
            f"{time.monotonic() - started:.2f}s"
        )
        log(f"multi-node completion: {body['choices'][0]['text']!r}")


def test_leader_worker_set_names_match_the_operators(cluster: LocalCluster, on_kwok: Stack) -> None:
    """The labels and env the operator relies on are the controller's (pinned in
    splitserve_operator.leader_worker_set)."""
    assert (leader_worker_set.SET_NAME_LABEL, leader_worker_set.WORKER_INDEX_LABEL) == (
        SET_NAME_LABEL,
        WORKER_INDEX_LABEL,
    )
    pods = _pods(cluster, on_kwok.workloads[0])
    assert pods and all(leader_worker_set.GROUP_INDEX_LABEL in p.metadata.labels for p in pods)
