"""Issue 12 #13: children's failures show in the InferenceService as Stalled=True.

With a ``priorityClassName`` that does not exist, the prefill Deployment said
``ReplicaFailure=True FailedCreate`` and later ``ProgressDeadlineExceeded``, yet the
InferenceService said ``RolloutInProgress`` and ``Stalled=False`` for over an hour. Now the
child's reason and message become Stalled (kstatus: Reconciling=False, so Argo CD, Flux and
``kubectl wait`` see it): Deployment ReplicaFailure and ProgressDeadlineExceeded, and pods in
ImagePullBackOff / ErrImagePull / CreateContainerConfigError or OOMKilled, next to the
existing ModelUnavailable / PodStartFailed (``test_pod_failures.py``). Issue 11: an OOMKilled
message names the pool, the container and its memory limit (on the kubelet node:
``e2e/test_real_node_oom.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from kube_testing import FakeKube, isvc_obj, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason, Role
from splitserve_operator import failures, handlers

NO_PRIORITY_CLASS = 'pods "tiny-prefill-5d8c-" is forbidden: no PriorityClass with name does-not-exist was found'
REPLICA_FAILURE = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": NO_PRIORITY_CLASS}
DEADLINE = {
    "type": "Progressing",
    "status": "False",
    "reason": "ProgressDeadlineExceeded",
    "message": 'ReplicaSet "tiny-prefill-5d8c" has timed out progressing.',
}
STILL_PROGRESSING = {
    "type": "Progressing",
    "status": "True",
    "reason": "ReplicaSetUpdated",
    "message": 'ReplicaSet "tiny-prefill-5d8c" is progressing.',
}
PULL_MESSAGE = 'Back-off pulling image "registry.example/nope:1"'


def _waiting_pod(name: str, *, role: str, reason: str, message: str = "") -> dict[str, Any]:
    waiting = {"reason": reason, **({"message": message} if message else {})}
    return {
        "metadata": {"name": name, "labels": {contract.LABEL_ROLE: role, contract.LABEL_INSTANCE: "tiny"}},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "runtime", "ready": False, "restartCount": 0, "state": {"waiting": waiting}}
            ],
        },
    }


OOM_TERMINATED = {"exitCode": 137, "reason": "OOMKilled"}


def _oom_pod(
    name: str,
    *,
    role: str,
    memory: str | None = "96Mi",
    restarts: int = 2,
    state: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
) -> dict[str, Any]:
    resources = {"requests": {"cpu": "1"}, **({"limits": {"memory": memory}} if memory else {})}
    return {
        "metadata": {"name": name, "labels": {contract.LABEL_ROLE: role, contract.LABEL_INSTANCE: "tiny"}},
        "spec": {"containers": [{"name": "runtime", "resources": resources}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "runtime",
                    "ready": False,
                    "restartCount": restarts,
                    "state": state if state is not None else {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": last if last is not None else OOM_TERMINATED},
                }
            ],
        },
    }


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    recorded: list[tuple[str, str, str]] = record_events(monkeypatch)
    return recorded


def _stalled(conds: dict[str, dict[str, Any]]) -> tuple[str, str]:
    return conds[ConditionType.STALLED]["status"], conds[ConditionType.STALLED]["reason"]


def test_missing_priority_class_is_stalled_failed_create(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    fake.deployment_conditions["tiny-prefill"] = [STILL_PROGRESSING, REPLICA_FAILURE]
    result, conds = run(fake, isvc_obj(mode="Disaggregated", priorityClassName="does-not-exist"))
    # before the fix: Progressing, RolloutInProgress, Stalled=False
    assert result.outcome == Reason.FAILED_CREATE
    assert _stalled(conds) == ("True", Reason.FAILED_CREATE)
    assert conds[ConditionType.RECONCILING]["status"] == "False"
    assert (conds[ConditionType.READY]["status"], conds[ConditionType.READY]["reason"]) == (
        "False",
        Reason.FAILED_CREATE,
    )
    message = conds[ConditionType.STALLED]["message"]
    assert "Deployment tiny-prefill" in message and "no PriorityClass with name does-not-exist" in message
    assert [(t, r) for t, r, _ in posted if t == "Warning"] == [("Warning", Reason.FAILED_CREATE)]
    posted.clear()
    run(fake)  # the same failure: no second Event
    assert [r for t, r, _ in posted if t == "Warning"] == []


def test_progress_deadline_exceeded_is_stalled() -> None:
    fake = FakeKube()
    fake.deployment_conditions["tiny-engine"] = [DEADLINE]
    result, conds = run(fake)
    assert result.outcome == Reason.PROGRESS_DEADLINE_EXCEEDED
    assert _stalled(conds) == ("True", Reason.PROGRESS_DEADLINE_EXCEEDED)
    assert "has timed out progressing" in conds[ConditionType.STALLED]["message"]


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("ImagePullBackOff", PULL_MESSAGE),
        ("ErrImagePull", "rpc error: not found"),
        ("CreateContainerConfigError", 'secret "api-key" not found'),
        ("InvalidImageName", ""),
    ],
)
def test_pods_that_cannot_start_are_stalled_with_the_kubelets_reason(reason: str, message: str) -> None:
    fake = FakeKube()
    fake.pods = [_waiting_pod("tiny-aggregated-1", role="aggregated", reason=reason, message=message)]
    result, conds = run(fake)
    assert result.outcome == reason and _stalled(conds) == ("True", reason)
    assert (
        f"pod tiny-aggregated-1 (container runtime) cannot start: {reason}" in conds[ConditionType.STALLED]["message"]
    )
    assert message in conds[ConditionType.STALLED]["message"]


def test_oom_killed_pods_are_stalled_oom_killed() -> None:
    fake = FakeKube()
    fake.pods = [_oom_pod("tiny-aggregated-1", role="aggregated")]
    result, conds = run(fake)
    assert result.outcome == Reason.OOM_KILLED and _stalled(conds) == ("True", Reason.OOM_KILLED)
    expected = (
        "pod tiny-aggregated-1 (pool aggregated, container runtime) was OOMKilled "
        "at its memory limit of 96Mi (exit code 137)"
    )
    for type_ in (ConditionType.STALLED, ConditionType.READY):  # Ready says why, too
        assert (conds[type_]["reason"], conds[type_]["message"]) == (Reason.OOM_KILLED, expected)
    assert conds[ConditionType.READY]["status"] == "False"


@pytest.mark.parametrize(
    ("restarts", "state", "last"),
    [  # what the kubelet reports as an OOM-killed container is restarted and killed again
        (1, {"running": {"startedAt": "2026-12-03T12:00:05Z"}}, OOM_TERMINATED),
        (1, {"terminated": OOM_TERMINATED}, OOM_TERMINATED),
        (2, {"terminated": OOM_TERMINATED}, {"exitCode": 1, "reason": "Error"}),
        (3, {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}}, OOM_TERMINATED),
    ],
)
def test_oom_kills_are_recognised_in_every_state_of_the_crash_loop(
    restarts: int, state: dict[str, Any], last: dict[str, Any]
) -> None:
    failure = failures.pod_start_failure(_oom_pod("p", role="decode", restarts=restarts, state=state, last=last))
    assert isinstance(failure, failures.PodStartFailure) and failure.reason == Reason.OOM_KILLED
    assert (
        failure.describe()
        == "pod p (pool decode, container runtime) was OOMKilled at its memory limit of 96Mi (exit code 137)"
    )


def test_oom_kill_beats_the_text_of_its_log_tail_and_says_when_there_is_no_limit() -> None:
    # FallbackToLogsOnError: an OOM-killed runtime's message is its log tail, which may mention
    # a model; the kubelet's OOMKilled is what happened
    tail = "INFO fetching model 'hf://splitserve/tiny-llama'\nINFO importing torch"
    last = {**OOM_TERMINATED, "message": tail}
    failure = failures.pod_start_failure(_oom_pod("p", role="prefill", memory=None, last=last))
    assert failure is not None and failure.reason == Reason.OOM_KILLED
    assert failure.describe() == (
        f"pod p (pool prefill, container runtime) was OOMKilled with no memory limit of its own (exit code 137): {tail}"
    )
    # in a pool, a pod whose model cannot be loaded still says the most
    load_error = {"exitCode": 1, "reason": "Error", "message": "ModelLoadError: no such model"}
    pods = [_oom_pod("a", role="prefill", last=last), _oom_pod("b", role="prefill", last=load_error)]
    found = failures.pod_failures(roles=[Role.PREFILL], pods=pods)
    assert [(f.pod, f.reason) for f in found] == [("b", Reason.MODEL_UNAVAILABLE)]


def test_still_starting_pods_are_not_failures() -> None:
    for reason in ("ContainerCreating", "PodInitializing"):
        assert failures.pod_failure(_waiting_pod("p", role="prefill", reason=reason)) is None
    fake = FakeKube()
    fake.pods = [_waiting_pod("tiny-aggregated-1", role="aggregated", reason="ContainerCreating")]
    fake.deployment_conditions["tiny-engine"] = [STILL_PROGRESSING]
    result, conds = run(fake)
    assert result.outcome == Reason.PROGRESSING and _stalled(conds) == ("False", Reason.PROGRESSING)


def test_a_serving_pool_hides_one_bad_pod_until_its_deadline() -> None:
    fake = FakeKube()
    fake.ready_replicas = 1
    fake.pods = [_waiting_pod("tiny-aggregated-2", role="aggregated", reason="ImagePullBackOff")]
    assert run(fake)[0].ready  # the rollout's business while the pool serves
    fake.deployment_conditions["tiny-engine"] = [DEADLINE]
    fake.ready_replicas = 0
    result, conds = run(fake)
    assert _stalled(conds)[0] == "True"


def test_precedence_of_the_evidence() -> None:
    deployments = {
        Role.PREFILL: {"metadata": {"name": "tiny-prefill"}, "status": {"conditions": [DEADLINE]}},
        Role.DECODE: {"metadata": {"name": "tiny-decode"}, "status": {"conditions": [REPLICA_FAILURE]}},
    }
    assert [f.deployment for f in failures.replica_failures(deployments)] == ["tiny-decode"]
    assert [f.deployment for f in failures.stuck_rollouts(deployments)] == ["tiny-prefill"]
    # pods of one pool: a model failure says most, then any start failure, then a waiting one
    pods = [_waiting_pod("a", role="decode", reason="ErrImagePull"), _oom_pod("b", role="decode")]
    assert [f.pod for f in failures.pod_failures(roles=[Role.DECODE], pods=pods)] == ["b"]
    # an unusable reason is replaced, the child's own words kept in the message
    weird = failures.PodWaitingFailure(pod="p", role="decode", container="c", waiting_reason="no good!", message="m")
    assert weird.reason == Reason.CHILD_FAILED and "no good!" in weird.describe()


def test_replica_failure_is_reported_before_pod_and_capacity_problems() -> None:
    fake = FakeKube()
    fake.deployment_conditions["tiny-engine"] = [REPLICA_FAILURE, DEADLINE]
    fake.pods = [_waiting_pod("tiny-aggregated-1", role="aggregated", reason="ImagePullBackOff")]
    result, _ = run(fake)
    assert result.outcome == Reason.FAILED_CREATE


def test_pod_events_for_image_pull_and_config_failures_trigger_a_reconcile() -> None:
    for reason in ("ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError"):
        assert handlers.pod_needs_reconcile(_waiting_pod("p", role="prefill", reason=reason))
    assert handlers.pod_needs_reconcile(_oom_pod("p", role="prefill"))
    assert not handlers.pod_needs_reconcile(_waiting_pod("p", role="prefill", reason="ContainerCreating"))


def test_a_failed_engine_does_not_read_as_the_router_timing_out() -> None:
    """The router is Ready only with a healthy decode or aggregated pod, so its own progress
    deadline passes when the engine fails: the status names the engine, not the router."""
    fake = FakeKube()
    fake.deployment_conditions["tiny-engine"] = [DEADLINE]
    fake.deployment_conditions["tiny-router"] = [DEADLINE]
    result, conds = run(fake)
    message = conds[ConditionType.STALLED]["message"]
    assert _stalled(conds)[0] == "True" and "tiny-engine" in message and "tiny-router" not in message, message
