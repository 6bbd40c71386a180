"""Pods that keep failing at start-up become ModelUnavailable / PodStartFailed conditions.

Detection (:func:`reconcile.pod_start_failure`) is tested on pod dicts; the conditions and
Events through a whole :func:`reconcile.reconcile` against an in-memory API (a fake of
:class:`kube.KubeAPI`, no ``type: ignore`` needed)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_operator import events, handlers, kube, reconcile

LOAD_ERROR = ("ModelLoadError: model 'hf://nobody/not-in-cache' is not in the local cache /cache "
              "(looked for /cache/nobody/not-in-cache and /cache/models--nobody--not-in-cache; "
              "nothing is downloaded: pre-fill the cache or set SPLITSERVE_MODEL_CACHE)")
SETTINGS = reconcile.ReconcileSettings(runtime_image="splitserve:test")


def _pod(name: str, *, role: str = "aggregated", restarts: int = 1, exit_code: int = 1, message: str = "",
         waiting: str = "CrashLoopBackOff", ready: bool = False) -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Error"}
    if message:
        terminated["message"] = message
    return {
        "metadata": {"name": name, "labels": {contract.LABEL_ROLE: role, contract.LABEL_INSTANCE: "tiny"}},
        "status": {"phase": "Running", "containerStatuses": [{
            "name": "runtime", "ready": ready, "restartCount": restarts,
            "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}},
            "lastState": {"terminated": terminated} if restarts else {}}]},
    }


def test_model_load_failure_is_detected_from_the_log_tail() -> None:
    tail = "INFO starting\nTraceback (most recent call last):\n  File x\n" + \
        f"splitserve_contract.model_config.{LOAD_ERROR}\nINFO Shutting down\n"
    failure = reconcile.pod_start_failure(_pod("p1", message=tail))
    assert failure is not None and failure.model_unavailable and failure.reason == Reason.MODEL_UNAVAILABLE
    assert "is not in the local cache" in failure.message and "Shutting down" not in failure.message
    assert failure.role == "aggregated" and failure.exit_code == 1 and failure.container == "runtime"


def test_other_failures_and_non_failures() -> None:
    other = reconcile.pod_start_failure(_pod("p", message="x" * 5000 + "CUDA error: out of memory"))
    assert other is not None and other.reason == Reason.POD_START_FAILED
    assert other.message.endswith("out of memory") and len(other.message) <= reconcile.MAX_POD_MESSAGE_CHARS
    no_message = reconcile.pod_start_failure(_pod("p", exit_code=137))
    assert no_message is not None and no_message.describe() == "pod p (container runtime) exited with code 137"
    # restarted after a failure but now waiting for something else: still failing at start-up
    assert reconcile.pod_start_failure(_pod("p", waiting="")) is not None
    # crash loop reported before the kubelet wrote lastState
    assert reconcile.pod_start_failure(_pod("p", restarts=0)) is not None
    assert reconcile.pod_start_failure(_pod("p", restarts=0, waiting="ContainerCreating")) is None
    assert reconcile.pod_start_failure(_pod("p", exit_code=0, waiting="")) is None  # completed, restarted
    assert reconcile.pod_start_failure(_pod("p", ready=True, message=LOAD_ERROR)) is None
    gone = _pod("p", message=LOAD_ERROR)
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert reconcile.pod_start_failure(gone) is None
    assert reconcile.pod_start_failure({"metadata": {"name": "x"}, "status": {"phase": "Pending"}}) is None


def test_pod_events_that_trigger_a_reconcile() -> None:
    assert handlers.pod_needs_reconcile(_pod("p", message=LOAD_ERROR))
    assert handlers.pod_needs_reconcile({"status": {"conditions": [{"type": "PodScheduled", "status": "False"}]}})
    assert not handlers.pod_needs_reconcile(_pod("p", restarts=0, waiting="ContainerCreating"))


def test_only_pools_without_a_ready_replica_are_reported() -> None:
    def pool(role: contract.Role, ready: int) -> reconcile.PoolObservation:
        return reconcile.PoolObservation(role=role, replicas=2, ready=ready, desired=2, pending=0, rolled_out=False)

    pools = {contract.Role.PREFILL: pool(contract.Role.PREFILL, 1), contract.Role.DECODE: pool(contract.Role.DECODE, 0)}
    pods = [_pod("pre-1", role="prefill", message=LOAD_ERROR), _pod("dec-1", role="decode", message="segfault"),
            _pod("dec-2", role="decode", message=LOAD_ERROR)]
    failures = reconcile.start_failures(pools=pools, pods=pods)
    assert [f.pod for f in failures] == ["dec-2"]  # the model failure says the most


# ---------------------------------------------------------------------------- whole reconciles


class FakeKube:
    """An in-memory API server for one namespace: enough of :class:`kube.KubeAPI`."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.ready_replicas = 0

    def get(self, *, kind: kube.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind.kind, name))
        return copy.deepcopy(found) if found is not None else None

    def list(self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        return copy.deepcopy(self.pods) if kind is kube.POD else []

    def apply(self, *, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]:
        key = (str(obj["kind"]), str(obj["metadata"]["name"]))
        live = self.objects.setdefault(key, {"metadata": {"generation": 1, "resourceVersion": "1"}})
        for field, value in obj.items():
            if isinstance(value, dict) and isinstance(live.get(field), dict):
                live[field] = {**live[field], **copy.deepcopy(value)}
            else:
                live[field] = copy.deepcopy(value)
        if obj["kind"] == "Deployment":
            replicas = int(live["spec"].get("replicas", 1))
            live["status"] = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                              "availableReplicas": self.ready_replicas, "readyReplicas": self.ready_replicas}
        return copy.deepcopy(live)

    def merge_patch(self, *, kind: kube.Kind, namespace: str | None, name: str, patch: Mapping[str, Any],
                    subresource: str | None = None, field_manager: str | None = None) -> dict[str, Any]:
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


def _isvc_obj() -> dict[str, Any]:
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
        "metadata": {"name": "tiny", "namespace": "n", "uid": "uid-1", "generation": 1, "resourceVersion": "1"},
        "spec": {"model": {"uri": "hf://nobody/not-in-cache"}, "mode": "Aggregated",
                 "aggregated": {"replicas": {"min": 1, "max": 1}, "resources": {"gpus": 0}}},
    }


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []

    def post(*, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        out.append((type, reason))

    monkeypatch.setattr(events, "post", post)
    return out


def _run(fake: FakeKube) -> tuple[reconcile.Result, dict[str, dict[str, Any]]]:
    fake.objects.setdefault((contract.KIND, "tiny"), _isvc_obj())
    obj = fake.get(kind=kube.INFERENCE_SERVICE, namespace="n", name="tiny")
    assert obj is not None
    result = reconcile.reconcile(api=fake, obj=obj, settings=SETTINGS, nodes=reconcile.NodeCache())
    conditions = fake.objects[(contract.KIND, "tiny")]["status"]["conditions"]
    return result, {c["type"]: c for c in conditions}


def test_model_unavailable_condition_and_one_event(posted: list[tuple[str, str]]) -> None:
    fake = FakeKube()
    result, conds = _run(fake)
    assert result.outcome == Reason.PROGRESSING and conds[ConditionType.STALLED]["status"] == "False"
    fake.pods = [_pod("tiny-aggregated-1", message=f"INFO x\n{LOAD_ERROR}\nINFO Shutting down\n")]
    posted.clear()
    result, conds = _run(fake)
    assert result.outcome == Reason.MODEL_UNAVAILABLE
    ready, stalled = conds[ConditionType.READY], conds[ConditionType.STALLED]
    assert (ready["status"], ready["reason"]) == ("False", Reason.MODEL_UNAVAILABLE)
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.MODEL_UNAVAILABLE)
    assert "not in the local cache" in ready["message"] and "tiny-aggregated-1" in ready["message"]
    assert conds[ConditionType.RECONCILING]["status"] == "True"
    assert posted == [("Warning", Reason.MODEL_UNAVAILABLE)]
    posted.clear()
    _run(fake)  # no transition: no second Event
    assert posted == []


def test_other_start_failure_and_recovery(posted: list[tuple[str, str]]) -> None:
    fake = FakeKube()
    fake.pods = [_pod("tiny-aggregated-1", message="RuntimeError: CUDA driver too old")]
    result, conds = _run(fake)
    assert result.outcome == Reason.POD_START_FAILED
    assert conds[ConditionType.STALLED]["reason"] == Reason.POD_START_FAILED
    assert "CUDA driver too old" in conds[ConditionType.READY]["message"]
    # one replica became ready: crashing siblings no longer flip Ready to False
    fake.ready_replicas = 1  # (every apply refreshes the fake Deployments' status)
    result, conds = _run(fake)
    assert result.ready and conds[ConditionType.READY]["reason"] == Reason.RECONCILED
    assert ("Normal", Reason.READY) in posted
