"""Pods that keep failing at start-up become ModelUnavailable / PodStartFailed conditions.

Detection (:func:`failures.pod_start_failure`) is tested on pod dicts; the conditions and
Events through a whole :func:`reconcile.reconcile` against an in-memory API
(:mod:`kube_testing`)."""

from __future__ import annotations

from typing import Any

import pytest
from kube_testing import FakeKube, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_operator import failures, handlers, reconcile

LOAD_ERROR = (
    "ModelLoadError: model 'hf://nobody/not-in-cache' is not in the local cache /cache "
    "(looked for /cache/nobody/not-in-cache and /cache/models--nobody--not-in-cache; "
    "nothing is downloaded: pre-fill the cache or set SPLITSERVE_MODEL_CACHE)"
)


def _pod(
    name: str,
    *,
    role: str = "aggregated",
    restarts: int = 1,
    exit_code: int = 1,
    message: str = "",
    waiting: str = "CrashLoopBackOff",
    ready: bool = False,
) -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Error"}
    if message:
        terminated["message"] = message
    return {
        "metadata": {"name": name, "labels": {contract.LABEL_ROLE: role, contract.LABEL_INSTANCE: "tiny"}},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "runtime",
                    "ready": ready,
                    "restartCount": restarts,
                    "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}},
                    "lastState": {"terminated": terminated} if restarts else {},
                }
            ],
        },
    }


def test_model_load_failure_is_detected_from_the_log_tail() -> None:
    tail = (
        "INFO starting\nTraceback (most recent call last):\n  File x\n"
        + f"splitserve_contract.model_config.{LOAD_ERROR}\nINFO Shutting down\n"
    )
    failure = failures.pod_start_failure(_pod("p1", message=tail))
    assert failure is not None and failure.model_unavailable and failure.reason == Reason.MODEL_UNAVAILABLE
    assert "is not in the local cache" in failure.message and "Shutting down" not in failure.message
    assert failure.role == "aggregated" and failure.exit_code == 1 and failure.container == "runtime"


def test_other_failures_and_non_failures() -> None:
    other = failures.pod_start_failure(_pod("p", message="x" * 5000 + "CUDA error: out of memory"))
    assert other is not None and other.reason == Reason.POD_START_FAILED
    assert other.message.endswith("out of memory") and len(other.message) <= failures.MAX_MESSAGE_CHARS
    no_message = failures.pod_start_failure(_pod("p", exit_code=137))
    assert no_message is not None and no_message.describe() == "pod p (container runtime) exited with code 137"
    # restarted after a failure but now waiting for something else: still failing at start-up
    assert failures.pod_start_failure(_pod("p", waiting="")) is not None
    # crash loop reported before the kubelet wrote lastState
    assert failures.pod_start_failure(_pod("p", restarts=0)) is not None
    assert failures.pod_start_failure(_pod("p", restarts=0, waiting="ContainerCreating")) is None
    assert failures.pod_start_failure(_pod("p", exit_code=0, waiting="")) is None  # completed, restarted
    assert failures.pod_start_failure(_pod("p", ready=True, message=LOAD_ERROR)) is None
    gone = _pod("p", message=LOAD_ERROR)
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert failures.pod_start_failure(gone) is None
    assert failures.pod_start_failure({"metadata": {"name": "x"}, "status": {"phase": "Pending"}}) is None


def test_pod_events_that_trigger_a_reconcile() -> None:
    assert handlers.pod_needs_reconcile(_pod("p", message=LOAD_ERROR))
    assert handlers.pod_needs_reconcile({"status": {"conditions": [{"type": "PodScheduled", "status": "False"}]}})
    assert not handlers.pod_needs_reconcile(_pod("p", restarts=0, waiting="ContainerCreating"))


def test_only_pools_without_a_ready_replica_are_reported() -> None:
    def pool(role: contract.Role, ready: int) -> reconcile.PoolObservation:
        return reconcile.PoolObservation(role=role, replicas=2, ready=ready, desired=2, pending=0, rolled_out=False)

    pools = {contract.Role.PREFILL: pool(contract.Role.PREFILL, 1), contract.Role.DECODE: pool(contract.Role.DECODE, 0)}
    pods = [
        _pod("pre-1", role="prefill", message=LOAD_ERROR),
        _pod("dec-1", role="decode", message="segfault"),
        _pod("dec-2", role="decode", message=LOAD_ERROR),
    ]
    found = reconcile.pod_failures(pools=pools, pods=pods)
    assert [f.pod for f in found] == ["dec-2"]  # the model failure says the most


# ---------------------------------------------------------------------------- whole reconciles


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    recorded: list[tuple[str, str, str]] = record_events(monkeypatch)
    return recorded


def _kinds(posted: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    return [(type_, reason) for type_, reason, _ in posted]


def test_model_unavailable_condition_and_one_event(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    result, conds = run(fake)
    assert result.outcome == Reason.PROGRESSING and conds[ConditionType.STALLED]["status"] == "False"
    fake.pods = [_pod("tiny-aggregated-1", message=f"INFO x\n{LOAD_ERROR}\nINFO Shutting down\n")]
    posted.clear()
    result, conds = run(fake)
    assert result.outcome == Reason.MODEL_UNAVAILABLE
    ready, stalled = conds[ConditionType.READY], conds[ConditionType.STALLED]
    assert (ready["status"], ready["reason"]) == ("False", Reason.MODEL_UNAVAILABLE)
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.MODEL_UNAVAILABLE)
    assert "not in the local cache" in ready["message"] and "tiny-aggregated-1" in ready["message"]
    # kstatus reads the first of Reconciling/Stalled that is True: a stall must not also say
    # Reconciling=True, or Flux and kubectl-style waits see "in progress" for ever.
    assert conds[ConditionType.RECONCILING]["status"] == "False"
    assert _kinds(posted) == [("Warning", Reason.MODEL_UNAVAILABLE)]
    posted.clear()
    run(fake)  # no transition: no second Event
    assert posted == []


def test_other_start_failure_and_recovery(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    fake.pods = [_pod("tiny-aggregated-1", message="RuntimeError: CUDA driver too old")]
    result, conds = run(fake)
    assert result.outcome == Reason.POD_START_FAILED
    assert conds[ConditionType.STALLED]["reason"] == Reason.POD_START_FAILED
    assert "CUDA driver too old" in conds[ConditionType.READY]["message"]
    # one replica became ready: crashing siblings no longer flip Ready to False
    fake.ready_replicas = 1  # (every apply refreshes the fake Deployments' status)
    result, conds = run(fake)
    assert result.ready and conds[ConditionType.READY]["reason"] == Reason.RECONCILED
    assert ("Normal", Reason.READY) in _kinds(posted)
