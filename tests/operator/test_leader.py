"""Lease election rounds (client-go semantics) against an in-memory Lease store that keeps
resourceVersion preconditions like the API server does. The real thing (two operator pods,
SIGKILL of the leader) is e2e/test_operator_lifecycle.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from splitserve_operator import leader


class _LeaseStore:
    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.version = 0

    def get(self, **_: Any) -> dict[str, Any] | None:
        return copy.deepcopy(self.obj)

    def create(self, *, obj: dict[str, Any], **_: Any) -> dict[str, Any]:
        if self.obj is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        self.version += 1
        self.obj = {**copy.deepcopy(obj), "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        return copy.deepcopy(self.obj)

    def replace(self, *, obj: dict[str, Any], **_: Any) -> dict[str, Any]:
        assert self.obj is not None
        if obj["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        self.version += 1
        self.obj = {**copy.deepcopy(obj), "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        return copy.deepcopy(self.obj)


def _elector(store: _LeaseStore, identity: str) -> leader.LeaderElector:
    config = leader.LeaderConfig(name="l", namespace="n", identity=identity)
    return leader.LeaderElector(api=store, config=config)  # type: ignore[arg-type]


def test_first_candidate_creates_and_second_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(leader.time, "monotonic", lambda: clock[0])
    store = _LeaseStore()
    a, b = _elector(store, "a"), _elector(store, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # held and fresh
    clock[0] += 10
    assert a.try_acquire_or_renew()  # renew: the record changes, b restarts its expiry clock
    clock[0] += 5
    assert not b.try_acquire_or_renew()  # b first sees a's renewal now (t=1015): expires at 1030
    clock[0] += 14.9
    assert not b.try_acquire_or_renew()
    clock[0] += 0.2  # a stopped renewing: lease_duration after b last saw a change, it is b's
    assert b.try_acquire_or_renew()
    assert store.obj is not None
    assert store.obj["spec"]["holderIdentity"] == "b" and store.obj["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()  # a comes back: b's now


def test_released_lease_is_taken_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leader.time, "monotonic", lambda: 50.0)
    store = _LeaseStore()
    a, b = _elector(store, "a"), _elector(store, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.release_sync()
    assert b.try_acquire_or_renew()


def test_losing_a_race_is_not_leading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leader.time, "monotonic", lambda: 0.0)
    store = _LeaseStore()
    a = _elector(store, "a")
    original_replace = store.replace

    def racing_replace(**kwargs: Any) -> dict[str, Any]:
        store.version += 1  # somebody wrote in between our GET and PUT
        assert store.obj is not None
        store.obj["metadata"]["resourceVersion"] = str(store.version)
        return original_replace(**kwargs)

    assert a.try_acquire_or_renew()
    store.replace = racing_replace  # type: ignore[method-assign]
    assert not a.try_acquire_or_renew()


def test_config_requires_client_go_ordering() -> None:
    with pytest.raises(ValueError):
        leader.LeaderConfig(name="l", namespace="n", identity="x", lease_duration_seconds=10,
                            renew_deadline_seconds=10, retry_period_seconds=2)
    assert leader.make_identity(pod_name="op-1").startswith("op-1_")
