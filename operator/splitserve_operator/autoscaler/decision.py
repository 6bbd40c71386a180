"""Scaling decisions as a pure function of what was observed.

Why pure: every rule that decides a replica count lives here, with time passed in, so the
tests can replay a recorded metric series second by second and the status can show the
exact arithmetic (:attr:`Decision.formula`) that produced a number. Nothing here talks to
Kubernetes or Prometheus; the only state is the caller's :class:`RecommendationHistory`,
which :func:`decide` appends to.

The algorithm is the HorizontalPodAutoscaler's target tracking, applied per pool:

1. ``ratio = max(value / target)`` over the pool's signals; values are per *ready* replica
   (not-ready and Pending pods serve nothing, so they cannot carry load).
2. Tolerance band: ``|ratio - 1| <= tolerance`` proposes the current count.
   Otherwise ``proposal = ceil(ready * ratio)``, never below the current count while the
   pressure is upward (starting pods are capacity on its way) and never above it while
   the pressure is downward.
3. Stabilization, as the HPA does it: every proposal is recorded; the scale-up bound is the
   *lowest* proposal in the up-window, the scale-down bound the *highest* in the
   down-window, and the current count is moved only as far as those bounds allow.
4. Pending pods (unschedulable for lack of GPUs): while any exist, no scale-up beyond the
   current count (more replicas would only add more Pending pods, cf. dynamo#12428), but
   scale-down keeps working (cf. dynamo#14251), and Pending pods do not use up the
   scale-down step: they hold no GPU and serve nothing, so the step counts from
   ``current - pending`` (the ReplicaSet removes unscheduled pods first).
5. Step limits: up by at most ``maxStepPercent`` of current (at least one pod), down by at
   most ``maxStep`` pods.
6. GPU budget (this pool alone, :func:`decide`) and jointly over pools (:func:`plan_joint`).
7. Clamp to ``[min, max]``.

Missing or stale metrics hold the current count (clamped to ``[min, max]``) with reason
``MetricsUnavailable``; a held count is recorded as a proposal, so an outage never turns
into an immediate scale-down when the metrics return.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from splitserve_contract import Reason

_CEIL_EPSILON: Final = 1e-9
"""ceil(2 * 1.5000000000000002) must be 3, not 4, and 0.88/0.8 is on the 10 % band's
edge, not outside it: float noise is not load."""


class MetricsUnavailable(Exception):
    """The pool's metrics cannot be trusted this round. ``reason`` is CamelCase:
    :attr:`Reason.QUERY_FAILED` (Prometheus error or unreachable), :attr:`Reason.NO_DATA`
    (no series for the pool) or :attr:`Reason.STALE` (the newest sample is too old)."""

    def __init__(self, *, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclasses.dataclass(frozen=True)
class SignalValue:
    """One scaling signal of a pool: observed ``value`` per ready replica and its target."""

    value: float
    target: float

    @property
    def ratio(self) -> float:
        return self.value / self.target


@dataclasses.dataclass(frozen=True)
class Behavior:
    """Rate limits, as in ``spec.autoscaling.behavior``."""

    scale_up_stabilization_seconds: float = 0.0
    scale_up_max_step_percent: int = 100
    scale_down_stabilization_seconds: float = 300.0
    scale_down_max_step: int = 1


@dataclasses.dataclass(frozen=True)
class PoolPolicy:
    """Everything from the spec that bounds one pool's decision."""

    min_replicas: int
    max_replicas: int
    behavior: Behavior = Behavior()
    tolerance: float = 0.1


@dataclasses.dataclass
class RecommendationHistory:
    """Proposals of one pool, ``(time_seconds, replicas)``, oldest first, in memory.

    Lost when the operator restarts. A fresh history is seeded with the current count
    (:meth:`fresh`), which makes a restart conservative: no scale-down until a whole
    down-window of new proposals has been seen.
    """

    samples: list[tuple[float, int]] = dataclasses.field(default_factory=list)

    @classmethod
    def fresh(cls, *, now_seconds: float, current_replicas: int) -> RecommendationHistory:
        return cls(samples=[(now_seconds, current_replicas)])

    def record(self, *, time_seconds: float, replicas: int, keep_seconds: float) -> None:
        self.samples.append((time_seconds, replicas))
        cutoff = time_seconds - keep_seconds
        self.samples = [s for s in self.samples if s[0] > cutoff or s[0] == time_seconds]

    def within(self, *, now_seconds: float, window_seconds: float) -> list[int]:
        """Proposals strictly newer than ``now - window`` (the HPA's cut-off)."""
        cutoff = now_seconds - window_seconds
        return [replicas for t, replicas in self.samples if t > cutoff]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One pool's decision with every input and intermediate value, for status and tests."""

    pool: str
    time_seconds: float
    current_replicas: int
    ready_replicas: int
    pending_replicas: int
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int
    signals: Mapping[str, SignalValue]
    ratio: float | None
    """max(value/target); None when no recommendation was computed (hold)."""
    proposal: int
    stabilized: int
    step_limited: int
    result: int
    reason: str
    formula: str
    hold: bool = False
    dry_run: bool = False
    message: str = ""
    model: Mapping[str, float] | None = None
    """The SLO controller's fitted model and estimates behind this decision (coefficients,
    confidence, forecast load, TTFT/ITL estimates at the result); None for target tracking."""

    @property
    def direction(self) -> str:
        """``up``, ``down`` or ``none`` (result against the current count)."""
        if self.result > self.current_replicas:
            return "up"
        if self.result < self.current_replicas:
            return "down"
        return "none"

    @property
    def write(self) -> bool:
        """Whether the actuator must change the Deployment (never in dry run)."""
        return not self.dry_run and self.result != self.current_replicas

    @property
    def gpus(self) -> int:
        return self.result * self.gpus_per_replica

    def inputs(self) -> dict[str, float]:
        """Flat observed values and targets, as ``status.<pool>.lastDecision.inputs``; a value
        that is not a finite number (JSON, and so the API server, has none) is left out."""
        out: dict[str, float] = {
            "currentReplicas": float(self.current_replicas),
            "readyReplicas": float(self.ready_replicas),
            "pendingReplicas": float(self.pending_replicas),
        }
        for name, signal in sorted(self.signals.items()):
            out[name] = round(signal.value, 4)
            out[f"{name}Target"] = signal.target
        if self.ratio is not None:
            out["ratio"] = round(self.ratio, 4)
        return {name: value for name, value in out.items() if math.isfinite(value)}


def _clamp(value: int, *, low: int, high: int) -> int:
    return max(low, min(high, value))


def _signal_terms(signals: Mapping[str, SignalValue]) -> str:
    return ", ".join(f"{name} {s.value:.2f}/{s.target:g}" for name, s in sorted(signals.items()))


# ---------------------------------------------------------------------------- the steps
# Each step below is one rule of the module docstring, pure but for the history that
# stabilization reads and appends to. decide() chains them and joins their formula parts.


@dataclasses.dataclass(frozen=True)
class _Hold:
    """Why no recommendation is computed this round (the count is held)."""

    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class _Proposal:
    """Steps 1-2: what the signals ask for, before stabilization and limits."""

    ratio: float
    replicas: int
    within_tolerance: bool
    awaiting_starting: bool
    """Upward pressure that the replicas already requested (starting pods) will absorb."""
    formula: str


def _screen(
    signals: Mapping[str, SignalValue] | MetricsUnavailable, *, ready_replicas: int
) -> dict[str, SignalValue] | _Hold:
    """The usable signals (positive target, finite value), or why the count must be held."""
    if isinstance(signals, MetricsUnavailable):
        return _Hold(Reason.METRICS_UNAVAILABLE, str(signals))
    if ready_replicas <= 0:
        return _Hold(Reason.NO_READY_REPLICAS, "no ready replicas")
    usable = {name: s for name, s in signals.items() if s.target > 0 and math.isfinite(s.value)}
    return usable if usable else _Hold(Reason.METRICS_UNAVAILABLE, "no usable signal")


def _within_tolerance(ratio: float, *, tolerance: float) -> bool:
    """Step 2's band: ``|ratio - 1| <= tolerance`` (edges included, float noise ignored)."""
    return abs(ratio - 1.0) <= tolerance + _CEIL_EPSILON


def _recommend(*, ratio: float, ready_replicas: int, current_replicas: int) -> tuple[int, int]:
    """Step 1 outside the band: ``(raw, proposal)``, where ``raw = ceil(ready * ratio)`` and
    the proposal never goes against the pressure's direction from the current count."""
    raw = math.ceil(ready_replicas * ratio - _CEIL_EPSILON)
    proposal = max(raw, current_replicas) if ratio > 1.0 else min(raw, current_replicas)
    return raw, proposal


def _propose(
    usable: Mapping[str, SignalValue],
    *,
    ready_replicas: int,
    current_replicas: int,
    tolerance: float,
) -> _Proposal:
    """Steps 1-2: the ratio of the most loaded signal, then the tolerance band."""
    ratio = max(s.ratio for s in usable.values())
    head = f"ceil({ready_replicas} ready × max({_signal_terms(usable)}))"
    if _within_tolerance(ratio, tolerance=tolerance):
        return _Proposal(
            ratio=ratio,
            replicas=current_replicas,
            within_tolerance=True,
            awaiting_starting=False,
            formula=f"{head}: ratio {ratio:.2f} within ±{tolerance:g} → keep {current_replicas}",
        )
    raw, proposal = _recommend(ratio=ratio, ready_replicas=ready_replicas, current_replicas=current_replicas)
    return _Proposal(
        ratio=ratio,
        replicas=proposal,
        within_tolerance=False,
        awaiting_starting=ratio > 1.0 and raw <= current_replicas,
        formula=f"{head} = {raw}" + (f" → {proposal} (current)" if proposal != raw else ""),
    )


def _keep_seconds(behavior: Behavior) -> float:
    """How long the history must remember proposals: the longer stabilization window."""
    return max(behavior.scale_up_stabilization_seconds, behavior.scale_down_stabilization_seconds)


def _stabilize(
    *,
    proposal: int,
    current_replicas: int,
    history: RecommendationHistory,
    now_seconds: float,
    behavior: Behavior,
) -> int:
    """Step 3 (the HPA's rule): move the current count only as far as the lowest proposal of
    the up-window and the highest of the down-window allow. Records ``proposal``."""
    up_window = history.within(now_seconds=now_seconds, window_seconds=behavior.scale_up_stabilization_seconds)
    down_window = history.within(now_seconds=now_seconds, window_seconds=behavior.scale_down_stabilization_seconds)
    history.record(time_seconds=now_seconds, replicas=proposal, keep_seconds=_keep_seconds(behavior))
    return min(max(current_replicas, min([proposal, *up_window])), max([proposal, *down_window]))


def _blocked_by_pending(*, stabilized: int, current_replicas: int, pending_replicas: int) -> bool:
    """Step 4: while pods wait for GPUs, no scale-up beyond the current count."""
    return pending_replicas > 0 and stabilized > current_replicas


def _step_limit(*, target: int, current_replicas: int, pending_replicas: int, behavior: Behavior) -> int:
    """Step 5: up by ``maxStepPercent`` of current (at least one pod), down by ``maxStep``
    pods counted from ``current - pending`` (Pending pods go for free)."""
    up_step = max(1, math.floor(current_replicas * behavior.scale_up_max_step_percent / 100))
    low = max(0, current_replicas - pending_replicas - behavior.scale_down_max_step)
    return _clamp(target, low=low, high=current_replicas + up_step)


def _budget_limit(
    replicas: int,
    *,
    current_replicas: int,
    gpus_per_replica: int,
    gpu_budget_remaining: int | None,
) -> int:
    """Step 6 for this pool alone: a scale-up adds at most the GPUs the budget has left."""
    if gpu_budget_remaining is None or gpus_per_replica <= 0 or replicas <= current_replicas:
        return replicas
    return min(replicas, current_replicas + max(0, gpu_budget_remaining) // gpus_per_replica)


@dataclasses.dataclass(frozen=True)
class _Limited:
    """Steps 4-7 applied to the stabilized count, with their formula parts."""

    blocked_by_pending: bool
    step_limited: int
    budgeted: int
    result: int
    stages: tuple[str, ...]


def _apply_limits(
    stabilized: int,
    *,
    current_replicas: int,
    pending_replicas: int,
    policy: PoolPolicy,
    gpus_per_replica: int,
    gpu_budget_remaining: int | None,
) -> _Limited:
    """Pending pods, step limits, this pool's GPU budget, then ``[min, max]``, in that order."""
    stages: list[str] = []
    blocked = _blocked_by_pending(
        stabilized=stabilized, current_replicas=current_replicas, pending_replicas=pending_replicas
    )
    if blocked:
        stages.append(f"{pending_replicas} pending for GPUs → held {current_replicas}")
    step_limited = _step_limit(
        target=current_replicas if blocked else stabilized,
        current_replicas=current_replicas,
        pending_replicas=pending_replicas,
        behavior=policy.behavior,
    )
    stages.append(f"step-limited {step_limited}")
    budgeted = _budget_limit(
        step_limited,
        current_replicas=current_replicas,
        gpus_per_replica=gpus_per_replica,
        gpu_budget_remaining=gpu_budget_remaining,
    )
    if budgeted != step_limited:
        stages.append(f"gpu-budget {budgeted}")
    result = _clamp(budgeted, low=policy.min_replicas, high=policy.max_replicas)
    stages.append(f"clamped [{policy.min_replicas},{policy.max_replicas}] {result}")
    return _Limited(
        blocked_by_pending=blocked, step_limited=step_limited, budgeted=budgeted, result=result, stages=tuple(stages)
    )


def _limit_reason(limited: _Limited, *, policy: PoolPolicy) -> str | None:
    """The reason when a limit decided the count (pending pods, budget, bounds), else None."""
    if limited.blocked_by_pending:
        return Reason.PENDING_PODS
    if limited.budgeted != limited.step_limited and limited.result == limited.budgeted:
        return Reason.GPU_BUDGET_LIMITED
    if limited.result == policy.max_replicas and limited.budgeted > policy.max_replicas:
        return Reason.AT_MAX_REPLICAS
    if limited.result == policy.min_replicas and limited.budgeted < policy.min_replicas:
        return Reason.AT_MIN_REPLICAS
    return None


def _movement_reason(*, result: int, current_replicas: int, proposal: _Proposal) -> str:
    """The reason when no limit decided: the direction, or why the count stays."""
    if result > current_replicas:
        return Reason.SCALED_UP
    if result < current_replicas:
        return Reason.SCALED_DOWN
    if proposal.within_tolerance:
        return Reason.WITHIN_TOLERANCE
    if proposal.awaiting_starting:
        return Reason.REPLICAS_STARTING
    if proposal.replicas != current_replicas:
        return Reason.STABILIZING
    return Reason.STEADY


def _hold(
    why: _Hold,
    *,
    pool: str,
    now_seconds: float,
    current_replicas: int,
    ready_replicas: int,
    pending_replicas: int,
    policy: PoolPolicy,
    history: RecommendationHistory,
    gpus_per_replica: int,
    dry_run: bool,
) -> Decision:
    """Keep the current count (clamped to the bounds) and record it as a proposal."""
    history.record(time_seconds=now_seconds, replicas=current_replicas, keep_seconds=_keep_seconds(policy.behavior))
    result = _clamp(current_replicas, low=policy.min_replicas, high=policy.max_replicas)
    return Decision(
        pool=pool,
        time_seconds=now_seconds,
        current_replicas=current_replicas,
        ready_replicas=ready_replicas,
        pending_replicas=pending_replicas,
        min_replicas=policy.min_replicas,
        max_replicas=policy.max_replicas,
        gpus_per_replica=gpus_per_replica,
        signals={},
        ratio=None,
        proposal=current_replicas,
        stabilized=current_replicas,
        step_limited=current_replicas,
        result=result,
        reason=why.reason,
        hold=True,
        dry_run=dry_run,
        message=why.message,
        formula=(
            f"hold {current_replicas} ({why.message}) → clamped [{policy.min_replicas},{policy.max_replicas}] {result}"
        ),
    )


def decide(
    *,
    pool: str,
    now_seconds: float,
    current_replicas: int,
    ready_replicas: int,
    pending_replicas: int,
    signals: Mapping[str, SignalValue] | MetricsUnavailable,
    policy: PoolPolicy,
    history: RecommendationHistory,
    gpus_per_replica: int,
    gpu_budget_remaining: int | None = None,
    dry_run: bool = False,
) -> Decision:
    """Decide one pool's replica count (see the module docstring for the rules).

    ``current_replicas`` is the Deployment's ``spec.replicas``; ``ready_replicas`` the
    Ready pods; ``pending_replicas`` the pods Pending because no node has the GPUs.
    ``gpu_budget_remaining`` is how many GPUs this pool may add on top of what its current
    replicas request (None: no cap). Appends the proposal to ``history``.
    """
    current, pending = current_replicas, pending_replicas
    usable = _screen(signals, ready_replicas=ready_replicas)
    if isinstance(usable, _Hold):
        return _hold(
            usable,
            pool=pool,
            now_seconds=now_seconds,
            current_replicas=current,
            ready_replicas=ready_replicas,
            pending_replicas=pending,
            policy=policy,
            history=history,
            gpus_per_replica=gpus_per_replica,
            dry_run=dry_run,
        )

    proposal = _propose(usable, ready_replicas=ready_replicas, current_replicas=current, tolerance=policy.tolerance)
    settled = settle(
        proposal=proposal.replicas,
        now_seconds=now_seconds,
        current_replicas=current,
        pending_replicas=pending,
        policy=policy,
        history=history,
        gpus_per_replica=gpus_per_replica,
        gpu_budget_remaining=gpu_budget_remaining,
    )
    reason = settled.limit_reason or _movement_reason(
        result=settled.result, current_replicas=current, proposal=proposal
    )
    stages = [proposal.formula, *settled.stages]
    return Decision(
        pool=pool,
        time_seconds=now_seconds,
        current_replicas=current,
        ready_replicas=ready_replicas,
        pending_replicas=pending,
        min_replicas=policy.min_replicas,
        max_replicas=policy.max_replicas,
        gpus_per_replica=gpus_per_replica,
        signals=dict(usable),
        ratio=proposal.ratio,
        proposal=proposal.replicas,
        stabilized=settled.stabilized,
        step_limited=settled.step_limited,
        result=settled.result,
        reason=reason,
        formula=" → ".join(stages),
        dry_run=dry_run,
    )


@dataclasses.dataclass(frozen=True)
class Settled:
    """Steps 3-7 applied to a proposal: what :func:`settle` returns."""

    stabilized: int
    step_limited: int
    result: int
    limit_reason: str | None
    """The reason when a limit decided the count (pending pods, budget, bounds), else None."""
    stages: tuple[str, ...]
    """Formula parts, starting with ``stabilized N``."""


def settle(
    *,
    proposal: int,
    now_seconds: float,
    current_replicas: int,
    pending_replicas: int,
    policy: PoolPolicy,
    history: RecommendationHistory,
    gpus_per_replica: int,
    gpu_budget_remaining: int | None = None,
) -> Settled:
    """The tail every proposal goes through, whoever proposed it (target tracking here, the
    SLO controller in :mod:`.slo.controller`): stabilization (records ``proposal`` in
    ``history``), pending-pod hold, step limits, this pool's GPU budget, ``[min, max]``."""
    stabilized = _stabilize(
        proposal=proposal,
        current_replicas=current_replicas,
        history=history,
        now_seconds=now_seconds,
        behavior=policy.behavior,
    )
    limited = _apply_limits(
        stabilized,
        current_replicas=current_replicas,
        pending_replicas=pending_replicas,
        policy=policy,
        gpus_per_replica=gpus_per_replica,
        gpu_budget_remaining=gpu_budget_remaining,
    )
    return Settled(
        stabilized=stabilized,
        step_limited=limited.step_limited,
        result=limited.result,
        limit_reason=_limit_reason(limited, policy=policy),
        stages=(f"stabilized {stabilized}", *limited.stages),
    )


def grant_gpu_budget(
    decisions: Sequence[Decision], *, gpu_budget: int | None, priority: Callable[[Decision, int], float]
) -> tuple[dict[str, int], list[str]] | None:
    """Share ``gpu_budget`` among the pools' scale-ups; None when every result fits as it is.

    GPUs held now count against the budget until they are released: a pool that scales
    down this round still holds its current GPUs, so another pool can use them only on a
    later round (requests never exceed the budget during a rebalance, cf. dynamo#12428).
    Increases up to ``min`` are granted first (the CRD guarantees the budget covers every
    min); the rest is handed out one replica at a time to the growing pool with the highest
    ``priority(decision, replicas so far)``, ties by pool name. Returns the replicas granted
    on top of each growing pool's current count, and the grants in order (for the formula).
    """
    if gpu_budget is None:
        return None
    if sum(max(d.result, d.current_replicas) * d.gpus_per_replica for d in decisions) <= gpu_budget:
        return None
    free = gpu_budget - sum(d.current_replicas * d.gpus_per_replica for d in decisions)
    growing = sorted((d for d in decisions if d.result > d.current_replicas), key=lambda d: d.pool)
    granted: dict[str, int] = {}
    for d in growing:
        granted[d.pool] = max(0, d.min_replicas - d.current_replicas)
        free -= granted[d.pool] * d.gpus_per_replica
    trail: list[str] = []
    while True:
        candidates = [
            d for d in growing if d.current_replicas + granted[d.pool] < d.result and d.gpus_per_replica <= free
        ]
        if not candidates:
            return granted, trail
        score = {d.pool: priority(d, d.current_replicas + granted[d.pool]) for d in candidates}
        best = max(candidates, key=lambda d: score[d.pool])  # first of equals: ties go by pool name
        trail.append(f"{best.pool}+1 ({score[best.pool]:.3g})")
        granted[best.pool] += 1
        free -= best.gpus_per_replica


def trimmed_to(decision: Decision, granted: Mapping[str, int]) -> int | None:
    """The count ``decision`` is cut to by :func:`grant_gpu_budget`'s grants; None when it keeps its result."""
    if decision.pool not in granted or decision.current_replicas + granted[decision.pool] >= decision.result:
        return None
    return decision.current_replicas + granted[decision.pool]


def plan_joint(*, decisions: Sequence[Decision], gpu_budget: int | None) -> list[Decision]:
    """Trim scale-ups so the pools' GPUs together stay within ``gpu_budget``
    (:func:`grant_gpu_budget`), the next replica going to the pool with the highest pressure
    after the grant: demand ``ratio * ready`` over the replicas granted so far. Scale-downs
    and holds are unchanged.
    """

    def pressure(d: Decision, replicas: int) -> float:
        demand = (d.ratio if d.ratio is not None else 1.0) * max(d.ready_replicas, 1)
        return demand / replicas if replicas > 0 else math.inf

    grants = grant_gpu_budget(decisions, gpu_budget=gpu_budget, priority=pressure)
    if grants is None:
        return list(decisions)
    out: list[Decision] = []
    for d in decisions:
        trimmed = trimmed_to(d, grants[0])
        out.append(
            d
            if trimmed is None
            else dataclasses.replace(
                d,
                result=trimmed,
                reason=Reason.GPU_BUDGET_LIMITED,
                formula=f"{d.formula} → joint gpu-budget {gpu_budget} {trimmed}",
            )
        )
    return out
