"""Lease election rounds (client-go semantics) against an in-memory Lease store that keeps
resourceVersion preconditions like the API server does. The real thing (two operator pods,
SIGKILL of the leader) is e2e/test_operator_lifecycle.py."""

from __future__ import annotations

import asyncio
import copy
import datetime
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


class FakeClock:
    """Monotonic seconds that move only when the test says so, plus the matching wall clock."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.now, datetime.UTC)

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _elector(store: _LeaseStore, identity: str, clock: FakeClock, **config: float) -> leader.LeaderElector:
    lease_config = leader.LeaderConfig(name="l", namespace="n", identity=identity, **config)
    return leader.LeaderElector(
        api=store,  # type: ignore[arg-type]
        config=lease_config,
        clock=clock,
        wall_clock=clock.wall,
    )


def test_first_candidate_creates_and_second_waits() -> None:
    clock = FakeClock(1000.0)
    store = _LeaseStore()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # held and fresh
    clock.advance(10)
    assert a.try_acquire_or_renew()  # renew: the record changes, b restarts its expiry clock
    clock.advance(5)
    assert not b.try_acquire_or_renew()  # b first sees a's renewal now (t=1015): expires at 1030
    clock.advance(14.9)
    assert not b.try_acquire_or_renew()
    clock.advance(0.2)  # a stopped renewing: lease_duration after b last saw a change, it is b's
    assert b.try_acquire_or_renew()
    assert store.obj is not None
    assert store.obj["spec"]["holderIdentity"] == "b" and store.obj["spec"]["leaseTransitions"] == 1
    assert store.obj["spec"]["acquireTime"] == "1970-01-01T00:17:10.100000Z"  # the injected wall clock
    assert not a.try_acquire_or_renew()  # a comes back: b's now


def test_released_lease_is_taken_at_once() -> None:
    clock = FakeClock(50.0)
    store = _LeaseStore()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.release_sync()
    assert b.try_acquire_or_renew()


def test_losing_a_race_is_not_leading() -> None:
    store = _LeaseStore()
    a = _elector(store, "a", FakeClock(0.0))
    original_replace = store.replace

    def racing_replace(**kwargs: Any) -> dict[str, Any]:
        store.version += 1  # somebody wrote in between our GET and PUT
        assert store.obj is not None
        store.obj["metadata"]["resourceVersion"] = str(store.version)
        return original_replace(**kwargs)

    assert a.try_acquire_or_renew()
    store.replace = racing_replace  # type: ignore[method-assign]
    assert not a.try_acquire_or_renew()


async def test_hold_gives_up_after_the_renew_deadline_on_its_own_clock() -> None:
    """Failed renewals count against the renew deadline as measured by the injected clock;
    each attempt moves it by a second, so the third failure (t+3 >= deadline 3) loses."""
    clock = FakeClock(0.0)
    store = _LeaseStore()
    a = _elector(store, "a", clock, lease_duration_seconds=4.0, renew_deadline_seconds=3.0, retry_period_seconds=0.001)
    assert await a.acquire(stop=asyncio.Event())
    attempts = 0

    def failing_replace(**_: Any) -> dict[str, Any]:
        nonlocal attempts
        attempts += 1
        clock.advance(1.0)
        raise ApiException(status=500, reason="unavailable")

    store.replace = failing_replace  # type: ignore[method-assign]
    with pytest.raises(leader.LeadershipLost):
        await asyncio.wait_for(a.hold(), timeout=10)
    assert attempts == 3


def test_config_requires_client_go_ordering() -> None:
    with pytest.raises(ValueError):
        leader.LeaderConfig(
            name="l",
            namespace="n",
            identity="x",
            lease_duration_seconds=10,
            renew_deadline_seconds=10,
            retry_period_seconds=2,
        )
    assert leader.make_identity(pod_name="op-1").startswith("op-1_")
