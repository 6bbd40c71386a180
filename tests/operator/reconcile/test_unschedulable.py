"""Hostile review: pods the scheduler cannot place are reported with the scheduler's words.

Before the fix, a pool asking for more memory than any node has read
``InsufficientGPUCapacity`` whenever some node (one without GPUs) also appeared in the
scheduler's message as "Insufficient nvidia.com/gpu", although the GPU nodes had GPUs to
spare; a nodeSelector no node matches, or a ``pvc://`` claim that does not exist, read
``RolloutInProgress`` until the Deployment's progress deadline and then only "ReplicaSet has
timed out progressing". Now any ``PodScheduled=False``/``Unschedulable`` pod of a pool without
a ready replica is ``Stalled=True`` with the scheduler's message, and GPUs are named only when
the scheduler names ``nvidia.com/gpu`` as the only resource lacking. The real scheduler's
messages: ``e2e/test_hostile_manifests.py`` (memory-beyond-the-nodes,
node-selector-matching-nothing, model-claim-missing)."""

from __future__ import annotations

from typing import Any

import pytest
from kube_testing import FakeKube, isvc_obj, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason, Role
from splitserve_operator import capacity, failures, handlers

GPUS_SHORT = (
    "0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
    "2 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
    "1 Preemption is not helpful for scheduling, 2 No preemption victims found for incoming pod."
)
MEMORY_SHORT = (
    "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 Insufficient memory. "
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)
"""The GPU nodes lack memory; the node without GPUs is passed over for its GPUs."""
SELECTOR = (
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. "
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)
NO_CLAIM = (
    '0/3 nodes are available: persistentvolumeclaim "no-such-claim" not found. '
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)
BOTH_SHORT = "0/2 nodes are available: 2 Insufficient memory, 2 Insufficient nvidia.com/gpu."


def _pending(name: str, *, role: str, message: str, reason: str = "Unschedulable") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {contract.LABEL_ROLE: role, contract.LABEL_INSTANCE: "tiny"}},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": reason, "message": message}],
        },
    }


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    recorded: list[tuple[str, str, str]] = record_events(monkeypatch)
    return recorded


def test_gpus_are_the_cause_only_when_they_are_the_only_resource_lacking() -> None:
    assert capacity.lacks_only_gpus(GPUS_SHORT)
    assert capacity.lacks_only_gpus("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    for message in (
        MEMORY_SHORT,
        SELECTOR,
        NO_CLAIM,
        BOTH_SHORT,
        "",
        "Insufficient cpu",
        "0/2 nodes are available: 2 Insufficient nvidia.com/gpu-other.",
    ):
        assert not capacity.lacks_only_gpus(message), message
    pods = [
        _pending(n, role="decode", message=m)
        for n, m in (("gpu", GPUS_SHORT), ("mem", MEMORY_SHORT), ("sel", SELECTOR))
    ]
    assert capacity.unschedulable_gpu_pods(pods) == ["gpu"]


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (GPUS_SHORT, Reason.INSUFFICIENT_GPU_CAPACITY),
        (MEMORY_SHORT, Reason.UNSCHEDULABLE),
        (SELECTOR, Reason.UNSCHEDULABLE),
        (NO_CLAIM, Reason.UNSCHEDULABLE),
        (BOTH_SHORT, Reason.UNSCHEDULABLE),
    ],
)
def test_an_unschedulable_pod_is_a_pod_failure_with_the_schedulers_words(message: str, reason: str) -> None:
    failure = failures.pod_failure(_pending("tiny-decode-1", role="decode", message=message))
    assert isinstance(failure, failures.PodUnschedulable)
    assert failure.reason == reason and failure.role == "decode"
    assert failure.describe() == f"pod tiny-decode-1 cannot be scheduled: {message}"
    assert handlers.pod_needs_reconcile(_pending("p", role="decode", message=message))


def test_pods_that_are_not_refused_by_the_scheduler_are_not_failures() -> None:
    assert failures.pod_failure(_pending("p", role="decode", message=SELECTOR, reason="SchedulingGated")) is None
    scheduled = _pending("p", role="decode", message="")
    scheduled["status"]["conditions"][0]["status"] = "True"
    assert failures.pod_failure(scheduled) is None
    running = _pending("p", role="decode", message=MEMORY_SHORT)
    running["status"]["phase"] = "Running"
    assert failures.pod_failure(running) is None
    gone = _pending("p", role="decode", message=MEMORY_SHORT)
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert failures.pod_failure(gone) is None


def test_a_start_failure_of_a_sibling_says_more_than_the_scheduler() -> None:
    crashing = {
        "metadata": {"name": "b", "labels": {contract.LABEL_ROLE: "decode"}},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "runtime",
                    "ready": False,
                    "restartCount": 2,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                }
            ],
        },
    }
    pods = [_pending("a", role="decode", message=MEMORY_SHORT), crashing]
    assert [f.pod for f in failures.pod_failures(roles=[Role.DECODE], pods=pods)] == ["b"]


@pytest.mark.parametrize(
    ("message", "words"),
    [
        (MEMORY_SHORT, "2 Insufficient memory"),
        (SELECTOR, "didn't match Pod's node affinity/selector"),
        (NO_CLAIM, 'persistentvolumeclaim "no-such-claim" not found'),
    ],
)
def test_unschedulable_pods_stall_the_service_with_the_schedulers_message(
    posted: list[tuple[str, str, str]], message: str, words: str
) -> None:
    # before the fix: MEMORY_SHORT read InsufficientGPUCapacity, the others Progressing
    fake = FakeKube()
    fake.pods = [_pending("tiny-decode-1", role="decode", message=message)]
    result, conds = run(fake, isvc_obj(mode="Disaggregated", resources={"gpus": 1}))
    assert result.outcome == Reason.UNSCHEDULABLE
    stalled = conds[ConditionType.STALLED]
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.UNSCHEDULABLE)
    assert stalled["message"] == f"pod tiny-decode-1 cannot be scheduled: {message}" and words in stalled["message"]
    assert conds[ConditionType.RECONCILING]["status"] == "False"
    assert (conds[ConditionType.READY]["status"], conds[ConditionType.READY]["reason"]) == (
        "False",
        Reason.UNSCHEDULABLE,
    )
    assert [(t, r) for t, r, _ in posted if t == "Warning"] == [("Warning", Reason.UNSCHEDULABLE)]


def test_pods_pending_for_gpus_alone_stay_insufficient_gpu_capacity() -> None:
    fake = FakeKube()
    fake.pods = [_pending("tiny-decode-1", role="decode", message=GPUS_SHORT)]
    result, conds = run(fake, isvc_obj(mode="Disaggregated", resources={"gpus": 8}))
    assert result.outcome == Reason.INSUFFICIENT_GPU_CAPACITY
    assert "nvidia.com/gpu" in conds[ConditionType.STALLED]["message"]


def test_a_pool_whose_constraints_match_no_node_is_not_a_gpu_shortfall() -> None:
    # the scheduler says why no node matches (Unschedulable); nodes with GPUs that are too
    # few still are a shortfall
    gpu_node = {
        "metadata": {"name": "a", "labels": {"type": "gpu"}},
        "spec": {},
        "status": {"allocatable": {capacity.GPU_RESOURCE: "8"}},
    }
    assert (
        capacity.gpu_shortfall(
            pool="decode", pods=1, gpus_per_pod=1, node_selector={"type": "none"}, tolerations=[], nodes=[gpu_node]
        )
        is None
    )
    gap = capacity.gpu_shortfall(
        pool="decode", pods=2, gpus_per_pod=8, node_selector={"type": "gpu"}, tolerations=[], nodes=[gpu_node]
    )
    assert gap is not None and gap.matching_nodes == 1 and gap.fitting_pods == 1
