"""What an autoscaling round writes, and when it writes nothing, in memory.

Defects pinned here:

* with ``spec.autoscaling.enabled: false`` nothing enforced ``replicas.min``/``max``: a min
  raised from 1 to 3 left the pool at 1 replica (and ``Ready=True``), although the CRD says a
  pool runs at least ``min``;
* an idle service was rewritten every interval, only ``lastDecision.time`` moving (100 idle
  services: 400 status patches a minute, every resourceVersion changing, every GitOps watcher
  woken);
* a round that failed (the API server refusing its status patch) logged a traceback every
  interval and left ``ScalingActive=True`` standing.

The rounds run :func:`run_once` and the :class:`AutoscalerLoop` against the in-memory API
server and fake Prometheus of :mod:`test_slo_loop` (target tracking: no ``slo``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, cast

import pytest
from kube_testing import api_error, record_events
from prometheus_client import CollectorRegistry
from test_slo_loop import (
    NAME,
    NOW,
    NS,
    FakePrometheus,
    SelectingKube,
    cluster,
    isvc,
    replicas,
    round_,
)

import splitserve_contract as contract
from splitserve_contract import Metric, Reason
from splitserve_operator import kube, naming
from splitserve_operator.autoscaler.loop import AutoscalerLoop
from splitserve_operator.autoscaler.memory import AutoscalerState
from splitserve_operator.autoscaler.metrics import AutoscalerMetrics

LOOP_LOGGER = "splitserve_operator.autoscaler.loop"


@pytest.fixture(autouse=True)
def _events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    events: list[tuple[str, str, str]] = record_events(monkeypatch)
    return events


def _service(*, enabled: bool = True, min_replicas: int = 1, max_replicas: int = 8) -> dict[str, Any]:
    obj: dict[str, Any] = isvc(slo=False)
    obj["spec"]["autoscaling"]["enabled"] = enabled
    for role in ("prefill", "decode"):
        obj["spec"][role]["replicas"] = {"min": min_replicas, "max": max_replicas}
    return obj


def _set_spec(api: SelectingKube, obj: dict[str, Any]) -> None:
    """A spec change (a new generation), the status kept."""
    live = api.objects[(contract.KIND, NAME)]
    live["spec"] = copy.deepcopy(obj["spec"])
    live["metadata"]["generation"] = int(live["metadata"]["generation"]) + 1


def _idle_prometheus() -> FakePrometheus:
    """One Ready pod per pool, nothing waiting or running: target tracking holds at min."""
    prom = FakePrometheus()
    for role in ("prefill", "decode"):
        name = f"{NAME}-{role}-0"
        prom.roles[name] = role
        prom.pods[name] = {
            Metric.REQUESTS_WAITING: 0.0,
            Metric.REQUESTS_RUNNING: 0.0,
            Metric.PROMPT_TOKENS_WAITING: 0.0,
            Metric.KV_CACHE_USAGE_RATIO: 0.0,
            Metric.KV_CACHE_BLOCKS: 4096,
        }
    return prom


def _status(api: SelectingKube) -> dict[str, Any]:
    return cast(dict[str, Any], api.objects[(contract.KIND, NAME)]["status"])


def _condition(api: SelectingKube, type_: str) -> dict[str, Any]:
    return next(c for c in _status(api)["conditions"] if c["type"] == type_)


def _status_writes(api: SelectingKube) -> int:
    writes: list[tuple[str, str]] = api.fake.writes
    return writes.count((f"{contract.KIND}/{NAME}", "patch status"))


# --------------------------------------------------------------------------- autoscaling off
def test_autoscaling_off_brings_replicas_into_min_and_max(_events: list[tuple[str, str, str]]) -> None:
    api = cluster(_service(enabled=False))
    round_(api, _idle_prometheus(), store=None)
    assert replicas(api, "prefill") == replicas(api, "decode") == 1  # within [1, 8]: untouched

    _set_spec(api, _service(enabled=False, min_replicas=3))  # min 1 → 3
    round_(api, _idle_prometheus(), store=None, now=NOW + 15)
    assert replicas(api, "prefill") == replicas(api, "decode") == 3
    deployment = api.objects[("Deployment", naming.child_name(NAME, "decode"))]
    assert deployment["kind"] == "Deployment" and deployment["spec"]["replicas"] == 3
    status = _status(api)
    assert status["decode"]["desiredReplicas"] == 3
    assert [(e["pool"], e["from"], e["to"], e["reason"]) for e in status["scalingHistory"]] == [
        ("prefill", 1, 3, Reason.AT_MIN_REPLICAS),
        ("decode", 1, 3, Reason.AT_MIN_REPLICAS),
    ]
    active = _condition(api, "ScalingActive")
    assert (active["status"], active["reason"]) == ("False", Reason.SCALING_DISABLED)
    assert [(t, r) for t, r, _ in _events].count(("Normal", Reason.SCALED_UP)) == 2

    _set_spec(api, _service(enabled=False, min_replicas=1, max_replicas=2))  # max 8 → 2
    round_(api, _idle_prometheus(), store=None, now=NOW + 30)
    assert replicas(api, "prefill") == replicas(api, "decode") == 2
    assert status != _status(api) and _status(api)["scalingHistory"][-1]["reason"] == Reason.AT_MAX_REPLICAS


def test_autoscaling_off_leaves_a_count_within_the_bounds_alone() -> None:
    api = cluster(_service(enabled=False, min_replicas=1, max_replicas=4), decode=3)  # kubectl scale'd to 3
    round_(api, _idle_prometheus(), store=None)
    assert replicas(api, "decode") == 3
    assert not [w for w in api.writes if w[0].startswith("Deployment/")]
    assert "scalingHistory" not in _status(api)


def test_autoscaling_on_brings_a_held_count_into_a_raised_min() -> None:
    """No Ready pod (nothing measured): the count is held, but within the new bounds."""
    api = cluster(_service(min_replicas=3))
    api.fake.pods = [dict(p, status={"phase": "Pending"}) for p in api.fake.pods]
    decisions = round_(api, _idle_prometheus(), store=None)
    assert {d.pool: (d.result, d.reason) for d in decisions.values()} == {
        "prefill": (3, Reason.NO_READY_REPLICAS),
        "decode": (3, Reason.NO_READY_REPLICAS),
    }
    assert replicas(api, "prefill") == replicas(api, "decode") == 3


# --------------------------------------------------------------------------- idle rounds
def test_an_idle_round_that_decides_what_the_last_one_did_writes_nothing() -> None:
    api, prom, state = cluster(_service()), _idle_prometheus(), AutoscalerState()
    round_(api, prom, store=None, state=state)
    first = copy.deepcopy(_status(api))
    writes = _status_writes(api)
    assert writes == 1 and first["decode"]["lastDecision"]["result"] == 1
    for i in range(1, 4):  # three more intervals, nothing changes but the clock
        round_(api, prom, store=None, state=state, now=NOW + 15 * i)
    assert _status_writes(api) == writes
    assert _status(api) == first

    # a decision that changes (the decode pool gets busy) is written, with its own time
    prom.pods[f"{NAME}-decode-0"][Metric.REQUESTS_WAITING] = 20.0
    round_(api, prom, store=None, state=state, now=NOW + 60)
    assert _status_writes(api) == writes + 1
    decode = _status(api)["decode"]["lastDecision"]
    assert decode["reason"] == Reason.SCALED_UP and decode["time"] != first["decode"]["lastDecision"]["time"]
    # the prefill pool's unchanged decision keeps the time it was first made
    assert _status(api)["prefill"]["lastDecision"] == first["prefill"]["lastDecision"]


# --------------------------------------------------------------------------- failing rounds
class FailingKube(SelectingKube):  # type: ignore[misc]  # a test module's class: Any to mypy
    """Reads of the pools' Deployments fail while ``failure`` is set (the InferenceService's
    status stays writable, as when the API server refuses one request)."""

    def __init__(self, base: SelectingKube) -> None:
        super().__init__()
        self.fake = base.fake
        self.failure: Exception | None = None

    def get(self, *, kind: kube.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        if self.failure is not None and kind is kube.DEPLOYMENT:
            raise self.failure
        found: dict[str, Any] | None = super().get(kind=kind, namespace=namespace, name=name)
        return found


class Clock:
    def __init__(self) -> None:
        self.seconds = 1000.0

    def __call__(self) -> float:
        return self.seconds


async def _loop_rounds(loop: AutoscalerLoop, clock: Clock, *, rounds: int) -> None:
    for _ in range(rounds):
        clock.seconds += 15.0
        (key,) = loop.tick()
        await loop.rounds[key]


@pytest.mark.parametrize(
    ("failure", "reason", "fragment"),
    [
        (api_error(500, "InternalError", "etcd is having a bad day"), Reason.API_ERROR, "etcd is having a bad day"),
        (RuntimeError("a bug"), Reason.ROUND_FAILED, "RuntimeError: a bug"),
    ],
    ids=["api-error", "other"],
)
def test_a_failing_round_says_so_in_status_and_logs_once(
    caplog: pytest.LogCaptureFixture, failure: Exception, reason: str, fragment: str
) -> None:
    api = FailingKube(cluster(_service()))
    clock = Clock()
    loop = AutoscalerLoop(
        api=cast(kube.Kube, api),
        prometheus=cast(Any, _idle_prometheus()),
        state=AutoscalerState(),
        metrics=AutoscalerMetrics.create(registry=CollectorRegistry()),
        clock=clock,
        wall_clock=lambda: NOW + clock.seconds,
    )

    def observe() -> None:
        loop.observe(event_type="MODIFIED", body=api.objects[(contract.KIND, NAME)])

    async def scenario() -> None:
        observe()
        await _loop_rounds(loop, clock, rounds=1)
        assert _condition(api, "ScalingActive")["status"] == "True"
        api.failure = failure
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=LOOP_LOGGER):
            for _ in range(3):
                observe()
                await _loop_rounds(loop, clock, rounds=1)
        active = _condition(api, "ScalingActive")
        assert (active["status"], active["reason"]) == ("False", reason), active
        assert fragment in active["message"]
        above_debug = [r for r in caplog.records if r.name == LOOP_LOGGER and r.levelno > logging.DEBUG]
        assert len(above_debug) == 1, [r.getMessage() for r in above_debug]
        assert fragment in above_debug[0].getMessage() and above_debug[0].exc_info is None
        api.failure = None  # the API server is back: the next round is active again
        observe()
        await _loop_rounds(loop, clock, rounds=1)
        assert _condition(api, "ScalingActive")["status"] == "True"
        assert (NS, NAME) not in loop.state.round_failures

    asyncio.run(scenario())
