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
from collections.abc import Mapping, Sequence
from typing import Final

from ..api import Reason as ApiReason

_CEIL_EPSILON: Final = 1e-9
"""ceil(2 * 1.5000000000000002) must be 3, not 4, and 0.88/0.8 is on the 10 % band's
edge, not outside it: float noise is not load."""


class Reason:
    """CamelCase reasons of a :class:`Decision` (shared ones come from the API module)."""

    SCALED_UP: Final = ApiReason.SCALED_UP
    SCALED_DOWN: Final = ApiReason.SCALED_DOWN
    WITHIN_TOLERANCE: Final = ApiReason.WITHIN_TOLERANCE
    AT_MIN: Final = ApiReason.AT_MIN_REPLICAS
    AT_MAX: Final = ApiReason.AT_MAX_REPLICAS
    GPU_BUDGET: Final = ApiReason.GPU_BUDGET_LIMITED
    METRICS_UNAVAILABLE: Final = ApiReason.METRICS_UNAVAILABLE
    STABILIZING: Final = "Stabilizing"
    PENDING_PODS: Final = "PendingPods"
    NO_READY_REPLICAS: Final = "NoReadyReplicas"
    REPLICAS_STARTING: Final = "ReplicasStarting"
    STEADY: Final = "Steady"


class MetricsUnavailable(Exception):
    """The pool's metrics cannot be trusted this round. ``reason`` is CamelCase:
    ``QueryFailed`` (Prometheus error or unreachable), ``NoData`` (no series for the pool)
    or ``Stale`` (the newest sample is too old)."""

    QUERY_FAILED: Final = "QueryFailed"
    NO_DATA: Final = "NoData"
    STALE: Final = "Stale"

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
        """Flat observed values and targets, as ``status.<pool>.lastDecision.inputs``."""
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
        return out


def _clamp(value: int, *, low: int, high: int) -> int:
    return max(low, min(high, value))


def _signal_terms(signals: Mapping[str, SignalValue]) -> str:
    return ", ".join(f"{name} {s.value:.2f}/{s.target:g}" for name, s in sorted(signals.items()))


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
    def hold(reason: str, message: str) -> Decision:
        history.record(time_seconds=now_seconds, replicas=current_replicas, keep_seconds=keep_seconds)
        result = _clamp(current_replicas, low=policy.min_replicas, high=policy.max_replicas)
        return Decision(
            pool=pool, time_seconds=now_seconds, current_replicas=current_replicas,
            ready_replicas=ready_replicas, pending_replicas=pending_replicas,
            min_replicas=policy.min_replicas, max_replicas=policy.max_replicas,
            gpus_per_replica=gpus_per_replica, signals={}, ratio=None,
            proposal=current_replicas, stabilized=current_replicas, step_limited=current_replicas,
            result=result, reason=reason, hold=True, dry_run=dry_run, message=message,
            formula=(
                f"hold {current_replicas} ({message}) → "
                f"clamped [{policy.min_replicas},{policy.max_replicas}] {result}"
            ),
        )

    behavior = policy.behavior
    keep_seconds = max(behavior.scale_up_stabilization_seconds, behavior.scale_down_stabilization_seconds)
    if isinstance(signals, MetricsUnavailable):
        return hold(Reason.METRICS_UNAVAILABLE, str(signals))
    if ready_replicas <= 0:
        return hold(Reason.NO_READY_REPLICAS, "no ready replicas")
    usable = {name: s for name, s in signals.items() if s.target > 0 and math.isfinite(s.value)}
    if not usable:
        return hold(Reason.METRICS_UNAVAILABLE, "no usable signal")

    ratio = max(s.ratio for s in usable.values())
    stages: list[str] = []
    head = f"ceil({ready_replicas} ready × max({_signal_terms(usable)}))"
    within_tolerance = abs(ratio - 1.0) <= policy.tolerance + _CEIL_EPSILON
    awaiting_starting = False
    if within_tolerance:
        proposal = current_replicas
        stages.append(f"{head}: ratio {ratio:.2f} within ±{policy.tolerance:g} → keep {proposal}")
    else:
        raw = math.ceil(ready_replicas * ratio - _CEIL_EPSILON)
        proposal = max(raw, current_replicas) if ratio > 1.0 else min(raw, current_replicas)
        awaiting_starting = ratio > 1.0 and raw <= current_replicas
        stages.append(f"{head} = {raw}" + (f" → {proposal} (current)" if proposal != raw else ""))

    # Stabilization (HPA): move the current count only as far as the window bounds allow.
    up_bound = min([proposal, *history.within(now_seconds=now_seconds, window_seconds=behavior.scale_up_stabilization_seconds)])
    down_bound = max([proposal, *history.within(now_seconds=now_seconds, window_seconds=behavior.scale_down_stabilization_seconds)])
    history.record(time_seconds=now_seconds, replicas=proposal, keep_seconds=keep_seconds)
    stabilized = min(max(current_replicas, up_bound), down_bound)
    stages.append(f"stabilized {stabilized}")

    blocked_by_pending = pending_replicas > 0 and stabilized > current_replicas
    target = current_replicas if blocked_by_pending else stabilized
    if blocked_by_pending:
        stages.append(f"{pending_replicas} pending for GPUs → held {target}")

    up_step = max(1, math.floor(current_replicas * behavior.scale_up_max_step_percent / 100))
    low_step = max(0, current_replicas - pending_replicas - behavior.scale_down_max_step)
    step_limited = _clamp(target, low=low_step, high=current_replicas + up_step)
    stages.append(f"step-limited {step_limited}")

    budgeted = step_limited
    if gpu_budget_remaining is not None and gpus_per_replica > 0 and step_limited > current_replicas:
        budgeted = min(step_limited, current_replicas + max(0, gpu_budget_remaining) // gpus_per_replica)
        if budgeted != step_limited:
            stages.append(f"gpu-budget {budgeted}")

    result = _clamp(budgeted, low=policy.min_replicas, high=policy.max_replicas)
    stages.append(f"clamped [{policy.min_replicas},{policy.max_replicas}] {result}")

    if blocked_by_pending:
        reason = Reason.PENDING_PODS
    elif budgeted != step_limited and result == budgeted:
        reason = Reason.GPU_BUDGET
    elif result == policy.max_replicas and budgeted > policy.max_replicas:
        reason = Reason.AT_MAX
    elif result == policy.min_replicas and budgeted < policy.min_replicas:
        reason = Reason.AT_MIN
    elif result > current_replicas:
        reason = Reason.SCALED_UP
    elif result < current_replicas:
        reason = Reason.SCALED_DOWN
    elif within_tolerance:
        reason = Reason.WITHIN_TOLERANCE
    elif awaiting_starting:
        reason = Reason.REPLICAS_STARTING
    elif proposal != current_replicas:
        reason = Reason.STABILIZING
    else:
        reason = Reason.STEADY
    return Decision(
        pool=pool, time_seconds=now_seconds, current_replicas=current_replicas,
        ready_replicas=ready_replicas, pending_replicas=pending_replicas,
        min_replicas=policy.min_replicas, max_replicas=policy.max_replicas,
        gpus_per_replica=gpus_per_replica, signals=dict(usable), ratio=ratio,
        proposal=proposal, stabilized=stabilized, step_limited=step_limited, result=result,
        reason=reason, formula=" → ".join(stages), dry_run=dry_run,
    )


def plan_joint(*, decisions: Sequence[Decision], gpu_budget: int | None) -> list[Decision]:
    """Trim scale-ups so the pools' GPUs together stay within ``gpu_budget``.

    GPUs held now count against the budget until they are released: a pool that scales
    down this round still holds its current GPUs, so another pool can use them only on a
    later round (requests never exceed the budget during a rebalance, cf. dynamo#12428).
    Increases up to ``min`` are granted first; the rest is handed out one replica at a time
    to the pool with the highest pressure after the grant (demand ``ratio * ready`` over
    replicas granted so far), ties by pool name. Scale-downs and holds are unchanged.
    """
    if gpu_budget is None:
        return list(decisions)
    if sum(max(d.result, d.current_replicas) * d.gpus_per_replica for d in decisions) <= gpu_budget:
        return list(decisions)

    free = gpu_budget - sum(d.current_replicas * d.gpus_per_replica for d in decisions)
    growing = sorted((d for d in decisions if d.result > d.current_replicas), key=lambda d: d.pool)
    granted: dict[str, int] = {}
    for d in growing:  # up to min first (the CRD guarantees the budget covers every min)
        granted[d.pool] = max(0, d.min_replicas - d.current_replicas)
        free -= granted[d.pool] * d.gpus_per_replica

    def pressure(d: Decision) -> float:
        capacity = d.current_replicas + granted[d.pool]
        demand = (d.ratio if d.ratio is not None else 1.0) * max(d.ready_replicas, 1)
        return demand / capacity if capacity > 0 else math.inf

    while True:
        candidates = [
            d for d in growing
            if d.current_replicas + granted[d.pool] < d.result and d.gpus_per_replica <= free
        ]
        if not candidates:
            break
        best = max(candidates, key=pressure)  # first of equals: ties go by pool name
        granted[best.pool] += 1
        free -= best.gpus_per_replica

    out: list[Decision] = []
    for d in decisions:
        if d.pool not in granted or d.current_replicas + granted[d.pool] >= d.result:
            out.append(d)
            continue
        trimmed = d.current_replicas + granted[d.pool]
        out.append(dataclasses.replace(
            d, result=trimmed, reason=Reason.GPU_BUDGET,
            formula=f"{d.formula} → joint gpu-budget {gpu_budget} {trimmed}",
        ))
    return out
