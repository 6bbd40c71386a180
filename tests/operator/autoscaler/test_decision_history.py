"""``status.<pool>.recentDecisions``: the last distinct autoscaler decisions of a pool, newest
first, written with ``lastDecision`` in the round's one status patch; a repeated decision is
kept once (with the time it was first made) and writes no list at all; the API model and the
CRD bound the list."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import crdgen
import pytest
import yaml
from pydantic import ValidationError

from splitserve_contract import Reason
from splitserve_operator import api
from splitserve_operator.api.status import MAX_RECENT_DECISIONS, PoolStatus
from splitserve_operator.autoscaler import history
from splitserve_operator.autoscaler.decision import (
    Decision,
    MetricsUnavailable,
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    decide,
)
from splitserve_operator.autoscaler.loop import _record
from splitserve_operator.autoscaler.memory import AutoscalerState

REPO = Path(__file__).resolve().parents[3]
T0 = 1_800_000_000.0


def _decision(
    *,
    current: int,
    min_replicas: int = 1,
    max_replicas: int = 4,
    now: float = T0,
    signals: Mapping[str, SignalValue] | MetricsUnavailable | None = None,
    pool: str = "decode",
) -> Decision:
    """A real decision from :func:`decide` (queue depth 3 per replica against a target of 2
    unless ``signals`` says otherwise)."""
    return decide(
        pool=pool,
        now_seconds=now,
        current_replicas=current,
        ready_replicas=current,
        pending_replicas=0,
        signals=signals if signals is not None else {"queueDepth": SignalValue(value=3.0, target=2.0)},
        policy=PoolPolicy(min_replicas=min_replicas, max_replicas=max_replicas),
        history=RecommendationHistory.fresh(now_seconds=now - 600, current_replicas=current),
        gpus_per_replica=1,
    )


def _isvc(status: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "splitserve.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"namespace": "ns", "name": "svc", "uid": "u"},
        "status": dict(status or {}),
    }


def _round(
    isvc: Mapping[str, Any], decisions: Sequence[Decision], *, written: set[str], now: float = T0
) -> dict[str, Any]:
    return _record(isvc=isvc, decisions=list(decisions), written=written, state=AutoscalerState(), now_seconds=now)


def _apply(isvc: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The status after a JSON merge patch of ``fields`` (what the API server does)."""
    status = isvc["status"]
    for key, value in fields.items():
        if isinstance(value, dict):
            status[key] = {**(status.get(key) or {}), **value}
        else:
            status[key] = value
    return isvc


def test_a_written_scale_up_is_recorded_with_its_formula() -> None:
    decision = _decision(current=1)
    assert (decision.result, decision.reason) == (2, Reason.SCALED_UP)
    fields = _round(_isvc(), [decision], written={"decode"})
    [entry] = fields["decode"]["recentDecisions"]
    assert entry == {
        "time": "2027-01-15T08:00:00Z",
        "from": 1,
        "to": 2,
        "reason": "ScaledUp",
        "applied": True,
        "formula": decision.formula,
    }
    # the same patch carries lastDecision and the cluster-wide scalingHistory
    assert fields["decode"]["lastDecision"]["reason"] == "ScaledUp"
    assert fields["scalingHistory"][-1]["to"] == 2


def test_a_repeated_decision_is_kept_once_and_writes_no_list() -> None:
    isvc = _isvc()
    held = MetricsUnavailable(reason=Reason.NO_DATA, message="no series for pool decode")
    first = _round(isvc, [_decision(current=2, signals=held)], written=set())
    _apply(isvc, first)
    [entry] = isvc["status"]["decode"]["recentDecisions"]
    assert (entry["reason"], entry["from"], entry["to"], entry["applied"]) == ("MetricsUnavailable", 2, 2, False)
    again = _round(isvc, [_decision(current=2, signals=held, now=T0 + 15)], written=set(), now=T0 + 15)
    assert "recentDecisions" not in again["decode"]  # nothing new: the list is not rewritten
    # lastDecision keeps the time the decision was first made: the patch changes nothing
    assert again["decode"]["lastDecision"]["time"] == "2027-01-15T08:00:00Z"
    assert isvc["status"]["decode"]["recentDecisions"][0]["time"] == "2027-01-15T08:00:00Z"  # first seen


def test_newest_first_and_bounded() -> None:
    isvc = _isvc()
    reasons: list[str] = []
    for step in range(MAX_RECENT_DECISIONS + 3):
        now = T0 + 15 * step
        # alternate between a hold (no metrics) and a scale-up so every round differs
        if step % 2:
            decision = _decision(current=1 + step, max_replicas=20, now=now)
        else:
            decision = _decision(
                current=1 + step,
                max_replicas=20,
                now=now,
                signals=MetricsUnavailable(reason=Reason.STALE, message="old samples"),
            )
        reasons.append(decision.reason)
        _apply(isvc, _round(isvc, [decision], written={"decode"} if step % 2 else set(), now=now))
    recent = isvc["status"]["decode"]["recentDecisions"]
    assert len(recent) == MAX_RECENT_DECISIONS
    assert [e["reason"] for e in recent] == list(reversed(reasons))[:MAX_RECENT_DECISIONS]
    assert [e["from"] for e in recent] == list(range(MAX_RECENT_DECISIONS + 3, 3, -1))
    assert recent == sorted(recent, key=lambda e: e["time"], reverse=True)


def _entry(step: int, *, reason: str, frm: int, to: int, applied: bool) -> dict[str, Any]:
    return {
        "time": f"2027-01-15T08:{step:02d}:00Z",
        "from": frm,
        "to": to,
        "reason": reason,
        "applied": applied,
        "formula": f"f{step}",
    }


def test_the_newest_applied_change_stays_while_a_pool_flaps_at_its_maximum() -> None:
    """A pool scaled 1 -> 2 and then alternates between two decisions that change nothing:
    the scale-up (with its formula) is still in the list, as its last item."""
    recent: list[dict[str, Any]] = [_entry(0, reason="ScaledUp", frm=1, to=2, applied=True)]
    for step in range(1, 4 * MAX_RECENT_DECISIONS):
        reason = "SloViolated" if step % 2 else "AtMaxReplicas"
        updated = history.with_decision(recent, _entry(step, reason=reason, frm=2, to=2, applied=False))
        assert updated is not None
        recent = updated
        assert len(recent) == min(step + 1, MAX_RECENT_DECISIONS)
        assert recent[-1]["reason"] == "ScaledUp" and recent[-1]["formula"] == "f0"
        assert recent[0]["formula"] == f"f{step}"
        assert recent == sorted(recent, key=lambda e: e["time"], reverse=True)  # still newest first
    # a newer change takes the pin's place; the old one falls off as usual
    for step in range(4 * MAX_RECENT_DECISIONS, 5 * MAX_RECENT_DECISIONS + 1):
        entry = (
            _entry(step, reason="ScaledDown", frm=2, to=1, applied=True)
            if step == 4 * MAX_RECENT_DECISIONS
            else _entry(step, reason="SloViolated" if step % 2 else "Steady", frm=1, to=1, applied=False)
        )
        updated = history.with_decision(recent, entry)
        assert updated is not None
        recent = updated
    assert [e["reason"] for e in recent].count("ScaledUp") == 0
    assert recent[-1]["reason"] == "ScaledDown"


def test_a_dry_run_or_unchanged_count_is_not_pinned() -> None:
    recent = [_entry(0, reason="ScaledUp", frm=1, to=2, applied=False)]  # a dry run: not applied
    for step in range(1, MAX_RECENT_DECISIONS + 1):
        updated = history.with_decision(recent, _entry(step, reason=f"R{step % 2}", frm=2, to=2, applied=step % 2 == 0))
        assert updated is not None
        recent = updated
    assert [e["formula"] for e in recent] == [f"f{i}" for i in range(MAX_RECENT_DECISIONS, 0, -1)]


def test_each_pool_keeps_its_own_list() -> None:
    isvc = _isvc(
        {
            "prefill": {
                "recentDecisions": [
                    {
                        "time": "2027-01-15T07:00:00Z",
                        "from": 1,
                        "to": 1,
                        "reason": "Steady",
                        "applied": False,
                        "formula": "x",
                    }
                ]
            }
        }
    )
    fields = _round(
        isvc, [_decision(current=1, pool="prefill"), _decision(current=3, max_replicas=3)], written={"prefill"}
    )
    assert [e["reason"] for e in fields["prefill"]["recentDecisions"]] == ["ScaledUp", "Steady"]
    assert [e["reason"] for e in fields["decode"]["recentDecisions"]] == ["AtMaxReplicas"]


def test_same_numbers_different_outcome_is_a_new_entry() -> None:
    """A dry run (not applied) and the write of the same change are two decisions."""
    isvc = _isvc()
    _apply(isvc, _round(isvc, [_decision(current=1)], written=set()))
    fields = _round(isvc, [_decision(current=1)], written={"decode"})
    assert [e["applied"] for e in fields["decode"]["recentDecisions"]] == [True, False]


def test_long_formulas_are_cut() -> None:
    entry = history.decision_entry(_decision(current=1), timestamp="t", applied=False, max_formula_length=10)
    assert len(entry["formula"]) == 10


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        history.with_decision([], {"reason": "x"}, limit=0)


def test_model_round_trip_and_bound() -> None:
    item = {
        "time": "2027-01-15T08:00:00Z",
        "from": 1,
        "to": 2,
        "reason": "ScaledUp",
        "applied": True,
        "formula": "ceil(1 * 1.5) = 2",
    }
    pool = PoolStatus.model_validate({"recentDecisions": [item] * MAX_RECENT_DECISIONS})
    assert pool.dump()["recentDecisions"][0] == item
    with pytest.raises(ValidationError):
        PoolStatus.model_validate({"recentDecisions": [item] * (MAX_RECENT_DECISIONS + 1)})
    # the whole status validates with it (what the operator reads back)
    api.InferenceServiceStatus.model_validate({"decode": {"recentDecisions": [item]}})


def test_crd_schema_has_the_bounded_list_on_every_pool() -> None:
    crd = yaml.safe_load((REPO / crdgen.OUTPUT_PATHS[0]).read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for pool in ("prefill", "decode", "aggregated", "router"):
        recent = status[pool]["properties"]["recentDecisions"]
        assert recent["maxItems"] == MAX_RECENT_DECISIONS, pool
        assert set(recent["items"]["required"]) >= {"time", "from", "to", "reason"}, pool
        assert set(recent["items"]["properties"]) == {"time", "from", "to", "reason", "applied", "formula"}, pool
