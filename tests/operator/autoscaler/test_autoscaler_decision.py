"""The scaling decision replayed over recorded metric series with injected time.

Each table row is (t seconds, signals, expected replicas after the decision). The replay
feeds the decision its own previous result as the current count, as the actuator would,
and treats every replica as ready at once unless a test says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from splitserve_contract import Reason
from splitserve_operator.autoscaler.decision import (
    Behavior,
    Decision,
    MetricsUnavailable,
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    decide,
    plan_joint,
)

DECODE_TARGETS = {"kv": 0.8, "queue": 2.0}
Row = tuple[float, dict[str, float], int]


def signals(values: dict[str, float], targets: dict[str, float] = DECODE_TARGETS) -> dict[str, SignalValue]:
    return {name: SignalValue(value=v, target=targets[name]) for name, v in values.items()}


def replay(
    rows: Sequence[Row],
    *,
    policy: PoolPolicy,
    start_replicas: int,
    history: RecommendationHistory | None = None,
) -> list[Decision]:
    history = history if history is not None else RecommendationHistory()
    current = start_replicas
    decisions = []
    for t, values, expected in rows:
        d = decide(
            pool="decode",
            now_seconds=t,
            current_replicas=current,
            ready_replicas=current,
            pending_replicas=0,
            signals=signals(values),
            policy=policy,
            history=history,
            gpus_per_replica=1,
        )
        assert d.result == expected, f"t={t}: {d.formula} ({d.reason})"
        decisions.append(d)
        current = d.result
    return decisions


def one(
    *,
    current: int,
    values: dict[str, float],
    ready: int | None = None,
    pending: int = 0,
    policy: PoolPolicy | None = None,
    history: RecommendationHistory | None = None,
    gpu_budget_remaining: int | None = None,
    gpus_per_replica: int = 1,
    dry_run: bool = False,
    pool: str = "decode",
    targets: dict[str, float] = DECODE_TARGETS,
    now: float = 0.0,
) -> Decision:
    return decide(
        pool=pool,
        now_seconds=now,
        current_replicas=current,
        ready_replicas=current if ready is None else ready,
        pending_replicas=pending,
        signals=signals(values, targets),
        policy=policy or PoolPolicy(min_replicas=1, max_replicas=16),
        history=history if history is not None else RecommendationHistory(),
        gpus_per_replica=gpus_per_replica,
        gpu_budget_remaining=gpu_budget_remaining,
        dry_run=dry_run,
    )


def test_scale_up_is_immediate_and_the_formula_shows_the_arithmetic() -> None:
    d = one(current=2, values={"kv": 0.93, "queue": 3.0})
    assert (d.result, d.reason, d.direction, d.write) == (3, Reason.SCALED_UP, "up", True)
    assert d.formula == (
        "ceil(2 ready × max(kv 0.93/0.8, queue 3.00/2)) = 3 → stabilized 3 → step-limited 3 → clamped [1,16] 3"
    )
    assert d.ratio == pytest.approx(1.5)
    assert d.inputs() == {
        "currentReplicas": 2.0,
        "readyReplicas": 2.0,
        "pendingReplicas": 0.0,
        "kv": 0.93,
        "kvTarget": 0.8,
        "queue": 3.0,
        "queueTarget": 2.0,
        "ratio": 1.5,
    }


def test_scale_down_waits_for_the_stabilization_window_then_steps_by_one() -> None:
    policy = PoolPolicy(min_replicas=1, max_replicas=8)  # defaults: down window 300 s, step 1
    busy, idle = {"kv": 0.8, "queue": 2.0}, {"kv": 0.1, "queue": 0.0}
    rows: list[Row] = [(float(t), busy, 4) for t in range(0, 61, 15)]  # at target: keep 4
    rows += [(float(t), idle, 4) for t in range(75, 346, 15)]  # idle, but t=60's proposal of 4 is in the window
    rows += [(360, idle, 3), (375, idle, 2), (390, idle, 1), (405, idle, 1)]
    decisions = replay(rows, policy=policy, start_replicas=4)
    assert decisions[5].reason == Reason.STABILIZING
    assert decisions[-4].reason == Reason.SCALED_DOWN
    assert "ceil(4 ready × max(kv 0.10/0.8, queue 0.00/2)) = 1 → stabilized 1 → step-limited 3" in decisions[-4].formula


def test_a_fresh_history_holds_scale_down_for_one_window() -> None:
    """After an operator restart nothing is known about the last 300 s: be conservative."""
    idle = {"kv": 0.1, "queue": 0.0}
    fresh = RecommendationHistory.fresh(now_seconds=0.0, current_replicas=4)
    rows: list[Row] = [(float(t), idle, 4) for t in range(0, 286, 15)] + [(300.0, idle, 3)]
    replay(rows, policy=PoolPolicy(min_replicas=1, max_replicas=8), start_replicas=4, history=fresh)


@pytest.mark.parametrize(
    ("kv", "expected", "reason"),
    [
        (0.80 * 1.10, 4, Reason.WITHIN_TOLERANCE),  # exactly on the band's edge: no change
        (0.80 * 0.91, 4, Reason.WITHIN_TOLERANCE),
        (0.80 * 1.12, 5, Reason.SCALED_UP),  # ceil(4 * 1.12) = 5
        (0.80 * 0.70, 3, Reason.SCALED_DOWN),  # ceil(4 * 0.70) = 3
    ],
)
def test_tolerance_band(kv: float, expected: int, reason: str) -> None:
    policy = PoolPolicy(min_replicas=1, max_replicas=8, behavior=Behavior(scale_down_stabilization_seconds=0))
    d = one(current=4, values={"kv": kv, "queue": 0.0}, policy=policy)
    assert (d.result, d.reason) == (expected, reason), d.formula


def test_step_limits_up_by_percent_and_down_by_pods() -> None:
    fast_down = Behavior(scale_down_stabilization_seconds=0, scale_down_max_step=2)
    policy = PoolPolicy(min_replicas=1, max_replicas=64, behavior=fast_down)
    surge = {"kv": 0.5, "queue": 10.0}  # ratio 5
    replay([(0, surge, 4), (15, surge, 8), (30, surge, 16)], policy=policy, start_replicas=2)  # doubling
    half = PoolPolicy(min_replicas=1, max_replicas=64, behavior=Behavior(scale_up_max_step_percent=50))
    assert one(current=4, values=surge, policy=half).result == 6
    assert one(current=1, values=surge, policy=half).result == 2  # at least one pod
    idle = {"kv": 0.05, "queue": 0.0}
    replay([(0, idle, 6), (15, idle, 4), (30, idle, 2), (45, idle, 1)], policy=policy, start_replicas=8)


def test_clamped_to_min_and_max() -> None:
    policy = PoolPolicy(min_replicas=2, max_replicas=5, behavior=Behavior(scale_down_stabilization_seconds=0))
    surge = {"kv": 0.8, "queue": 20.0}  # ratio 10
    d = one(current=4, values=surge, policy=policy)
    assert (d.result, d.reason) == (5, Reason.AT_MAX_REPLICAS)
    d = one(current=5, values=surge, policy=policy)
    assert (d.result, d.reason, d.write) == (5, Reason.AT_MAX_REPLICAS, False)
    d = one(current=2, values={"kv": 0.0, "queue": 0.0}, policy=policy)
    assert (d.result, d.reason) == (2, Reason.AT_MIN_REPLICAS)
    d = one(current=7, values={"kv": 0.8, "queue": 2.0}, policy=policy)  # max lowered below current
    assert (d.result, d.direction) == (5, "down")


def test_not_ready_replicas_carry_no_load_but_are_capacity_on_its_way() -> None:
    # 4 requested, 2 ready: queue 3/replica on the ready ones -> demand ceil(2*1.5)=3 <= 4
    d = one(current=4, ready=2, values={"kv": 0.5, "queue": 3.0})
    assert (d.result, d.reason) == (4, Reason.REPLICAS_STARTING)
    d = one(current=4, ready=2, values={"kv": 0.5, "queue": 6.0})  # demand 6 > 4: grow now
    assert (d.result, d.reason) == (6, Reason.SCALED_UP)
    assert d.formula.startswith("ceil(2 ready × ")


def test_pending_pods_block_further_scale_up_but_not_scale_down() -> None:
    d = one(current=4, ready=2, pending=2, values={"kv": 0.9, "queue": 6.0})
    assert (d.result, d.reason, d.pending_replicas) == (4, Reason.PENDING_PODS, 2)
    assert "2 pending for GPUs → held 4" in d.formula
    # Load gone: pending pods are dropped without using the one-pod step.
    policy = PoolPolicy(min_replicas=1, max_replicas=8, behavior=Behavior(scale_down_stabilization_seconds=0))
    d = one(current=4, ready=2, pending=2, values={"kv": 0.2, "queue": 0.0}, policy=policy)
    assert (d.result, d.reason) == (1, Reason.SCALED_DOWN)
    d = one(current=4, ready=3, pending=1, values={"kv": 0.2, "queue": 0.0}, policy=policy)
    assert d.result == 2  # 4 - 1 pending - step 1


@pytest.mark.parametrize(
    "unavailable",
    [
        MetricsUnavailable(reason=Reason.STALE, message="newest sample 90s old"),
        MetricsUnavailable(reason=Reason.NO_DATA, message="no series"),
    ],
)
def test_missing_or_stale_metrics_hold_and_count_as_a_proposal(unavailable: MetricsUnavailable) -> None:
    policy = PoolPolicy(min_replicas=1, max_replicas=8)
    history = RecommendationHistory()
    d = decide(
        pool="decode",
        now_seconds=100.0,
        current_replicas=3,
        ready_replicas=3,
        pending_replicas=0,
        signals=unavailable,
        policy=policy,
        history=history,
        gpus_per_replica=1,
    )
    assert (d.hold, d.result, d.reason, d.write) == (True, 3, Reason.METRICS_UNAVAILABLE, False)
    assert unavailable.reason in d.message and d.formula.startswith("hold 3")
    # metrics back, idle: the held count is in the window, so no immediate scale-down
    d = one(current=3, values={"kv": 0.0, "queue": 0.0}, policy=policy, history=history, now=115.0)
    assert (d.result, d.reason) == (3, Reason.STABILIZING)


def test_empty_signals_or_no_ready_pods_hold() -> None:
    policy = PoolPolicy(min_replicas=2, max_replicas=8)
    d = decide(
        pool="prefill",
        now_seconds=0,
        current_replicas=1,
        ready_replicas=1,
        pending_replicas=0,
        signals={},
        policy=policy,
        history=RecommendationHistory(),
        gpus_per_replica=1,
    )
    assert (d.hold, d.reason, d.result) == (True, Reason.METRICS_UNAVAILABLE, 2)  # min still applies
    d = one(current=2, ready=0, values={"kv": 0.9, "queue": 9.0}, policy=policy)
    assert (d.hold, d.reason, d.result) == (True, Reason.NO_READY_REPLICAS, 2)


def test_dry_run_reports_the_decision_but_flags_no_write() -> None:
    d = one(current=2, values={"kv": 0.93, "queue": 3.0}, dry_run=True)
    assert (d.result, d.reason, d.dry_run, d.write) == (3, Reason.SCALED_UP, True, False)


def test_single_pool_gpu_budget() -> None:
    d = one(current=2, values={"kv": 0.8, "queue": 6.0}, gpus_per_replica=2, gpu_budget_remaining=3)
    assert (d.result, d.reason) == (3, Reason.GPU_BUDGET_LIMITED)  # wants 6, room for one 2-GPU pod
    assert "gpu-budget 3" in d.formula


def _joint(budget: int, *, prefill: tuple[int, float, int], decode: tuple[int, float, int]) -> dict[str, Decision]:
    """(current replicas, queue per replica, gpus per replica) for each pool."""
    out = []
    for pool, (current, queue, gpus) in (("prefill", prefill), ("decode", decode)):
        targets = {"queue": 4.0} if pool == "prefill" else DECODE_TARGETS
        values = {"queue": queue * targets["queue"]} | ({"kv": 0.5} if pool == "decode" else {})
        policy = PoolPolicy(min_replicas=1, max_replicas=16, behavior=Behavior(scale_down_stabilization_seconds=0))
        out.append(
            one(current=current, values=values, pool=pool, targets=targets, gpus_per_replica=gpus, policy=policy)
        )
    return {d.pool: d for d in plan_joint(decisions=out, gpu_budget=budget)}


def test_joint_gpu_budget_trims_scale_ups_fairly_by_pressure() -> None:
    # prefill 3 pods x 1 GPU at ratio 2 wants 6; decode 2 pods x 2 GPUs at ratio 2 wants 4.
    # Unlimited that is 6 + 8 = 14 GPUs; 11 leaves 4 free beyond the 7 in use. Equal pressure
    # (2.0): decode (name order) +1 -> 4/3; prefill +1 -> 6/4; prefill +1 -> 6/5; 0 left.
    plan = _joint(11, prefill=(3, 2.0, 1), decode=(2, 2.0, 2))
    assert (plan["prefill"].result, plan["decode"].result) == (5, 3)
    assert plan["prefill"].gpus + plan["decode"].gpus == 11
    assert {d.reason for d in plan.values()} == {Reason.GPU_BUDGET_LIMITED}
    assert plan["decode"].formula.endswith("joint gpu-budget 11 3")
    # Plenty of budget: untouched.
    plan = _joint(14, prefill=(3, 2.0, 1), decode=(2, 2.0, 2))
    assert (plan["prefill"].result, plan["decode"].result) == (6, 4)
    assert plan["prefill"].reason == Reason.SCALED_UP
    # The hotter pool gets the only free GPU.
    plan = _joint(5, prefill=(2, 1.5, 1), decode=(2, 3.0, 1))
    assert (plan["prefill"].result, plan["decode"].result) == (2, 3)


def test_joint_gpu_budget_never_exceeded_during_a_rebalance() -> None:
    # decode shrinks 4 -> 3 (2 GPUs each) while prefill wants 2 -> 4: the decode GPUs are still
    # held this round, so prefill waits; next round they are free.
    plan = _joint(10, prefill=(2, 2.0, 1), decode=(4, 0.0, 2))
    assert (plan["prefill"].result, plan["decode"].result) == (2, 3)
    assert plan["prefill"].reason == Reason.GPU_BUDGET_LIMITED
    plan = _joint(10, prefill=(2, 2.0, 1), decode=(3, 0.0, 2))
    assert plan["prefill"].result == 4
    assert sum(max(d.result, d.current_replicas) * d.gpus_per_replica for d in plan.values()) <= 10


def test_history_keeps_only_the_longest_window() -> None:
    history = RecommendationHistory()
    policy = PoolPolicy(min_replicas=1, max_replicas=8)
    for t in range(0, 3600, 15):
        one(current=2, values={"kv": 0.8, "queue": 2.0}, policy=policy, history=history, now=float(t))
    assert len(history.samples) == 300 // 15
