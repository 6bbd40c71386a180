"""The SLO controller: the fewest replicas per pool whose estimated p99 TTFT/ITL meet the SLO.

Why a model and not target tracking: a target on a proxy signal (queue length, KV usage)
has to be hand-tuned per workload to hit a latency goal; the step model fitted from the
pods' own counters (:mod:`.step_fit`) turns a latency goal into replica counts directly,
and plans the prefill and decode pools jointly (TTFT is the prefill pool's, plus the
decode pool's first step; ITL is the decode pool's).

One round, per pool (:func:`decide_slo`):

1. Load to plan for: the forecaster's load at the pool's measured pod start time; the
   request rate is ``max(current, forecast, recent peak) + BURST_MARGIN × burstiness`` (the
   forecast only adds; ``burstiness`` is the rate's mean absolute miss around its trend
   beyond Poisson noise, so bursty traffic is planned with the margin a pod start time
   cannot provide once a burst has begun; the recent peak of the smoothed rate, decaying
   with a 5-minute half-life, keeps a burst's capacity through the lull before the next
   one: the router commits requests to the pods Ready at arrival, so a backlog built while
   pods start stays on the old pods and later pods cannot drain it), the
   lengths the current window's (the forecaster's when the window saw no request), the
   prefix hit ratio the smaller of the two. Not the larger of the current and the forecast
   lengths: those are two mixes, and pairing the planned rate with the lagging mean of the
   previous one plans work that neither carries (e2e: 16-token outputs, then a step to about
   95 req/s of 1-token outputs planned 16 decode rows per request and scaled the decode pool
   the step never loaded).
2. Model count: the fewest replicas in ``[1, maxReplicas]`` whose estimate
   (:mod:`.estimate`; TTFT with the backlog drain beyond one pod start time) meets the
   targets at the planned request rate divided by ``headroom`` (decode pools first; the
   prefill pool's TTFT includes the decode pool's first step at its chosen count). None
   fits → max. The margin is on the load, not on the latency targets: the planned load
   uses at most ``headroom`` of the rate the fleet can serve within the targets (the
   seed's 70-80 % rule, the planner's ``--headroom``). A latency margin costs very
   different capacity in different regimes: where latency is flat in the load (a decode
   step is mostly weight reads) 0.8 × ITL is about 64 % of a decode pod's batch capacity
   (Llama-3.1-8B on an L40S), near the knee of a prefill queue it is a few percent.
3. Reactive correction: when the measured p99 of the pool's metric exceeds the target
   (the model says fine but reality does not), ``ceil(ready × min(measured/target, 2))``,
   like target tracking on measured/target but at most doubling the Ready pods (latency
   lags; see :data:`REACTIVE_MAX_FACTOR`); the larger of model and reactive counts wins. A
   TTFT excess whose cause is gone or going is not acted on: the model says the current count
   meets the SLO at the current load, and no request waits in the pool, or (with a fit trusted
   to scale down) its queue has shrunk since the last round (:func:`_passed_violation`).
4. Scale-down gates: a model-driven count below the current one is used only when the
   fit's confidence is at least :data:`MIN_CONFIDENCE_TO_SCALE_DOWN`, the measured p99s
   are within target, and the estimate at ``current - 1`` (and at the
   count the step limit would allow), corrected by ``max(1, measured/estimated)`` at the
   current count, still meets the targets at the load ÷ headroom (the N-1 check, against Dynamo's 2↔1
   flapping); otherwise the current count is held. Without a prior, a model count above the
   current one is used only at a confidence of :data:`MIN_CONFIDENCE_TO_SCALE_UP` or more
   (measured violations scale up regardless), and every confidence gate of a prior-less fit
   reads its confidence at the planned request's mix (:meth:`.StepFit.confidence_at`,
   :func:`_planned_mix`): batch-1 windows vouch for nothing about a batch of 8. A fit of low confidence still steps down
   one replica on measurements alone: an idle pool, or a measured p99 that stays within half
   of ``headroom × target`` even scaled by ``N/(N-1)`` (:func:`_measured_scale_down`).
5. Floors: never below the count target tracking chose (``floors``; targets are floors).
6. The target tracker's tail (:func:`..decision.settle`): stabilization windows, Pending
   pods, step limits, ``[min, max]``.
7. GPU budget, jointly: when the pools' GPUs exceed ``gpu_budget``, GPUs held now stay
   held this round; increases up to ``min`` come first, then replicas are granted one at a
   time to the pool with the largest marginal gain per GPU,
   ``(score(n) - score(n+1)) / gpus_per_replica``, where ``score`` is the pool's largest
   estimate/target ratio (unstable counts score ``CAP·(1 + utilization)`` so that capacity
   still goes where the overload is worst); ties by pool name.

No load and no coefficients (no prior, too little data) → hold with reason
``SloModelUnavailable``, unless the measured latency violates (then step 3 alone).
The controller does not update :class:`.state.SloState`; the caller calls
:meth:`.state.SloState.observe` first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from splitserve_contract import Reason

from ..decision import (
    Decision,
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    grant_gpu_budget,
    settle,
    trimmed_to,
)
from .estimate import (
    Backlog,
    LatencyEstimate,
    Workload,
    estimate_aggregated,
    estimate_decode,
    estimate_prefill,
)
from .inputs import (
    COEFFICIENT_NAMES,
    LoadObservation,
    PoolSloObservation,
    SloInputs,
    SloTarget,
    StepCoefficients,
)
from .state import SloState
from .step_fit import StepFit

MIN_CONFIDENCE_TO_SCALE_DOWN: Final = 0.5
"""Below this fit confidence the model may add replicas but never remove them (measurements
alone may still take one step down: :data:`MEASURED_SCALE_DOWN_FRACTION`)."""
MIN_CONFIDENCE_TO_SCALE_UP: Final = 0.2
"""Without a prior, a fit below this confidence does not add replicas on its own (measured
violations still do): its first windows can put a pool's cost on the wrong feature."""
MEASURED_SCALE_DOWN_FRACTION: Final = 0.5
"""Below this confidence a pool still steps down one replica when its measured p99, scaled by
``N/(N-1)``, is within this fraction of ``headroom × target`` (:func:`_measured_scale_down`)."""
BURST_MARGIN: Final = 3.0
"""Requests/s added to the planned rate per request/s of the forecaster's burstiness (adds
nothing on steady and diurnal traffic, whose deviation is Poisson noise). Since the plan
keeps the recent peak, the margin matters little: on the CI bursty trace 3 and 6 give the
same attainment (6 costs 11 % more GPU-hours), 0 loses 6 points."""
REACTIVE_MAX_FACTOR: Final = 2.0
"""The reactive correction at most doubles the Ready pods per round: measured p99 latency
lags (a built queue keeps it high while new pods start), so proportional control on it
alone would ratchet; the model's backlog term sizes the rest."""
SCORE_CAP: Final = 1000.0
"""Estimate/target ratio standing for "unstable" in the budget trade."""

ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLE_AGGREGATED: Final = "aggregated"

_CAMEL = {
    "step": "step",
    "prefill_token": "prefillToken",
    "prefill_pair": "prefillPair",
    "decode_row": "decodeRow",
    "decode_context": "decodeContext",
}


@dataclasses.dataclass
class _Plan:
    """One pool's working values through the round."""

    name: str
    pool: PoolSloObservation
    policy: PoolPolicy
    fit: StepFit | None
    theta: StepCoefficients | None
    workload: Workload | None
    current_workload: Workload | None
    horizon_seconds: float
    forecast_rate: float | None
    waiting_before: float | None = None
    """Requests waiting in the pool at the previous round (None: not seen)."""
    estimate: Callable[[int, Workload], LatencyEstimate] | None = None
    model_replicas: int | None = None
    model_replicas_now: int | None = None
    unattainable: bool = False
    stages: list[str] = dataclasses.field(default_factory=list)

    mix: tuple[float, ...] | None = None
    """Without a prior: one planned request's step features on this pool (:func:`_planned_mix`)."""

    @property
    def confidence(self) -> float:
        """The fit's confidence; without a prior, at the planned mix (:meth:`.StepFit.confidence_at`):
        a direction the data never excited has no value at all then, only the ridge's split."""
        if self.fit is None:
            return 0.0
        if self.mix is not None:
            return self.fit.confidence_at(self.mix)
        return self.fit.confidence

    def metrics(self) -> tuple[bool, bool]:
        """Which of (TTFT, ITL) this pool answers for."""
        role = self.pool.role
        return role in (ROLE_PREFILL, ROLE_AGGREGATED), role in (ROLE_DECODE, ROLE_AGGREGATED)

    def ratios(self, estimate: LatencyEstimate, slo: SloTarget) -> tuple[float | None, float | None]:
        """(TTFT, ITL) estimate/target of the metrics this pool answers for (None: not its
        metric); TTFT as sized, with the backlog drain beyond one pod start time."""
        ttft, itl = self.metrics()
        return (
            estimate.ttft_ratio(slo, drain_allowance_seconds=self.horizon_seconds) if ttft else None,
            estimate.itl_ratio(slo) if itl else None,
        )

    def score(self, estimate: LatencyEstimate, slo: SloTarget) -> float:
        """The largest estimate/target ratio of this pool's metrics (inf when unstable)."""
        return max((r for r in self.ratios(estimate, slo) if r is not None), default=0.0)

    def meets(self, replicas: int, slo: SloTarget, workload: Workload | None = None) -> bool:
        """Within the targets at ``workload`` (default: the planned load) ÷ headroom."""
        assert self.estimate is not None
        load = workload if workload is not None else self.workload
        assert load is not None
        return self.score(self.estimate(replicas, load.with_margin(slo.headroom)), slo) <= 1.0 + 1e-12


def decide_slo(
    *,
    inputs: SloInputs,
    slo: SloTarget,
    state: SloState,
    policies: Mapping[str, PoolPolicy],
    histories: Mapping[str, RecommendationHistory],
    gpus_per_replica: Mapping[str, int],
    floors: Mapping[str, int] | None,
    gpu_budget: int | None,
    max_num_batched_tokens: int,
    dry_run: bool = False,
) -> list[Decision]:
    """One :class:`..decision.Decision` per pool of ``inputs.pools`` (module docstring).

    ``histories`` are appended to (stabilization); ``floors`` are target tracking's counts
    (None: no floors); ``gpu_budget`` caps the pools' GPUs together (None: no cap).
    """
    plans = {
        name: _plan(name, pool, inputs=inputs, slo=slo, state=state, policy=policies[name])
        for name, pool in sorted(inputs.pools.items())
    }
    _attach_estimators(plans, slo=slo, max_num_batched_tokens=max_num_batched_tokens)
    measured_ttft = _worst(p.ttft_p99_seconds for p in inputs.pools.values())
    measured_itl = _worst(p.itl_p99_seconds for p in inputs.pools.values())
    decisions = [
        _decide_pool(
            plan,
            inputs=inputs,
            slo=slo,
            history=histories[name],
            gpus=gpus_per_replica.get(name, 1),
            floor=(floors or {}).get(name),
            measured_ttft=measured_ttft,
            measured_itl=measured_itl,
            dry_run=dry_run,
        )
        for name, plan in plans.items()
    ]
    return _trade_budget(decisions, plans=plans, slo=slo, gpu_budget=gpu_budget)


# ---------------------------------------------------------------------------- planning
def _worst(values: Iterable[float | None]) -> float | None:
    found = [v for v in values if v is not None and math.isfinite(v)]
    return max(found) if found else None


def _plan_load(
    current: LoadObservation | None, forecast: LoadObservation | None, *, deviation: float = 0.0, peak: float = 0.0
) -> Workload | None:
    """The planned load: the larger of the current, forecast and peak rate plus the burst margin,
    with the window's prompt and output lengths (the forecaster's for an empty window). The part
    of the rate above the window's is requests still to come, so it takes the newest requests'
    lengths where the last interval was read apart (``recent_*``): at a switch from long to
    short outputs the window still holds the old mix, and pairing it with a rate that already
    counts the new requests sized the decode pool for outputs nobody was asking for any more."""
    if current is None:
        return None
    if forecast is None:
        return Workload.from_load(current)
    lengths = current if current.request_rate > 0.0 else forecast  # an empty window has no mix
    now = max(current.request_rate, 0.0)
    rate = max(now, forecast.request_rate, peak, 0.0) + BURST_MARGIN * max(0.0, deviation)
    prompt, output = max(lengths.prompt_tokens_mean, 0.0), max(lengths.output_tokens_mean, 1.0)
    recent_prompt, recent_output = current.recent_prompt_tokens_mean, current.recent_output_tokens_mean
    if rate > now and recent_prompt is not None and recent_output is not None:
        ahead = rate - now
        prompt = (now * prompt + ahead * max(recent_prompt, 0.0)) / rate
        output = (now * output + ahead * max(recent_output, 1.0)) / rate
    return Workload(
        request_rate=rate,
        prompt_tokens=prompt,
        output_tokens=output,
        prefix_hit_ratio=min(1.0, max(0.0, min(current.prefix_hit_ratio, forecast.prefix_hit_ratio))),
    )


def _plan(
    name: str, pool: PoolSloObservation, *, inputs: SloInputs, slo: SloTarget, state: SloState, policy: PoolPolicy
) -> _Plan:
    fit = state.fits.get(name)
    theta = fit.coefficients if fit is not None else slo.prior
    horizon = state.pod_start_seconds(name if name in state.start_seconds else pool.role)
    forecast = state.forecaster.forecast(horizon_seconds=horizon)
    return _Plan(
        name=name,
        pool=pool,
        policy=policy,
        fit=fit,
        theta=theta,
        workload=_plan_load(inputs.load, forecast, deviation=state.forecaster.burstiness, peak=state.forecaster.peak),
        current_workload=Workload.from_load(inputs.load) if inputs.load is not None else None,
        horizon_seconds=horizon,
        forecast_rate=forecast.request_rate if forecast is not None else None,
        waiting_before=state.waiting_before.get(name),
    )


def _attach_estimators(plans: Mapping[str, _Plan], *, slo: SloTarget, max_num_batched_tokens: int) -> None:
    """Give every pool with coefficients its estimate function and model count; decode
    pools first, so the prefill pools' TTFT can include the chosen decode pool's first step."""
    budget = max_num_batched_tokens
    q = slo.attainment
    decode_plans = [p for p in plans.values() if p.pool.role == ROLE_DECODE]
    for plan in plans.values():
        theta, pool = plan.theta, plan.pool
        if theta is None:
            continue
        if pool.role == ROLE_AGGREGATED:

            def aggregated(
                n: int,
                load: Workload,
                theta: StepCoefficients = theta,
                pool: PoolSloObservation = pool,
                horizon: float = plan.horizon_seconds,
            ) -> LatencyEstimate:
                return estimate_aggregated(
                    theta,
                    load,
                    replicas=n,
                    max_num_batched_tokens=budget,
                    attainment=q,
                    backlog=_backlog(pool),
                    kv_tokens_per_replica=pool.kv_cache_tokens_per_replica,
                    serving_replicas=_serving(pool),
                    start_seconds=horizon,
                )

            plan.estimate = aggregated
        elif pool.role == ROLE_DECODE:

            def decode(
                n: int, load: Workload, theta: StepCoefficients = theta, pool: PoolSloObservation = pool
            ) -> LatencyEstimate:
                d = estimate_decode(
                    theta, load, replicas=n, attainment=q, kv_tokens_per_replica=pool.kv_cache_tokens_per_replica
                )
                return LatencyEstimate(ttft_seconds=d.step_seconds, itl_seconds=d.itl_seconds, decode=d)

            plan.estimate = decode
    for plan in plans.values():
        if plan.estimate is not None:
            _search(plan, slo)
    for plan in plans.values():
        theta, pool = plan.theta, plan.pool
        if theta is None or pool.role != ROLE_PREFILL:
            continue

        def prefill(
            n: int,
            load: Workload,
            theta: StepCoefficients = theta,
            pool: PoolSloObservation = pool,
            horizon: float = plan.horizon_seconds,
        ) -> LatencyEstimate:
            p = estimate_prefill(
                theta,
                load,
                replicas=n,
                max_num_batched_tokens=budget,
                attainment=q,
                backlog=_backlog(pool),
                serving_replicas=_serving(pool),
                start_seconds=horizon,
            )
            first = _first_decode_step(decode_plans, load)
            return LatencyEstimate(ttft_seconds=p.ttft_seconds + first, itl_seconds=0.0, prefill=p)

        plan.estimate = prefill
        _search(plan, slo)
    if slo.prior is None:
        for plan in plans.values():
            plan.mix = _planned_mix(plan, budget)


def _planned_mix(plan: _Plan, budget: int) -> tuple[float, ...] | None:
    """The step features (:meth:`.inputs.StepSample.features` order) one request of the planned
    load brings to this pool at its model count (else its current one): prefill chunks, prompt
    tokens and attention pairs on a prefill pool, ``output / batch`` steps of ``batch`` rows on
    a decode pool, both on an aggregated one. A fit from windows of another mix extrapolates to
    it (batch-1 windows say nothing of a batch of 8)."""
    load, estimate = plan.workload, plan.estimate
    if load is None or estimate is None:
        return None
    replicas = plan.model_replicas or max(1, plan.pool.current_replicas)
    role = plan.pool.role
    chunks = float(math.ceil(load.uncached_tokens / max(1, budget))) if load.uncached_tokens > 0 else 0.0
    prefill = (chunks, load.uncached_tokens, load.prefill_pairs, 0.0, 0.0)
    if role == ROLE_PREFILL:
        return prefill
    decode = estimate(replicas, load).decode
    if decode is not None and math.isfinite(decode.batch):
        batch = decode.batch
    else:  # unstable by this fit: at least the rows that arrive during a batch-1 step
        theta = plan.theta
        assert theta is not None
        one_row = theta.step + theta.decode_row + theta.decode_context * load.decode_context
        batch = load.request_rate * load.output_tokens / replicas * one_row
    rows = max(load.output_tokens, 0.0)
    steps = rows / max(1.0, batch)
    decoding = (steps, 0.0, 0.0, rows, rows * load.decode_context)
    if role == ROLE_DECODE:
        return decoding
    return tuple(a + b for a, b in zip(prefill, decoding, strict=True))


def _first_decode_step(decode_plans: list[_Plan], load: Workload) -> float:
    """Mean step time of the decode pool(s) at their model count (0 when unknown)."""
    steps = []
    for d in decode_plans:
        if d.estimate is None or d.model_replicas is None:
            continue
        decode = d.estimate(d.model_replicas, load).decode
        if decode is not None:
            steps.append(decode.step_seconds)
    return max(steps, default=0.0)


def _serving(pool: PoolSloObservation) -> float:
    """Pods that drain the backlog over the next pod start time: the Ready ones. Starting
    pods are not counted (one requested a moment ago serves only after the full start time;
    counting them let a growing queue look like a shrinking one in the simulator)."""
    return float(pool.ready_replicas)


def _backlog(pool: PoolSloObservation) -> Backlog:
    return Backlog(
        requests_waiting=max(0.0, pool.requests_waiting), prompt_tokens_waiting=max(0.0, pool.prompt_tokens_waiting)
    )


def _fewest(plan: _Plan, slo: SloTarget, workload: Workload) -> tuple[int, bool]:
    """``(n, attainable)``: the fewest replicas in [1, max] meeting the SLO, or max."""
    top = max(1, plan.policy.max_replicas)
    for n in range(1, top + 1):
        if plan.meets(n, slo, workload):
            return n, True
    return top, False


def _search(plan: _Plan, slo: SloTarget) -> None:
    if plan.workload is None or plan.estimate is None:
        return
    plan.model_replicas, attainable = _fewest(plan, slo, plan.workload)
    plan.unattainable = not attainable
    if plan.current_workload is not None:
        plan.model_replicas_now, _ = _fewest(plan, slo, plan.current_workload)


# ---------------------------------------------------------------------------- deciding
def _decide_pool(
    plan: _Plan,
    *,
    inputs: SloInputs,
    slo: SloTarget,
    history: RecommendationHistory,
    gpus: int,
    floor: int | None,
    measured_ttft: float | None,
    measured_itl: float | None,
    dry_run: bool,
) -> Decision:
    pool, policy = plan.pool, plan.policy
    current, ready = pool.current_replicas, pool.ready_replicas
    wants_ttft, wants_itl = plan.metrics()
    signals: dict[str, SignalValue] = {}
    if wants_ttft and measured_ttft is not None:
        signals["ttftP99"] = SignalValue(value=measured_ttft, target=slo.ttft_p99_seconds)
    if wants_itl and measured_itl is not None:
        signals["itlP99"] = SignalValue(value=measured_itl, target=slo.itl_p99_seconds)
    measured_ratio = max((s.ratio for s in signals.values()), default=None)

    stages = [_describe_inputs(plan, slo)]
    gate: str | None = None
    reactive: int | None = None
    passed = _passed_violation(plan, signals, slo) if measured_ratio is not None and measured_ratio > 1.0 else None
    if passed is None and measured_ratio is not None and measured_ratio > 1.0:
        reactive = math.ceil(max(ready, 1) * min(measured_ratio, REACTIVE_MAX_FACTOR) - 1e-9)

    model = plan.model_replicas
    if model is None and reactive is None and (floor is None or floor <= current):
        why = "no load observed" if plan.workload is None else "no step model (no prior, too little data)"
        return _hold(
            plan,
            slo=slo,
            now=inputs.now_seconds,
            history=history,
            gpus=gpus,
            signals=signals,
            measured_ratio=measured_ratio,
            why=why,
            dry_run=dry_run,
            stages=stages,
        )

    proposal = current
    if model is not None:
        stages.append(_describe_model(plan, slo))
    if passed is not None:
        stages.append(f"measured {_signal_terms(signals)} > target, not acted on: {passed}")
    if reactive is not None:
        assert measured_ratio is not None
        factor = min(measured_ratio, REACTIVE_MAX_FACTOR)
        stages.append(
            f"measured {_signal_terms(signals)} > target → reactive ceil({max(ready, 1)} ready × "
            f"{factor:.2f}) = {reactive}"
        )
    if model is not None and model > current and slo.prior is None and plan.confidence < MIN_CONFIDENCE_TO_SCALE_UP:
        # a fit from a few windows and no prior can be wildly off (e2e: 1.4 s per decode row
        # from a prefill pod's windows); it may not add pods on its own, measured latency may
        stages.append(
            f"model {model} ignored for scale-up (no prior, confidence {plan.confidence:.2f} < "
            f"{MIN_CONFIDENCE_TO_SCALE_UP:g})"
        )
        model = current
    if model is not None:
        proposal = model
        if model < current:
            proposal, gate, evidence = _gate_scale_down(
                plan, slo=slo, model=model, signals=signals, measured_ratio=measured_ratio
            )
            if evidence is not None:
                stages.append(f"scale-down on measurements ({evidence}) → {proposal}")
            if gate is not None:
                stages.append(f"scale-down refused ({gate}) → keep {current}")
    if reactive is not None and reactive > proposal:
        proposal = reactive
    if floor is not None and floor > proposal:
        stages.append(f"floor (target tracking) {floor}")
        proposal = floor
    stages.append(f"proposal {proposal}")
    settled = settle(
        proposal=proposal,
        now_seconds=inputs.now_seconds,
        current_replicas=current,
        pending_replicas=pool.pending_replicas,
        policy=policy,
        history=history,
        gpus_per_replica=gpus,
    )
    reason = settled.limit_reason or _reason(
        plan, result=settled.result, proposal=proposal, reactive=reactive, gate=gate, floor=floor
    )
    return Decision(
        pool=plan.name,
        time_seconds=inputs.now_seconds,
        current_replicas=current,
        ready_replicas=ready,
        pending_replicas=pool.pending_replicas,
        min_replicas=policy.min_replicas,
        max_replicas=policy.max_replicas,
        gpus_per_replica=gpus,
        signals=signals,
        ratio=_ratio_now(plan, slo, measured_ratio),
        proposal=proposal,
        stabilized=settled.stabilized,
        step_limited=settled.step_limited,
        result=settled.result,
        reason=reason,
        formula=" → ".join([*stages, *settled.stages]),
        dry_run=dry_run,
        model=_model_fields(plan, slo, settled.result),
    )


def _passed_violation(plan: _Plan, signals: Mapping[str, SignalValue], slo: SloTarget) -> str | None:
    """Why a measured TTFT violation is over and gets no reactive scale-up (None: it is acted on).

    A window's p99 describes the requests of that window; scaling acts on the next ones. A
    TTFT excess whose cause is gone does not recur: when no request waits in the pool at the
    round (the queue that delayed the first tokens has drained) *and* the model (fit or prior)
    says the current count meets the targets at the current load ÷ headroom, the violation
    was a passing cluster of Poisson arrivals, not a lack of pods. Both witnesses are needed:
    without a model (or with a fit below :data:`MIN_CONFIDENCE_TO_SCALE_UP` and no prior, which
    may not add pods either), or with work still queued (unless it drains, below), the
    measurement is acted on. Only
    TTFT: an ITL excess is the decode batch itself, which does not drain between windows.

    A queue that is still there but shrinking since the last round is the same case a little
    earlier: the p99 describes requests that arrived up to one TTFT ago, behind a queue that now
    drains on the Ready pods, and the model's count (which sizes for any drain beyond one pod
    start time) says the current pods suffice, so a pod asked for now would start after the queue
    is gone. That needs the fit's confidence for scale-down (:data:`MIN_CONFIDENCE_TO_SCALE_DOWN`):
    an optimistic model would otherwise explain a real overload away; a growing queue, or no
    previous round, is acted on. After the bursty trace's prompt shift the committed backlog's
    late first tokens read 14 s for two rounds while 7 Ready pods drained it; doubling to 14 pods
    for them cost 3-4 % of the trace's GPU-hours (full size, seeds 2-4; no attainment change).

    Why: on the CI-size steady trace (Poisson, 20 req/s) a cluster of arrivals at 11-13 s gave
    15 first tokens over 1 s, the first window's p99 read 1.18 s, and the reactive correction
    raised the prefill pool from 2 to 3 pods, which the 300 s scale-down window then kept: 6 %
    of the trace's GPU-hours for a load two pods serve at 99.9 % (the queue had drained and the
    model, right within 10 % there, said 2). That rule changes no decision on the bursty trace.
    """
    itl = signals.get("itlP99")
    if itl is not None and itl.value > itl.target:
        return None
    ttft = signals.get("ttftP99")
    if ttft is None or ttft.value <= ttft.target:
        return None
    current = plan.pool.current_replicas
    if plan.model_replicas_now is None or plan.model_replicas_now > current:
        return None
    if slo.prior is None and plan.confidence < MIN_CONFIDENCE_TO_SCALE_UP:
        return None
    meets = f"the model meets it with {plan.model_replicas_now} ≤ {current} replicas at the current load"
    waiting, before = plan.pool.requests_waiting, plan.waiting_before
    if waiting <= 0.0:
        return f"no request waiting and {meets} (a passing cluster)"
    if plan.confidence < MIN_CONFIDENCE_TO_SCALE_DOWN or before is None or not waiting < before:
        return None
    return (
        f"the queue is draining ({before:.0f} → {waiting:.0f} waiting since the last round) and {meets} "
        "(what is left drains before a pod asked for now would start)"
    )


def _gate_scale_down(
    plan: _Plan, *, slo: SloTarget, model: int, signals: Mapping[str, SignalValue], measured_ratio: float | None
) -> tuple[int, str | None, str | None]:
    """The count a model-driven scale-down may go to, why not when it may not, and the
    measured evidence when a fit of low confidence is overruled (:func:`_measured_scale_down`).

    The N-1 check corrects the model by what was measured: when the measured p99 at the
    current count is above the model's estimate there (under the current load), the
    estimates at fewer replicas are scaled up by the same factor before they are compared
    with the targets at the load ÷ headroom (a model that is optimistic now is optimistic at N-1 too).
    """
    current = plan.pool.current_replicas
    if plan.confidence < MIN_CONFIDENCE_TO_SCALE_DOWN:
        evidence = _measured_scale_down(plan, slo=slo, measured_ratio=measured_ratio)
        if evidence is not None:
            return max(model, current - 1), None, evidence
        return current, f"confidence {plan.confidence:.2f} < {MIN_CONFIDENCE_TO_SCALE_DOWN:g}", None
    if measured_ratio is not None and measured_ratio > 1.0:
        return current, f"measured {measured_ratio:.2f} of target > 1", None
    correction = _correction(plan, signals)
    lowest_step = max(model, current - plan.policy.behavior.scale_down_max_step)
    for n in sorted({current - 1, lowest_step}):
        if n < 1:
            continue
        assert plan.estimate is not None and plan.workload is not None
        ratios = plan.ratios(plan.estimate(n, plan.workload.with_margin(slo.headroom)), slo)
        worst = max((r * c for r, c in zip(ratios, correction, strict=True) if r is not None), default=0.0)
        if worst > 1.0 + 1e-12:
            factor = max(correction)
            corrected = f", model × measured/estimated {factor:.2f}" if factor > 1.0 else ""
            return (
                current,
                (f"N-1 check: {n} replicas at {worst:.2f} of target (load ÷ {slo.headroom:g}{corrected}) > 1"),
                None,
            )
    return model, None, None


def _measured_scale_down(plan: _Plan, *, slo: SloTarget, measured_ratio: float | None) -> str | None:
    """Why one replica fewer is safe on measurements alone, when the fit is not trusted (None: it is not).

    A fit whose relative error stays high (noisy CPU pods: 0.3-0.5 in the e2e runs) never reaches
    :data:`MIN_CONFIDENCE_TO_SCALE_DOWN`; without this a burst would keep its replicas forever.
    One step down is taken when the pool served no request and queues nothing in the window, or
    when its measured p99 would stay within half of ``headroom × target`` even if the latency grew in
    proportion to the load per replica (``measured × N/(N-1)``) — far from the knee where queueing
    latency grows faster than that.
    """
    current = plan.pool.current_replicas
    if current <= 1:
        return None
    idle = (plan.current_workload is None or plan.current_workload.request_rate <= 0.0) and (
        plan.pool.requests_waiting <= 0.0 and plan.pool.requests_running <= 0.0
    )
    if measured_ratio is None:
        return "idle: no request in the window" if idle else None
    scaled = measured_ratio * current / (current - 1)
    if scaled <= MEASURED_SCALE_DOWN_FRACTION * slo.headroom:
        return (
            f"low confidence {plan.confidence:.2f}, but measured {measured_ratio:.2f} of target × "
            f"{current}/{current - 1} = {scaled:.2f} <= {MEASURED_SCALE_DOWN_FRACTION:g} × headroom"
        )
    return None


def _correction(plan: _Plan, signals: Mapping[str, SignalValue]) -> tuple[float, float]:
    """``max(1, measured / estimated)`` at the current count and load, for (TTFT, ITL)."""
    if plan.estimate is None or plan.current_workload is None or plan.pool.current_replicas < 1:
        return 1.0, 1.0
    now = plan.estimate(plan.pool.current_replicas, plan.current_workload)
    factors = []
    for key, estimated in (("ttftP99", now.ttft_seconds), ("itlP99", now.itl_seconds)):
        signal = signals.get(key)
        if signal is None or not math.isfinite(estimated) or estimated <= 0.0:
            factors.append(1.0)
        else:
            factors.append(max(1.0, signal.value / estimated))
    return factors[0], factors[1]


def _reason(
    plan: _Plan, *, result: int, proposal: int, reactive: int | None, gate: str | None, floor: int | None
) -> str:
    current = plan.pool.current_replicas
    if result > current:
        if reactive is not None and reactive >= proposal:
            return Reason.SLO_VIOLATED
        if plan.unattainable and plan.model_replicas == proposal:
            return Reason.SLO_UNATTAINABLE
        if (
            plan.model_replicas is not None
            and plan.model_replicas_now is not None
            and plan.model_replicas == proposal
            and plan.model_replicas_now < plan.model_replicas
        ):
            return Reason.SLO_FORECAST
        if plan.model_replicas is not None and plan.model_replicas == proposal:
            return Reason.SLO_PREDICTED
        return Reason.SCALED_UP
    if result < current:
        return Reason.SCALED_DOWN
    if gate is not None:
        return Reason.SLO_LOW_CONFIDENCE if gate.startswith("confidence") else Reason.SLO_SCALE_DOWN_UNSAFE
    if proposal != current:
        return Reason.STABILIZING
    if reactive is not None:
        return Reason.SLO_VIOLATED
    if plan.unattainable:
        return Reason.SLO_UNATTAINABLE
    return Reason.SLO_MET


def _hold(
    plan: _Plan,
    *,
    slo: SloTarget,
    now: float,
    history: RecommendationHistory,
    gpus: int,
    signals: Mapping[str, SignalValue],
    measured_ratio: float | None,
    why: str,
    dry_run: bool,
    stages: list[str],
) -> Decision:
    pool, policy = plan.pool, plan.policy
    current = pool.current_replicas
    history.record(
        time_seconds=now,
        replicas=current,
        keep_seconds=max(
            policy.behavior.scale_up_stabilization_seconds, policy.behavior.scale_down_stabilization_seconds
        ),
    )
    result = max(policy.min_replicas, min(policy.max_replicas, current))
    return Decision(
        pool=plan.name,
        time_seconds=now,
        current_replicas=current,
        ready_replicas=pool.ready_replicas,
        pending_replicas=pool.pending_replicas,
        min_replicas=policy.min_replicas,
        max_replicas=policy.max_replicas,
        gpus_per_replica=gpus,
        signals=dict(signals),
        ratio=None,
        proposal=current,
        stabilized=current,
        step_limited=current,
        result=result,
        reason=Reason.SLO_MODEL_UNAVAILABLE,
        hold=True,
        dry_run=dry_run,
        message=why,
        formula=" → ".join(
            [*stages, f"hold {current} ({why})", f"clamped [{policy.min_replicas},{policy.max_replicas}] {result}"]
        ),
        model=_model_fields(plan, slo, result),
    )


def _ratio_now(plan: _Plan, slo: SloTarget, measured_ratio: float | None) -> float | None:
    """Estimate/target at the current count under the planned load (measured when no model)."""
    if plan.estimate is not None and plan.workload is not None and plan.pool.current_replicas > 0:
        score = plan.score(plan.estimate(plan.pool.current_replicas, plan.workload), slo)
        return score if math.isfinite(score) else SCORE_CAP
    return measured_ratio


# ---------------------------------------------------------------------------- explaining
def _signal_terms(signals: Mapping[str, SignalValue]) -> str:
    return ", ".join(f"{name} {s.value:.3f}s/{s.target:g}s" for name, s in sorted(signals.items()))


def _seconds(value: float) -> str:
    return f"{value:.3f}s" if math.isfinite(value) else "inf"


def _describe_inputs(plan: _Plan, slo: SloTarget) -> str:
    head = (
        f"slo ttft {slo.ttft_p99_seconds:g}s itl {slo.itl_p99_seconds:g}s @ q{slo.attainment:g}, "
        f"headroom {slo.headroom:g}"
    )
    w = plan.workload
    if w is None:
        return f"{head}; load unknown"
    forecast = (
        f" (forecast {plan.forecast_rate:.2f}/s @ {plan.horizon_seconds:.0f}s)"
        if plan.forecast_rate is not None
        else ""
    )
    fit = plan.fit
    windows = fit.points if fit else 0
    model = (
        "θ none"
        if plan.theta is None
        else (
            f"θ conf {plan.confidence:.2f} at the planned mix (fit {fit.confidence:.2f}, {windows} windows)"
            if plan.mix is not None and fit is not None
            else f"θ conf {plan.confidence:.2f} ({windows} windows)"
        )
    )
    return (
        f"{head}; plan λ {w.request_rate:.2f}/s{forecast}, prompt {w.prompt_tokens:.0f} "
        f"(hit {w.prefix_hit_ratio:.2f}), output {w.output_tokens:.0f}; {model}"
    )


def _describe_model(plan: _Plan, slo: SloTarget) -> str:
    assert plan.model_replicas is not None and plan.estimate is not None and plan.workload is not None
    n = plan.model_replicas
    margin = plan.workload.with_margin(slo.headroom)
    at = plan.estimate(n, margin)
    terms = _estimate_terms(plan, at)
    load = f"at λ/{slo.headroom:g} = {margin.request_rate:.2f}/s"
    head = f"fewest N meeting the targets {load}: {n} ({terms})"
    if plan.unattainable:
        head = f"no N ≤ {plan.policy.max_replicas} meets the targets {load}: {n} ({terms})"
    if n > 1:
        below = plan.estimate(n - 1, margin)
        head += f"; at {n - 1}: {_estimate_terms(plan, below, detail=False)}"
    return head


def _estimate_terms(plan: _Plan, estimate: LatencyEstimate, *, detail: bool = True) -> str:
    ttft, itl = plan.metrics()
    parts = []
    if ttft:
        parts.append(f"TTFT {_seconds(estimate.ttft_seconds)}")
        if detail and estimate.prefill is not None and math.isfinite(estimate.prefill.ttft_seconds):
            p = estimate.prefill
            parts.append(
                f"= drain {_seconds(p.drain_seconds)} + wait {_seconds(p.queue_seconds)} + prefill "
                f"{_seconds(p.prefill_seconds)}"
                + (
                    f" + first step {_seconds(estimate.ttft_seconds - p.ttft_seconds)}"
                    if plan.pool.role == ROLE_PREFILL
                    else ""
                )
                + f", ρ {p.utilization:.2f}"
            )
    if itl:
        parts.append(f"ITL {_seconds(estimate.itl_seconds)}")
        if detail and estimate.decode is not None and math.isfinite(estimate.decode.batch):
            parts.append(f"batch {estimate.decode.batch:.1f}")
    return " ".join(parts)


def _model_fields(plan: _Plan, slo: SloTarget, result: int) -> dict[str, float]:
    """``lastDecision.model``: the fit, the planned load and the estimates at ``result``; only
    finite numbers (an unstable estimate is infinite, and JSON, so the status, has no Infinity)."""
    out: dict[str, float] = {}
    if plan.theta is not None:
        for name, value in zip(COEFFICIENT_NAMES, plan.theta.as_tuple(), strict=True):
            out[_CAMEL[name]] = value
    if plan.fit is not None:
        out["confidence"] = round(plan.confidence, 4)
        out["points"] = float(plan.fit.points)
        error = plan.fit.relative_error
        if error is not None:
            out["relativeError"] = round(error, 4)
    out["horizonSeconds"] = round(plan.horizon_seconds, 1)
    if plan.current_workload is not None:
        out["requestRate"] = round(plan.current_workload.request_rate, 4)
    if plan.forecast_rate is not None:
        out["forecastRate"] = round(plan.forecast_rate, 4)
    if plan.workload is not None:
        w = plan.workload
        out.update(
            planRate=round(w.request_rate, 4),
            promptTokens=round(w.prompt_tokens, 1),
            outputTokens=round(w.output_tokens, 1),
            prefixHitRatio=round(w.prefix_hit_ratio, 4),
        )
    if plan.model_replicas is not None:
        out["modelReplicas"] = float(plan.model_replicas)
    if plan.estimate is not None and plan.workload is not None and result > 0:
        at = plan.estimate(result, plan.workload)
        ttft, itl = plan.metrics()
        values = {
            "ttftEstimateSeconds": at.ttft_seconds if ttft else math.nan,
            "itlEstimateSeconds": at.itl_seconds if itl else math.nan,
        }
        if at.prefill is not None:
            values["prefillUtilization"] = at.prefill.utilization
        if at.decode is not None:
            values["decodeBatch"] = at.decode.batch
        out.update({k: round(v, 6) for k, v in values.items()})
    return {k: v for k, v in out.items() if math.isfinite(v)}


# ---------------------------------------------------------------------------- GPU budget
def _budget_score(plan: _Plan, slo: SloTarget, replicas: int, decision: Decision) -> float:
    """How far the pool misses its SLO at ``replicas`` (the budget trade's currency)."""
    if replicas <= 0:
        return SCORE_CAP * 2
    if plan.estimate is not None and plan.workload is not None:
        estimate = plan.estimate(replicas, plan.workload)
        score = plan.score(estimate, slo)
        if math.isfinite(score):
            return min(score, SCORE_CAP)
        utilization = max(
            (
                e.utilization
                for e in (estimate.prefill, estimate.decode)
                if e is not None and math.isfinite(e.utilization)
            ),
            default=SCORE_CAP,
        )
        return SCORE_CAP * (1.0 + utilization)
    ratio = max((s.ratio for s in decision.signals.values()), default=1.0)
    return ratio * max(decision.ready_replicas, 1) / replicas


def _trade_budget(
    decisions: list[Decision], *, plans: Mapping[str, _Plan], slo: SloTarget, gpu_budget: int | None
) -> list[Decision]:
    """Step 7 of the module docstring: :func:`~..decision.grant_gpu_budget` with the SLO gain per GPU as priority."""

    def gain(d: Decision, replicas: int) -> float:
        plan = plans[d.pool]
        return (_budget_score(plan, slo, replicas, d) - _budget_score(plan, slo, replicas + 1, d)) / max(
            d.gpus_per_replica, 1
        )

    grants = grant_gpu_budget(decisions, gpu_budget=gpu_budget, priority=gain)
    if grants is None:
        return decisions
    granted, trail = grants
    out: list[Decision] = []
    for d in decisions:
        trimmed = trimmed_to(d, granted)
        out.append(
            d
            if trimmed is None
            else dataclasses.replace(
                d,
                result=trimmed,
                reason=Reason.GPU_BUDGET_LIMITED,
                formula=f"{d.formula} → joint gpu-budget {gpu_budget} (grants: {', '.join(trail) or 'none'}) {trimmed}",
                model=_model_fields(plans[d.pool], slo, trimmed),
            )
        )
    return out
