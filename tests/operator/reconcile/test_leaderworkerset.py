"""Pools whose replicas span several nodes (``resources.gpusPerNode`` below ``resources.gpus``):
the LeaderWorkerSet the operator renders instead of the pool's Deployment (group size, one pod
template for the leader and its workers, GPUs per pod, ``--nnodes``), the pool's Service and
InferencePool selecting group leaders only, the NetworkPolicy that lets a group's ranks meet,
what admission refuses and with which words, the reconciler's counts in groups (from the pods)
and its Stalled/LeaderWorkerSetCRDMissing on a cluster without the CRD (against the in-memory API
server of kube_testing), the autoscaler scaling groups and counting a group's GPUs against the
budget, and the chart RBAC that lets the operator write all of it."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import crdgen
import pytest
import yaml
from chart_rbac import helm_binary, holds, operator_rules
from kube_testing import NAME, FakeKube, api_error, isvc_obj, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason, Role
from splitserve_contract import capabilities as caps
from splitserve_operator import kube, leader_worker_set, naming, reconcile
from splitserve_operator.api import InferenceService, InvalidSpecError, rules
from splitserve_operator.autoscaler import actuator
from splitserve_operator.autoscaler.decision import (
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    decide,
    plan_joint,
)
from splitserve_operator.autoscaler.loop import policy_for
from splitserve_operator.autoscaler.observe import classify, observe_pool
from splitserve_operator.render import render_children

NAMESPACE = "team-a"
LWS_API = "leaderworkerset.x-k8s.io/v1"
MULTI_NODE = {
    "replicas": {"min": 2, "max": 4},
    "resources": {"gpus": 4, "gpusPerNode": 2},
    "parallelism": {"tensor": 2, "pipeline": 2},
}
ONE_POD = {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 2}, "parallelism": {"tensor": 2}}


def _obj(
    *,
    mode: str = "Aggregated",
    pool: Mapping[str, Any] = MULTI_NODE,
    decode: Mapping[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    pools = (
        {"aggregated": copy.deepcopy(dict(pool))}
        if mode == "Aggregated"
        else {"prefill": copy.deepcopy(dict(pool)), "decode": copy.deepcopy(dict(decode or pool))}
    )
    return {
        "apiVersion": "splitserve.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": NAMESPACE, "uid": "u", "generation": 1},
        "spec": {"model": {"uri": "hf://org/model"}, "mode": mode, **pools, **spec},
    }


def _render(obj: dict[str, Any], *, include_replicas: bool = False) -> list[dict[str, Any]]:
    return render_children(
        isvc=InferenceService.parse(obj),
        runtime_image="img:1",
        router_service_account="",
        include_replicas=include_replicas,
    )


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)}"
    return found[0]


def _flags(args: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a runtime container's arguments (after ``splitserve serve``)."""
    out, rest = {}, args[2:]
    for i, arg in enumerate(rest):
        if arg.startswith("--") and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            out[arg] = rest[i + 1]
    return out


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return selector.items() <= labels.items()


def _pod_labels(template: Mapping[str, Any], *, group: int, worker: int, lws: str) -> dict[str, str]:
    """A pod's labels as the LWS controller makes them: the template's plus its own."""
    return {
        **template["metadata"]["labels"],
        leader_worker_set.SET_NAME_LABEL: lws,
        leader_worker_set.GROUP_INDEX_LABEL: str(group),
        leader_worker_set.WORKER_INDEX_LABEL: str(worker),
    }


# ---------------------------------------------------------------------------- rendering
@pytest.mark.parametrize(("mode", "roles"), [("Aggregated", ["engine"]), ("Disaggregated", ["prefill", "decode"])])
def test_a_multi_node_pool_is_a_leader_worker_set_named_like_its_deployment(mode: str, roles: list[str]) -> None:
    objs = _render(_obj(mode=mode), include_replicas=True)
    for role in roles:
        name = f"chat-{role}"
        assert not [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
        lws = _one(objs, "LeaderWorkerSet", name)
        assert lws["apiVersion"] == LWS_API and lws["metadata"]["namespace"] == NAMESPACE
        spec = lws["spec"]
        assert spec["replicas"] == 2  # replicas.min, on create only (then the autoscaler's)
        assert spec["startupPolicy"] == "LeaderCreated"  # the leader is Ready only once the workers joined
        assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}  # not the pool Service's name
        assert spec["rolloutStrategy"] == {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
        }
        template = spec["leaderWorkerTemplate"]
        assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
        leader, worker = template["leaderTemplate"], template["workerTemplate"]
        assert leader["spec"] == worker["spec"]  # one program; the node rank comes from LWS_WORKER_INDEX
        (container,) = leader["spec"]["containers"]
        # gpusPerNode GPUs per pod
        assert (
            container["resources"]["limits"]["nvidia.com/gpu"]
            == container["resources"]["requests"]["nvidia.com/gpu"]
            == 2
        )
        flags = _flags(container["args"])
        assert (flags["--tensor-parallel-size"], flags["--pipeline-parallel-size"], flags["--nnodes"]) == (
            "2",
            "2",
            "2",
        )
        assert "--node-rank" not in flags and "--leader-address" not in flags  # from the LWS env at run time
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[leader_worker_set.RENDEZVOUS_PORT_NAME] == contract.ServeArgs().rendezvous_port
        assert ports[contract.HTTP_PORT_NAME] == contract.HTTP_PORT  # the workers' probes too
        assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        # leaders are scraped (they export the metrics), workers are not
        assert leader["metadata"]["labels"][contract.LABEL_SCRAPE] == "true"
        assert contract.LABEL_SCRAPE not in worker["metadata"]["labels"]
        assert {k: v for k, v in leader["metadata"]["labels"].items() if k != contract.LABEL_SCRAPE} == worker[
            "metadata"
        ]["labels"]
        hashes = {t["metadata"]["annotations"][contract.ANNOTATION_CONFIG_HASH] for t in (leader, worker)}
        assert len(hashes) == 1
        config = _one(objs, "ConfigMap", "chat-config")
        assert (
            yaml.safe_load(config["data"]["config-hashes.json"])[lws["metadata"]["labels"][contract.LABEL_ROLE]]
            in hashes
        )


def test_replicas_are_left_out_after_creation_and_single_node_pools_stay_deployments() -> None:
    objs = _render(_obj(mode="Disaggregated", pool=ONE_POD, decode=MULTI_NODE))
    assert "replicas" not in _one(objs, "LeaderWorkerSet", "chat-decode")["spec"]
    prefill = _one(objs, "Deployment", "chat-prefill")
    (container,) = prefill["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "--nnodes" not in container["args"]
    assert leader_worker_set.RENDEZVOUS_PORT_NAME not in {p["name"] for p in container["ports"]}
    # gpusPerNode equal to gpus: still one pod per replica
    same = _render(_obj(pool={**ONE_POD, "resources": {"gpus": 2, "gpusPerNode": 2}}))
    assert _one(same, "Deployment", "chat-engine")
    assert not [o for o in same if o["kind"] == "LeaderWorkerSet"]


def test_pool_service_selects_the_group_leaders_only() -> None:
    objs = _render(_obj(mode="Disaggregated", decode=ONE_POD))
    lws = _one(objs, "LeaderWorkerSet", "chat-prefill")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader = _pod_labels(template["leaderTemplate"], group=1, worker=0, lws="chat-prefill")
    worker = _pod_labels(template["workerTemplate"], group=1, worker=1, lws="chat-prefill")
    service = _one(objs, "Service", "chat-prefill")
    assert service["spec"]["clusterIP"] == "None"  # the router still addresses pods one by one
    assert _selects(service["spec"]["selector"], leader) and not _selects(service["spec"]["selector"], worker)
    assert {p["name"] for p in service["spec"]["ports"]} == {contract.HTTP_PORT_NAME, contract.KV_TRANSFER_PORT_NAME}
    # drains: the budget covers every pod of the pool (one pod out restarts its group)
    pdb = _one(objs, "PodDisruptionBudget", "chat-prefill")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], leader)
    assert _selects(pdb["spec"]["selector"]["matchLabels"], worker)
    # the single-node pool's Service selects all its pods, as before
    decode = _one(objs, "Service", "chat-decode")["spec"]["selector"]
    assert leader_worker_set.WORKER_INDEX_LABEL not in decode


def test_a_groups_ranks_may_reach_each_other_on_any_tcp_port() -> None:
    objs = _render(_obj(mode="Disaggregated", decode=ONE_POD))
    lws = _one(objs, "LeaderWorkerSet", "chat-prefill")["spec"]["leaderWorkerTemplate"]
    worker = _pod_labels(lws["workerTemplate"], group=0, worker=1, lws="chat-prefill")
    policy = _one(objs, "NetworkPolicy", "chat-prefill")
    assert _selects(policy["spec"]["podSelector"]["matchLabels"], worker)
    peers = [r for r in policy["spec"]["ingress"] if r.get("ports") == [{"protocol": "TCP"}]]
    assert len(peers) == 1  # rendezvous, and the ports gloo/NCCL choose at run time
    (peer,) = peers[0]["from"]
    assert _selects(peer["podSelector"]["matchLabels"], worker)
    assert peer["podSelector"]["matchLabels"] == naming.selector_labels("chat", Role.PREFILL)
    # a single-node pool opens no such port
    decode = _one(objs, "NetworkPolicy", "chat-decode")["spec"]["ingress"]
    assert not [r for r in decode if r.get("ports") == [{"protocol": "TCP"}]]


@pytest.mark.parametrize(("mode", "roles"), [("Aggregated", ["engine"]), ("Disaggregated", ["prefill", "decode"])])
def test_every_pod_of_a_group_holds_the_secret_its_rendezvous_key_comes_from(mode: str, roles: list[str]) -> None:
    """The ranks run what their leader sends them, so a group's control messages are MAC'd
    under a key derived from the InferenceService's Secret: every leader and worker pod mounts
    it and is told where (aggregated pools too, which take no KV handoff)."""
    objs = _render(_obj(mode=mode))
    secret_volume = {
        "name": "kv-handoff",
        "secret": {"secretName": naming.handoff_key_secret_name("chat"), "defaultMode": 0o440},
    }
    for role in roles:
        template = _one(objs, "LeaderWorkerSet", f"chat-{role}")["spec"]["leaderWorkerTemplate"]
        for pod in (template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]):
            assert secret_volume in pod["volumes"]
            (container,) = pod["containers"]
            key_file = _flags(container["args"])["--rendezvous-key-file"]
            mount = next(m for m in container["volumeMounts"] if m["name"] == "kv-handoff")
            assert key_file.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    # a one-pod replica draws its own key: no flag, and an aggregated one no Secret
    one_pod = _one(_render(_obj(pool=ONE_POD)), "Deployment", "chat-engine")["spec"]["template"]["spec"]
    assert "--rendezvous-key-file" not in one_pod["containers"][0]["args"]
    assert "kv-handoff" not in {v["name"] for v in one_pod.get("volumes", [])}


def test_an_aggregated_multi_node_service_gets_the_secret_its_pods_mount() -> None:
    fake = nodes_kube()
    run(fake, isvc_obj(**POOL))
    assert ("Secret", naming.handoff_key_secret_name(NAME)) in fake.objects
    single = nodes_kube()
    run(single, isvc_obj(replicas={"min": 1, "max": 3}, resources={"gpus": 2}, parallelism={"tensor": 2}))
    assert ("Secret", naming.handoff_key_secret_name(NAME)) not in single.objects


def test_an_inference_pool_of_a_multi_node_pool_selects_its_leaders() -> None:
    objs = _render(_obj(router={"mode": "InferencePool"}))
    pool = _one(objs, "InferencePool", "chat")
    template = _one(objs, "LeaderWorkerSet", "chat-engine")["spec"]["leaderWorkerTemplate"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert _selects(selector, _pod_labels(template["leaderTemplate"], group=0, worker=0, lws="chat-engine"))
    assert not _selects(selector, _pod_labels(template["workerTemplate"], group=0, worker=1, lws="chat-engine"))


def test_rendering_is_deterministic() -> None:
    assert _render(_obj(mode="Disaggregated")) == _render(_obj(mode="Disaggregated"))


# ---------------------------------------------------------------------------- admission
@pytest.mark.parametrize(
    ("resources", "parallelism", "message"),
    [
        ({"gpus": 0, "gpusPerNode": 1}, {}, rules.GPUS_PER_NODE_RULE_MESSAGE),
        ({"gpus": 3, "gpusPerNode": 2}, {"tensor": 1}, rules.GPUS_PER_NODE_RULE_MESSAGE),
        ({"gpus": 2, "gpusPerNode": 4}, {"tensor": 2}, rules.GPUS_PER_NODE_RULE_MESSAGE),
        ({"gpus": 4, "gpusPerNode": 2}, {"tensor": 2}, rules.MULTI_NODE_PARALLELISM_RULE_MESSAGE),
        ({"gpus": 4, "gpusPerNode": 1}, {"tensor": 1, "pipeline": 2}, rules.MULTI_NODE_PARALLELISM_RULE_MESSAGE),
        ({"gpus": 2, "gpusPerNode": 0}, {"tensor": 2}, "greater than or equal to 1"),
        ({"gpus": 128, "gpusPerNode": 8}, {"tensor": 8, "pipeline": 8}, "less than or equal to 64"),
    ],
)
def test_admission_refuses_pools_that_cannot_be_split_over_nodes(
    resources: dict[str, Any], parallelism: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSpecError) as refused:
        InferenceService.parse(_obj(pool={"resources": resources, "parallelism": parallelism}))
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("resources", "parallelism", "pods", "gpus_per_pod"),
    [
        ({"gpus": 2, "gpusPerNode": 1}, {"tensor": 2}, 2, 1),
        ({"gpus": 16, "gpusPerNode": 8}, {"tensor": 8, "pipeline": 2}, 2, 8),
        ({"gpus": 8, "gpusPerNode": 2}, {"tensor": 2, "pipeline": 4}, 4, 2),
        ({"gpus": 4, "gpusPerNode": 4}, {"tensor": 2}, 1, 4),  # one pod: parallelism need not use every GPU
        ({"gpus": 4}, {"tensor": 2}, 1, 4),
        ({"gpus": 0}, {}, 1, 0),
    ],
)
def test_pods_per_replica(resources: dict[str, Any], parallelism: dict[str, Any], pods: int, gpus_per_pod: int) -> None:
    pool = InferenceService.parse(_obj(pool={"resources": resources, "parallelism": parallelism})).spec.aggregated
    assert pool is not None
    assert (pool.resources.pods_per_replica, pool.resources.gpus_per_pod) == (pods, gpus_per_pod)
    assert pool.resources.multi_node is (pods > 1)


def test_a_draft_model_is_refused_with_multi_node_replicas() -> None:
    # multi-node means tensor x pipeline == gpus > 1, which speculation with a draft model refuses
    obj = _obj(engine={"speculative": {"method": "draft", "draftModel": "hf://org/draft"}})
    with pytest.raises(InvalidSpecError) as refused:
        InferenceService.parse(obj)
    assert rules.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE in str(refused.value)


def test_gpu_budget_counts_whole_groups() -> None:
    with pytest.raises(InvalidSpecError) as refused:  # 2 groups x 4 GPUs > 7
        InferenceService.parse(_obj(autoscaling={"gpuBudget": 7}))
    assert rules.GPU_BUDGET_RULE_MESSAGE in str(refused.value)
    InferenceService.parse(_obj(autoscaling={"gpuBudget": 8}))


def test_crd_carries_the_multi_node_rules_with_their_messages() -> None:
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for pool in ("prefill", "decode", "aggregated"):
        node = schema["properties"][pool]
        by_message = {r["message"]: r["rule"] for r in node["x-kubernetes-validations"]}
        assert "self.resources.gpus % self.resources.gpusPerNode == 0" in by_message[rules.GPUS_PER_NODE_RULE_MESSAGE]
        assert (
            "self.parallelism.tensor * self.parallelism.pipeline == self.resources.gpus"
            in by_message[rules.MULTI_NODE_PARALLELISM_RULE_MESSAGE]
        )
        # a transition rule (updates only): a pool cannot switch between Deployment and LWS
        assert "oldSelf.resources.gpusPerNode" in by_message[rules.MULTI_NODE_IMMUTABLE_RULE_MESSAGE]
        gpus_per_node = node["properties"]["resources"]["properties"]["gpusPerNode"]
        assert (gpus_per_node["type"], gpus_per_node["minimum"]) == ("integer", 1)
        assert "default" not in gpus_per_node  # empty means gpus
    assert caps.REPLICA_LAYOUT.is_supported("multi-node")
    assert "| replica layout | single-node, multi-node | single-node, multi-node |" in crdgen.api_reference()


# ---------------------------------------------------------------------------- reconcile
def nodes_kube(*, nodes: int = 2, gpus: int = 8) -> FakeKube:
    """The fake API server with ``nodes`` nodes of ``gpus`` allocatable GPUs each."""
    fake = FakeKube()
    listed = fake.list
    node_objects = [
        {"metadata": {"name": f"n{i}"}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}} for i in range(nodes)
    ]

    def list_with_nodes(*, kind: kube.Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        if kind is kube.NODE:
            return copy.deepcopy(node_objects)
        found: list[dict[str, Any]] = listed(kind=kind, namespace=namespace, label_selector=label_selector)
        return found

    fake.list = list_with_nodes
    return fake


POOL = {"replicas": {"min": 1, "max": 3}, "resources": {"gpus": 2, "gpusPerNode": 1}, "parallelism": {"tensor": 2}}
ENGINE = f"{NAME}-engine"


def _group_pods(
    fake: FakeKube, *, groups: int, ready: bool | list[bool], phase: str = "Running", config_hash: str | None = None
) -> list[dict[str, Any]]:
    """Pods of the LWS ``ENGINE`` as its controller makes them from the applied templates."""
    lws = fake.objects[("LeaderWorkerSet", ENGINE)]
    template = lws["spec"]["leaderWorkerTemplate"]
    size = int(template["size"])
    readiness = ready if isinstance(ready, list) else [ready] * (groups * size)
    pods = []
    for group in range(groups):
        for worker in range(size):
            source = template["leaderTemplate" if worker == 0 else "workerTemplate"]
            annotations = dict(source["metadata"]["annotations"])
            if config_hash is not None:
                annotations[contract.ANNOTATION_CONFIG_HASH] = config_hash
            name = f"{ENGINE}-{group}" + (f"-{worker}" if worker else "")
            is_ready = readiness[group * size + worker]
            pods.append(
                {
                    "metadata": {
                        "name": name,
                        "annotations": annotations,
                        "labels": _pod_labels(source, group=group, worker=worker, lws=ENGINE),
                    },
                    "status": {
                        "phase": phase,
                        "conditions": [{"type": "Ready", "status": "True" if is_ready else "False"}],
                    },
                }
            )
    return pods


def test_missing_crd_is_stalled_with_a_reason_and_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    events = record_events(monkeypatch)
    fake = nodes_kube()
    fake.errors[f"LeaderWorkerSet/{ENGINE}"] = api_error(
        404, "NotFound", "the server could not find the requested resource"
    )
    for _ in range(2):
        with pytest.raises(reconcile.RetryableError, match=leader_worker_set.CRD_NAME):
            run(fake, isvc_obj(**POOL))
    conditions = {c["type"]: c for c in fake.objects[(contract.KIND, NAME)]["status"]["conditions"]}
    stalled = conditions[ConditionType.STALLED]
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.LEADER_WORKER_SET_CRD_MISSING)
    assert leader_worker_set.INSTALL_MANIFEST_URL in stalled["message"] and ENGINE in stalled["message"]
    assert conditions[ConditionType.READY]["status"] == "False"
    assert [e[:2] for e in events if e[1] == Reason.LEADER_WORKER_SET_CRD_MISSING] == [
        ("Warning", Reason.LEADER_WORKER_SET_CRD_MISSING)
    ]  # one Event, not one per retry
    assert ("Deployment", f"{NAME}-router") in fake.objects  # the rest was applied meanwhile
    # LWS installed: the next reconcile creates it, replicas handed to the autoscaler
    del fake.errors[f"LeaderWorkerSet/{ENGINE}"]
    before = len(fake.writes)
    result, conditions = run(fake)
    assert conditions[ConditionType.STALLED]["status"] == "False"
    assert not result.ready
    # created (replicas.min, 1: the API's default) and from then on left to the autoscaler
    assert fake.objects[("LeaderWorkerSet", ENGINE)]["spec"].get("replicas", 1) == 1
    assert (f"LeaderWorkerSet/{ENGINE}", "apply") in fake.writes[before:]


def test_status_and_ready_count_groups_whose_pods_are_all_ready() -> None:
    fake = nodes_kube()
    fake.ready_replicas = 1  # the router
    result, conditions = run(fake, isvc_obj(**{**POOL, "replicas": {"min": 2, "max": 3}}))
    assert not result.ready  # no pods yet
    # group 0 whole and Ready; group 1's worker not Ready: one of two groups
    fake.pods = _group_pods(fake, groups=2, ready=[True, True, True, False])
    result, conditions = run(fake)
    engine = fake.objects[(contract.KIND, NAME)]["status"]["aggregated"]
    assert (engine["readyReplicas"], engine["desiredReplicas"], engine["replicas"], engine["summary"]) == (
        1,
        2,
        2,
        "1/2",
    )
    assert not result.ready and conditions[ConditionType.READY]["message"] == "Waiting for aggregated 1/2 ready"
    # every pod Ready, on the current template: Ready
    fake.pods = _group_pods(fake, groups=2, ready=True)
    result, conditions = run(fake)
    assert result.ready and conditions[ConditionType.READY]["status"] == "True"
    # pods of an older template are not rolled out, however ready
    fake.pods = _group_pods(fake, groups=2, ready=True, config_hash="0ld")
    result, _ = run(fake)
    assert not result.ready
    # a group with a Pending pod is a pending replica
    fake.pods = _group_pods(fake, groups=2, ready=False, phase="Pending")
    run(fake)
    assert fake.objects[(contract.KIND, NAME)]["status"]["aggregated"]["pendingReplicas"] == 2


def test_gpu_capacity_is_checked_per_pod_of_each_group() -> None:
    fake = nodes_kube(nodes=1, gpus=1)  # room for one pod of one GPU; a group needs two
    result, conditions = run(fake, isvc_obj(**POOL))
    assert result.outcome == Reason.INSUFFICIENT_GPU_CAPACITY
    assert "aggregated needs 2 pod(s) with 1 nvidia.com/gpu each" in conditions[ConditionType.STALLED]["message"]
    fits, _ = run(nodes_kube(nodes=2, gpus=1), isvc_obj(**POOL))
    assert fits.outcome != Reason.INSUFFICIENT_GPU_CAPACITY


def test_lws_status_alone_does_not_make_a_pool_ready() -> None:
    """The LWS's own counts may lag its pods (it is not watched): groups come from the pods."""
    fake = nodes_kube()
    fake.ready_replicas = 1
    run(fake, isvc_obj(**POOL))
    lws = fake.objects[("LeaderWorkerSet", ENGINE)]
    lws["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    observed = reconcile.observe_deployment(role=Role.AGGREGATED, deployment=lws, pods=[])
    assert (observed.replicas, observed.ready, observed.desired, observed.rolled_out) == (1, 0, 1, False)


def test_an_unchanged_lws_is_not_written_again() -> None:
    """Every write of an LWS bumps its generation (its webhook's patch): the reconciler sends one
    only when a field it renders differs, as the webhook stores them."""
    fake = nodes_kube()
    run(fake, isvc_obj(**POOL))
    live = fake.objects[("LeaderWorkerSet", ENGINE)]
    template = live["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):  # what the webhook makes of quantities
        resources = template[role]["spec"]["containers"][0]["resources"]
        resources["limits"]["nvidia.com/gpu"] = resources["requests"]["nvidia.com/gpu"] = "1"
    live["spec"]["replicas"] = 3  # the autoscaler's; never compared
    live["metadata"]["labels"]["team"] = "a"  # someone else's label
    before = len(fake.writes)
    result, _ = run(fake)
    assert f"LeaderWorkerSet/{ENGINE}" not in {w for w, _ in fake.writes[before:]}
    assert f"LeaderWorkerSet/{ENGINE}" not in result.updated
    # drift of a rendered field is taken back
    template["size"] = 5
    before = len(fake.writes)
    result, _ = run(fake)
    assert (f"LeaderWorkerSet/{ENGINE}", "apply") in fake.writes[before:]
    assert fake.objects[("LeaderWorkerSet", ENGINE)]["spec"]["leaderWorkerTemplate"]["size"] == 2


@pytest.mark.parametrize(
    ("want", "have", "same"),
    [
        ({"a": 1}, {"a": "1", "b": 2}, True),
        ({"a": [1, {"b": "x"}]}, {"a": ["1", {"b": "x", "c": 0}]}, True),
        ({"a": [1]}, {"a": [1, 2]}, False),
        ({"a": True}, {"a": "True"}, False),
        ({"a": 1}, {}, False),
        ({"a": "500m"}, {"a": "0.5"}, False),
    ],
)
def test_holds_compares_values_as_the_webhook_stores_them(
    want: dict[str, Any], have: dict[str, Any], same: bool
) -> None:
    assert leader_worker_set.holds(live={"spec": have}, desired={"spec": want}) is same


# ---------------------------------------------------------------------------- autoscaler
class RecordingKube:
    """Just enough of :class:`kube.Kube` for the autoscaler's reads and writes."""

    def __init__(self, objects: Mapping[tuple[str, str], dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        self.objects = dict(objects)
        self.pods = pods
        self.applied: list[dict[str, Any]] = []
        self.gets: list[str] = []

    def get(self, *, kind: kube.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.gets.append(f"{kind.kind}/{name}")
        return copy.deepcopy(self.objects.get((kind.kind, name)))

    def list(self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        wanted = dict(item.split("=", 1) for item in label_selector.split(",") if item)
        return [p for p in self.pods if _selects(wanted, p["metadata"]["labels"])]

    def apply(self, *, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]:
        self.applied.append({"obj": copy.deepcopy(dict(obj)), "manager": field_manager, "force": force})
        return dict(obj)

    def merge_patch(self, **_: Any) -> dict[str, Any]:
        raise AssertionError("no pod of a LeaderWorkerSet is annotated")


def _reconciled_lws() -> tuple[FakeKube, dict[str, Any]]:
    fake = nodes_kube()
    run(fake, isvc_obj(**{**POOL, "replicas": {"min": 3, "max": 4}}))
    return fake, fake.objects[("LeaderWorkerSet", ENGINE)]


def test_autoscaler_observes_groups_and_scales_the_leader_worker_set() -> None:
    fake, lws = _reconciled_lws()
    pods = _group_pods(fake, groups=3, ready=[True, True, True, False, False, False])
    pods[4]["status"] = {
        "phase": "Pending",
        "conditions": [  # group 2: a worker waits for GPUs
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    api = RecordingKube({("LeaderWorkerSet", ENGINE): lws}, pods)
    obs = observe_pool(api=api, namespace="n", name=NAME, pool="aggregated")  # type: ignore[arg-type]
    assert obs is not None
    assert api.gets == [f"Deployment/{ENGINE}", f"LeaderWorkerSet/{ENGINE}"]
    assert obs.kind is kube.LEADER_WORKER_SET and obs.deployment == ENGINE and obs.current_replicas == 3
    # ready: group 0 (its leader stands for it); pending for GPUs: group 2; starting: group 1
    assert (obs.ready_pod_names, obs.pending_for_gpus, obs.starting) == ([f"{ENGINE}-0"], (f"{ENGINE}-2",), 1)
    actuator.apply_replicas(
        api=api,  # type: ignore[arg-type]
        namespace="n",
        deployment=obs.deployment,
        replicas=4,
        kind=obs.kind,
    )
    assert api.applied == [
        {
            "obj": {
                "apiVersion": LWS_API,
                "kind": "LeaderWorkerSet",
                "metadata": {"name": ENGINE, "namespace": "n"},
                "spec": {"replicas": 4},
            },
            "manager": contract.FIELD_MANAGER_AUTOSCALER,
            "force": True,
        }
    ]
    # without the kind (an older caller), the workload is found by name
    api.applied.clear()
    actuator.apply_replicas(api=api, namespace="n", deployment=ENGINE, replicas=2)  # type: ignore[arg-type]
    assert api.applied[0]["obj"]["kind"] == "LeaderWorkerSet"
    # a LeaderWorkerSet drops its highest groups: deletion costs would mean nothing
    assert (
        actuator.annotate_deletion_costs(
            api=api,  # type: ignore[arg-type]
            namespace="n",
            pods=obs.ready_pods,
            load_by_pod={f"{ENGINE}-0": 3.0},
        )
        == []
    )


def test_a_deployment_pool_is_still_read_and_scaled_as_before() -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": ENGINE}, "spec": {"replicas": 2}}
    api = RecordingKube({("Deployment", ENGINE): deployment}, [])
    obs = observe_pool(api=api, namespace="n", name=NAME, pool="aggregated")  # type: ignore[arg-type]
    assert obs is not None and obs.kind is kube.DEPLOYMENT and api.gets == [f"Deployment/{ENGINE}"]
    actuator.apply_replicas(api=api, namespace="n", deployment=ENGINE, replicas=3, kind=obs.kind)  # type: ignore[arg-type]
    assert api.applied[0]["obj"]["kind"] == "Deployment"
    assert classify(pool="aggregated", deployment=deployment, pods=[]).kind is kube.DEPLOYMENT


def test_a_group_is_one_replica_of_gpus_in_the_budget() -> None:
    spec = InferenceService.parse(
        _obj(
            mode="Disaggregated",
            pool=ONE_POD,
            decode={
                "replicas": {"min": 1, "max": 4},
                "resources": {"gpus": 4, "gpusPerNode": 2},
                "parallelism": {"tensor": 4},
            },
            autoscaling={"gpuBudget": 10},
        )
    ).spec
    assert policy_for(spec=spec, pool="decode")[2] == 4  # the whole group's GPUs
    assert policy_for(spec=spec, pool="prefill")[2] == 2

    def up(pool: str, current: int, gpus: int) -> Any:
        return decide(
            pool=pool,
            now_seconds=0.0,
            current_replicas=current,
            ready_replicas=current,
            pending_replicas=0,
            signals={"queue": SignalValue(value=40.0, target=2.0)},
            policy=PoolPolicy(min_replicas=1, max_replicas=4),
            history=RecommendationHistory(),
            gpus_per_replica=gpus,
        )

    # prefill 1 x 2 GPUs + decode 1 group x 4 GPUs = 6 of 10: room for one more group, not two
    decisions = plan_joint(decisions=[up("prefill", 1, 2), up("decode", 1, 4)], gpu_budget=10)
    by_pool = {d.pool: d for d in decisions}
    assert by_pool["decode"].result * 4 + by_pool["prefill"].result * 2 <= 10
    assert by_pool["decode"].result in (1, 2)
    # a group with a pod pending for GPUs holds scale-ups (pending awareness, in groups)
    held = decide(
        pool="decode",
        now_seconds=0.0,
        current_replicas=2,
        ready_replicas=1,
        pending_replicas=1,
        signals={"queue": SignalValue(value=40.0, target=2.0)},
        policy=PoolPolicy(min_replicas=1, max_replicas=4),
        history=RecommendationHistory(),
        gpus_per_replica=4,
    )
    assert held.result == 2 and held.reason == Reason.PENDING_PODS


# ---------------------------------------------------------------------------- the chart
@pytest.mark.skipif(helm_binary() is None, reason="helm binary not found (run the e2e build first)")
@pytest.mark.parametrize(("sets", "kind"), [((), "ClusterRole"), (("rbac.scope=namespace",), "Role")])
def test_operator_may_write_what_it_renders_and_scales(sets: tuple[str, ...], kind: str) -> None:
    held = operator_rules(sets=sets, kind=kind)
    # the reconciler's server-side apply (a GET, then a PATCH that may create) and the
    # autoscaler's (a GET to find the workload, a PATCH of spec.replicas)
    for verb in ("get", "create", "patch"):
        assert holds(held, leader_worker_set.API_GROUP, leader_worker_set.PLURAL, verb), verb
    for sub in ("scale", "status"):
        assert holds(held, leader_worker_set.API_GROUP, f"{leader_worker_set.PLURAL}/{sub}", "get"), sub
    # least privilege: never deleted nor watched by the operator (the garbage collector deletes)
    for verb in ("delete", "watch", "update"):
        assert not holds(held, leader_worker_set.API_GROUP, leader_worker_set.PLURAL, verb), verb
