"""Pure parts of the controller: condition merging, status patches, ownership checks,
capacity arithmetic, Deployment observation, coalescing of reconcile requests."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

import splitserve_contract as contract
from splitserve_contract import Role
from splitserve_operator import apply, capacity, handlers, kube, reconcile, status
from splitserve_operator.status import ConditionUpdate

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def test_merge_conditions_keeps_other_types_and_transition_time() -> None:
    live: list[dict[str, Any]] = [
        {
            "type": "Ready",
            "status": "False",
            "reason": "RolloutInProgress",
            "message": "",
            "lastTransitionTime": "2026-01-01T11:00:00Z",
            "observedGeneration": 1,
        },
        {
            "type": "MetricsHealthy",
            "status": "True",
            "reason": "MetricsAvailable",
            "message": "",
            "lastTransitionTime": "2026-01-01T10:00:00Z",
        },
    ]
    out = status.merge_conditions(
        live=live, updates=[ConditionUpdate("Ready", "False", "PodsNotReady", "x")], observed_generation=2, now=T1
    )
    by_type = {c["type"]: c for c in out}
    assert by_type["MetricsHealthy"] == live[1]  # the other writer's condition is untouched
    assert by_type["Ready"]["lastTransitionTime"] == "2026-01-01T11:00:00Z"  # status unchanged
    assert by_type["Ready"]["reason"] == "PodsNotReady" and by_type["Ready"]["observedGeneration"] == 2
    flipped = status.merge_conditions(
        live=out, updates=[ConditionUpdate("Ready", "True", "Reconciled")], observed_generation=2, now=T1
    )
    assert {c["type"]: c for c in flipped}["Ready"]["lastTransitionTime"] == "2026-01-01T12:05:00Z"
    added = status.merge_conditions(
        live=[], updates=[ConditionUpdate("Stalled", "False", "Reconciled")], observed_generation=None, now=T0
    )
    assert added == [
        {
            "type": "Stalled",
            "status": "False",
            "reason": "Reconciled",
            "message": "",
            "lastTransitionTime": "2026-01-01T12:00:00Z",
        }
    ]


def test_merge_patch_of_removes_and_nests() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "gone": True}
    new = {"a": 1, "b": {"c": 5, "d": 3}, "e": [1]}
    assert status._merge_patch_of(old, new) == {"gone": None, "b": {"c": 5}, "e": [1]}


class _ConflictingKube:
    """Stands in for the API server in one narrow case: a status write that loses a race."""

    def __init__(self, *, conflicts: int) -> None:
        self.conflicts = conflicts
        self.obj: dict[str, Any] = {
            "metadata": {"name": "a", "namespace": "n", "resourceVersion": "1", "generation": 4},
            "status": {
                "conditions": [
                    {
                        "type": "MetricsHealthy",
                        "status": "True",
                        "reason": "MetricsAvailable",
                        "message": "",
                        "lastTransitionTime": "2026-01-01T10:00:00Z",
                    }
                ]
            },
        }
        self.patches: list[dict[str, Any]] = []

    def get(self, **_: Any) -> dict[str, Any]:
        return self.obj

    def merge_patch(self, *, patch: Mapping[str, Any], **_: Any) -> dict[str, Any]:
        self.patches.append(dict(patch))
        if self.conflicts:
            self.conflicts -= 1
            # someone else wrote meanwhile: a new condition of theirs appears
            st: dict[str, Any] = self.obj["status"]
            st["conditions"].append(
                {
                    "type": "ScalingActive",
                    "status": "True",
                    "reason": "x",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T10:00:00Z",
                }
            )
            self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
            raise ApiException(status=409, reason="Conflict")
        meta: dict[str, Any] = self.obj["metadata"]
        assert patch["metadata"]["resourceVersion"] == meta["resourceVersion"]
        self.obj["status"] = {**self.obj["status"], "conditions": patch["status"]["conditions"]}
        return self.obj


def test_patch_status_retries_conflicts_without_losing_conditions() -> None:
    fake = _ConflictingKube(conflicts=2)
    written = status.patch_status(
        api=fake,
        namespace="n",
        name="a",
        conditions=[ConditionUpdate("Ready", "True", "Reconciled")],
        observed_generation=4,
        clock=lambda: T0,
    )
    assert written is not None
    assert {c["type"] for c in written["conditions"]} == {"MetricsHealthy", "ScalingActive", "Ready"}
    assert len(fake.patches) == 3


def test_patch_status_writes_nothing_when_unchanged() -> None:
    fake = _ConflictingKube(conflicts=0)
    status.patch_status(
        api=fake, namespace="n", name="a", conditions=[ConditionUpdate("Ready", "True", "Reconciled")], clock=lambda: T0
    )
    status.patch_status(
        api=fake, namespace="n", name="a", conditions=[ConditionUpdate("Ready", "True", "Reconciled")], clock=lambda: T1
    )
    assert len(fake.patches) == 1


def test_patch_status_gives_up_after_bounded_conflicts() -> None:
    fake = _ConflictingKube(conflicts=100)
    with pytest.raises(ApiException):
        status.patch_status(
            api=fake, namespace="n", name="a", conditions=[ConditionUpdate("Ready", "True", "Reconciled")]
        )
    assert len(fake.patches) == status.MAX_ATTEMPTS


def test_ownership_helpers() -> None:
    owner = apply.Owner(name="a", uid="u1")
    mine = {"metadata": {"ownerReferences": [owner.reference()]}}
    other = {"metadata": {"ownerReferences": [{**owner.reference(), "uid": "u2"}]}}
    not_controller = {"metadata": {"ownerReferences": [{**owner.reference(), "controller": False}]}}
    assert apply.is_controlled_by(mine, owner=owner)
    assert not apply.is_controlled_by(other, owner=owner)
    assert not apply.is_controlled_by(not_controller, owner=owner)
    assert not apply.is_controlled_by({"metadata": {}}, owner=owner)
    managed: dict[str, Any] = {
        "metadata": {
            "managedFields": [
                {
                    "manager": contract.FIELD_MANAGER_RECONCILER,
                    "operation": "Apply",
                    "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}},
                }
            ]
        }
    }
    assert apply.reconciler_owns_replicas(managed)
    managed["metadata"]["managedFields"][0]["fieldsV1"]["f:spec"].pop("f:replicas")
    assert not apply.reconciler_owns_replicas(managed)


def _node(
    name: str,
    *,
    gpus: int,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    unschedulable: bool = False,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"taints": taints or [], "unschedulable": unschedulable},
        "status": {"allocatable": {capacity.GPU_RESOURCE: str(gpus)}},
    }


def test_gpu_shortfall() -> None:
    taint = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
    tol = [{"key": "kwok.x-k8s.io/node", "operator": "Equal", "value": "fake", "effect": "NoSchedule"}]
    nodes = [
        _node("a", gpus=8, labels={"type": "kwok"}, taints=[taint]),
        _node("b", gpus=8, labels={"type": "kwok"}, taints=[taint]),
        _node("c", gpus=8, unschedulable=True),
        _node("d", gpus=4),
    ]
    assert (
        capacity.gpu_shortfall(
            pool="decode", pods=2, gpus_per_pod=8, node_selector={"type": "kwok"}, tolerations=tol, nodes=nodes
        )
        is None
    )
    gap = capacity.gpu_shortfall(
        pool="decode", pods=3, gpus_per_pod=8, node_selector={"type": "kwok"}, tolerations=tol, nodes=nodes
    )
    assert gap is not None and gap.fitting_pods == 2 and gap.matching_nodes == 2
    untolerated = capacity.gpu_shortfall(
        pool="p", pods=1, gpus_per_pod=1, node_selector={"type": "kwok"}, tolerations=[], nodes=nodes
    )
    assert untolerated is None  # no node matches: the scheduler's message says why (Unschedulable)
    assert (
        capacity.gpu_shortfall(pool="p", pods=1, gpus_per_pod=4, node_selector={}, tolerations=[], nodes=nodes) is None
    )  # node d
    assert (
        capacity.gpu_shortfall(pool="cpu", pods=5, gpus_per_pod=0, node_selector={}, tolerations=[], nodes=[]) is None
    )


def test_unschedulable_gpu_pods() -> None:
    pending = {
        "metadata": {"name": "p1"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        },
    }
    other = {
        "metadata": {"name": "p2"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "Insufficient cpu"}
            ],
        },
    }
    assert capacity.unschedulable_gpu_pods([pending, other, {"metadata": {"name": "p3"}, "status": {}}]) == ["p1"]


def test_observe_deployment_rollout_state() -> None:
    dep = {
        "metadata": {"generation": 3},
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": 3,
            "replicas": 2,
            "updatedReplicas": 2,
            "availableReplicas": 2,
            "readyReplicas": 2,
        },
    }
    pods = [
        {"metadata": {"labels": {contract.LABEL_ROLE: "prefill"}}, "status": {"phase": "Pending"}},
        {"metadata": {"labels": {contract.LABEL_ROLE: "decode"}}, "status": {"phase": "Pending"}},
    ]
    done = reconcile.observe_deployment(role=Role.PREFILL, deployment=dep, pods=pods)
    assert done.rolled_out and done.ready == 2 and done.desired == 2 and done.pending == 1
    rolling = {**dep, "status": {**dep["status"], "replicas": 3, "updatedReplicas": 1}}
    assert not reconcile.observe_deployment(role=Role.PREFILL, deployment=rolling, pods=[]).rolled_out
    stale = {**dep, "metadata": {"generation": 4}}
    assert not reconcile.observe_deployment(role=Role.PREFILL, deployment=stale, pods=[]).rolled_out


def test_is_paused_and_owner_key() -> None:
    assert reconcile.is_paused({"metadata": {"annotations": {contract.ANNOTATION_PAUSED: "true"}}})
    assert reconcile.is_paused({"metadata": {"annotations": {contract.ANNOTATION_PAUSED: "True"}}})
    assert not reconcile.is_paused({"metadata": {"annotations": {contract.ANNOTATION_PAUSED: "false"}}})
    assert not reconcile.is_paused({"metadata": {}})
    child = {"metadata": {"namespace": "n", "ownerReferences": [apply.Owner(name="a", uid="u").reference()]}}
    assert handlers.owner_key(child) == ("n", "a")
    foreign = {
        "metadata": {
            "namespace": "n",
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "x", "uid": "y", "controller": True}
            ],
        }
    }
    assert handlers.owner_key(foreign) is None


def test_retry_delay_is_bounded() -> None:
    assert [handlers.retry_delay(i) for i in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert handlers.retry_delay(50) == handlers.MAX_RETRY_DELAY_SECONDS


async def test_coalescer_runs_once_per_burst_and_never_concurrently() -> None:
    running = 0
    max_running = 0
    runs = 0

    async def run(key: handlers.Key) -> bool:
        nonlocal running, max_running, runs
        running += 1
        max_running = max(max_running, running)
        runs += 1
        await asyncio.sleep(0.05)
        running -= 1
        return True

    coalescer = handlers.Coalescer(run=run)
    for _ in range(20):  # before the run starts: one run reads the latest state for all
        coalescer.request(("n", "a"))
    await asyncio.sleep(0.01)
    for _ in range(5):  # during the run: exactly one re-run
        coalescer.request(("n", "a"))
    async with coalescer.lock(("n", "a")):  # the kopf-handler path shares the lock
        assert running == 0
    while coalescer.pending():
        await asyncio.sleep(0.01)
    assert runs == 2
    assert max_running == 1
    assert not coalescer._locks and not coalescer._users  # nothing left behind per object


async def test_a_request_from_another_thread_starts_a_reconcile_on_the_loop() -> None:
    """The Secret watch requests reconciles from its own thread."""
    import threading

    seen: list[tuple[handlers.Key, str]] = []

    async def run(key: handlers.Key) -> bool:
        seen.append((key, threading.current_thread().name))
        return True

    coalescer = handlers.Coalescer(run=run)
    request = coalescer.from_thread()
    thread = threading.Thread(target=request, args=(("n", "a"),), name="secret-watch")
    thread.start()
    thread.join()
    while not seen or coalescer.pending():
        await asyncio.sleep(0.01)
    assert seen == [(("n", "a"), threading.current_thread().name)]


def test_kind_paths() -> None:
    assert kube.DEPLOYMENT.object_path(namespace="n", name="a") == "/apis/apps/v1/namespaces/n/deployments/a"
    assert kube.CONFIG_MAP.collection_path(namespace="n") == "/api/v1/namespaces/n/configmaps"
    assert kube.NODE.collection_path(namespace="ignored") == "/api/v1/nodes"
    assert (
        kube.INFERENCE_SERVICE.object_path(namespace="n", name="x")
        == "/apis/splitserve.dev/v1alpha1/namespaces/n/inferenceservices/x"
    )
