"""The SLO controller's decisions: which pool moves, which gates hold, how the budget is traded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from slo_testing import TRUTH, decode_fit, inputs, load, pool, trained_fit

from splitserve_contract import Reason
from splitserve_operator.autoscaler.decision import (
    Behavior,
    Decision,
    PoolPolicy,
    RecommendationHistory,
)
from splitserve_operator.autoscaler.slo import (
    LoadObservation,
    PoolSloObservation,
    SloState,
    SloTarget,
    StepCoefficients,
    StepFit,
    decide_slo,
)
from splitserve_operator.autoscaler.slo.controller import _plan_load

NOW = 1000.0
SLO = SloTarget(ttft_p99_seconds=0.5, itl_p99_seconds=0.05, attainment=0.99, headroom=0.8, prior=TRUTH)
DOWN_AT_ONCE = Behavior(scale_down_stabilization_seconds=0.0)


def state(
    pools: Mapping[str, PoolSloObservation],
    *,
    rate: float | None,
    prior: StepCoefficients | None = TRUTH,
    trained: bool = True,
    ramp: float = 0.0,
    **shape: float,
) -> SloState:
    """Fits trained on TRUTH (confident) or fresh, and a forecaster that has seen the load
    for ten windows (rising by ``ramp`` requests/s per window)."""
    out = SloState.fresh()
    for name, p in pools.items():
        out.fits[name] = (
            trained_fit(TRUTH, role=p.role, prior=prior, until=NOW) if trained else StepFit.fresh(prior=prior)
        )
    if rate is not None:
        for i in range(10):
            out.forecaster.update(load(rate - ramp * (9 - i), **shape), now_seconds=NOW - 15.0 * (9 - i))
    return out


def decide(
    pools: dict[str, PoolSloObservation],
    *,
    rate: float | None,
    slo: SloTarget = SLO,
    behavior: Behavior = DOWN_AT_ONCE,
    floors: dict[str, int] | None = None,
    gpu_budget: int | None = None,
    slo_state: SloState | None = None,
    histories: dict[str, RecommendationHistory] | None = None,
    dry_run: bool = False,
    prompt: float = 1000.0,
    output: float = 200.0,
) -> dict[str, Decision]:
    st = slo_state if slo_state is not None else state(pools, rate=rate, prompt=prompt, output=output)
    decisions = decide_slo(
        inputs=inputs(NOW, pools, rate, prompt=prompt, output=output),
        slo=slo,
        state=st,
        policies={name: PoolPolicy(min_replicas=1, max_replicas=16, behavior=behavior) for name in pools},
        histories=histories or {name: RecommendationHistory() for name in pools},
        gpus_per_replica={name: 1 for name in pools},
        floors=floors,
        gpu_budget=gpu_budget,
        max_num_batched_tokens=2048,
        dry_run=dry_run,
    )
    assert [d.pool for d in decisions] == sorted(pools)
    return {d.pool: d for d in decisions}


def disagg(prefill: int, decode: int, **observed: float | None) -> dict[str, PoolSloObservation]:
    ttft, itl = observed.get("ttft"), observed.get("itl")
    return {
        "prefill": pool("prefill", current=prefill, ttft=ttft, itl=itl),
        "decode": pool("decode", current=decode, ttft=ttft, itl=itl),
    }


def test_model_keeps_a_pool_that_meets_the_slo_and_explains_it() -> None:
    out = decide(disagg(2, 2), rate=8.0)
    for name in ("prefill", "decode"):
        d = out[name]
        assert (d.result, d.reason) == (2, Reason.SLO_MET), d.formula
        assert "fewest N meeting the targets at λ/0.8 = 10.00/s: 2" in d.formula and "at 1:" in d.formula
        assert d.model is not None and d.model["modelReplicas"] == 2 and d.model["confidence"] > 0.8
        assert d.model["planRate"] == 8.0 and "step" in d.model
    assert out["prefill"].model is not None and 0 < out["prefill"].model["ttftEstimateSeconds"] < 0.4
    assert out["decode"].model is not None and 0 < out["decode"].model["itlEstimateSeconds"] < 0.04
    assert out["prefill"].inputs()["currentReplicas"] == 2.0


def test_ttft_violation_scales_prefill_not_decode() -> None:
    histories = {
        "prefill": RecommendationHistory.fresh(now_seconds=NOW - 1, current_replicas=2),
        "decode": RecommendationHistory.fresh(now_seconds=NOW - 1, current_replicas=2),
    }
    queued = {
        "prefill": pool("prefill", current=2, ttft=0.7, itl=0.02, waiting=6.0, waiting_tokens=6000.0),
        "decode": pool("decode", current=2, ttft=0.7, itl=0.02),
    }
    out = decide(queued, rate=8.0, behavior=Behavior(), histories=histories)
    assert (out["prefill"].result, out["prefill"].reason) == (3, Reason.SLO_VIOLATED), out["prefill"].formula
    assert "reactive ceil(2 ready × 1.40) = 3" in out["prefill"].formula
    assert out["decode"].result == 2 and out["decode"].reason != Reason.SLO_VIOLATED


def test_a_ttft_violation_that_left_no_queue_and_that_the_model_explains_is_not_chased() -> None:
    """A window's p99 over target with nothing waiting at the round, while the model says the
    current count meets the SLO, is a passing cluster: no reactive pod (it would be kept for the
    whole scale-down window). A queue, or a model that wants more pods, makes it act again."""
    histories = {
        "prefill": RecommendationHistory.fresh(now_seconds=NOW - 1, current_replicas=2),
        "decode": RecommendationHistory.fresh(now_seconds=NOW - 1, current_replicas=2),
    }
    drained = decide(disagg(2, 2, ttft=0.7, itl=0.02), rate=8.0, behavior=Behavior(), histories=dict(histories))
    prefill = drained["prefill"]
    assert (prefill.result, prefill.reason) == (2, Reason.SLO_MET), prefill.formula
    assert "not acted on: no request waiting and the model meets it with 2 ≤ 2" in prefill.formula
    assert "reactive" not in prefill.formula
    one_waiting = {
        "prefill": pool("prefill", current=2, ttft=0.7, itl=0.02, waiting=1.0, waiting_tokens=1000.0),
        "decode": pool("decode", current=2),
    }
    assert decide(one_waiting, rate=8.0)["prefill"].reason == Reason.SLO_VIOLATED
    # at 16 req/s the model itself wants more than 2 prefill pods: the measurement is acted on
    busier = decide(disagg(2, 2, ttft=0.7, itl=0.02), rate=16.0)["prefill"]
    assert busier.result > 2 and "not acted on" not in busier.formula, busier.formula
    # a fit too young to add pods without a prior is too young to overrule a measurement
    no_prior = SloTarget(ttft_p99_seconds=0.5, itl_p99_seconds=0.05, attainment=0.99, headroom=0.8, prior=None)
    pools = disagg(2, 2, ttft=0.7, itl=0.02)
    shaky = decide(pools, rate=8.0, slo=no_prior, slo_state=state(pools, rate=8.0, prior=TRUTH, trained=False))
    assert shaky["prefill"].reason == Reason.SLO_VIOLATED, shaky["prefill"].formula


def test_a_ttft_violation_whose_queue_is_draining_is_not_chased_by_a_trusted_model() -> None:
    """A measured p99 describes requests that arrived up to one TTFT earlier: after a burst the
    window's p99 stays high while the queue that caused it drains on the Ready pods, faster than a
    pod asked for now could start. With the queue shrinking since the last round and a trusted fit
    (confidence for scale-down) whose count the current one meets, the measurement is not chased;
    a growing queue, a first round, or a young fit act as before."""

    def prefill_decision(*, waiting: float, before: float | None, trained: bool = True) -> Decision:
        pools = {
            "prefill": pool("prefill", current=2, ttft=3.0, itl=0.02, waiting=waiting, waiting_tokens=1000.0 * waiting),
            "decode": pool("decode", current=2),
        }
        st = state(pools, rate=8.0, trained=trained)
        if before is not None:
            st.waiting_before["prefill"] = before
        return decide(pools, rate=8.0, slo_state=st)["prefill"]

    draining = prefill_decision(waiting=3.0, before=40.0)
    assert (draining.result, draining.reason) == (2, Reason.SLO_MET), draining.formula
    assert "not acted on: the queue is draining (40 → 3 waiting since the last round)" in draining.formula
    for growing in (
        prefill_decision(waiting=3.0, before=1.0),
        prefill_decision(waiting=3.0, before=None),
        prefill_decision(waiting=3.0, before=40.0, trained=False),
    ):
        assert growing.reason == Reason.SLO_VIOLATED and growing.result > 2, growing.formula


def test_the_state_remembers_each_pools_queue_over_two_rounds() -> None:
    st = SloState.fresh()
    for now, waiting in ((NOW, 12.0), (NOW + 15.0, 5.0)):
        st.observe(inputs(now, {"prefill": pool("prefill", current=2, waiting=waiting)}, 8.0), SLO)
    assert (st.waiting_before["prefill"], st.waiting["prefill"]) == (12.0, 5.0)


def test_itl_violation_scales_decode_not_prefill() -> None:
    out = decide(disagg(2, 2, ttft=0.2, itl=0.07), rate=8.0)
    assert (out["decode"].result, out["decode"].reason) == (3, Reason.SLO_VIOLATED), out["decode"].formula
    assert out["prefill"].result == 2


def test_scale_down_refused_when_n_minus_1_would_violate() -> None:
    """The model says 2 prefill replicas suffice, but at 3 it underestimates the measured
    TTFT by ~2.5×: corrected, 2 replicas would miss the SLO, so 3 are kept."""
    refused = decide(disagg(3, 2, ttft=0.38), rate=8.0)["prefill"]
    assert (refused.result, refused.reason) == (3, Reason.SLO_SCALE_DOWN_UNSAFE), refused.formula
    assert "N-1 check: 2 replicas" in refused.formula
    allowed = decide(disagg(3, 2, ttft=0.15), rate=8.0)["prefill"]
    assert (allowed.result, allowed.reason) == (2, Reason.SCALED_DOWN), allowed.formula


def test_scale_down_refused_while_measured_latency_is_above_headroom() -> None:
    d = decide(disagg(3, 2, ttft=0.45), rate=8.0)["prefill"]
    assert (d.result, d.reason) == (3, Reason.SLO_SCALE_DOWN_UNSAFE)


def test_low_confidence_blocks_model_driven_scale_down_but_not_scale_up() -> None:
    pools = disagg(4, 4)
    unsure = state(pools, rate=1.0, trained=False)  # the prior alone: confidence 0
    held = decide(pools, rate=1.0, slo_state=unsure)
    for d in held.values():
        assert (d.result, d.reason) == (4, Reason.SLO_LOW_CONFIDENCE), d.formula
    sure = decide(pools, rate=1.0)
    assert all(d.result == 3 and d.reason == Reason.SCALED_DOWN for d in sure.values())
    busy = decide(disagg(1, 1), rate=30.0, slo_state=state(disagg(1, 1), rate=30.0, trained=False))
    assert busy["prefill"].result > 1 and busy["decode"].result > 1


def test_floors_from_target_tracking_are_respected() -> None:
    out = decide(disagg(3, 3), rate=1.0, floors={"prefill": 3, "decode": 1})
    assert out["prefill"].result == 3 and "floor (target tracking) 3" in out["prefill"].formula
    assert out["decode"].result == 2
    raised = decide(disagg(2, 2), rate=1.0, floors={"prefill": 4, "decode": 1})
    assert raised["prefill"].result == 4


def test_pending_pods_hold_scale_up() -> None:
    pools = {
        "prefill": pool("prefill", current=3, pending=1, ready=2, ttft=0.9, waiting=4.0, waiting_tokens=4000.0),
        "decode": pool("decode", current=2),
    }
    d = decide(pools, rate=8.0)["prefill"]
    assert "reactive ceil(2 ready × 1.80) = 4" in d.formula
    assert (d.result, d.reason) == (3, Reason.PENDING_PODS), d.formula


def test_budget_trading_gives_the_gpu_to_the_larger_marginal_gain() -> None:
    # prefill at 1 is far over its TTFT target (ratio ~1.75); decode at 1 just over headroom
    out = decide(disagg(1, 1), rate=8.0, gpu_budget=3)
    assert out["prefill"].result == 2, out["prefill"].formula
    assert (out["decode"].result, out["decode"].reason) == (1, Reason.GPU_BUDGET_LIMITED)
    assert "joint gpu-budget 3 (grants: prefill+1" in out["decode"].formula
    # decode-heavy load: decode at 1 is unstable, prefill only asked for more by its floor
    flipped = decide(disagg(1, 1), rate=6.0, gpu_budget=3, floors={"prefill": 2}, prompt=300.0, output=600.0)
    assert flipped["decode"].result == 2, flipped["decode"].formula
    assert (flipped["prefill"].result, flipped["prefill"].reason) == (1, Reason.GPU_BUDGET_LIMITED)
    roomy = decide(disagg(1, 1), rate=8.0, gpu_budget=4)
    assert roomy["prefill"].result == 2 and roomy["decode"].result == 2


def test_no_model_and_no_load_holds_unless_measured_latency_violates() -> None:
    no_prior = SloTarget(ttft_p99_seconds=0.5, itl_p99_seconds=0.05)
    pools = disagg(2, 2)
    blank = state(pools, rate=None, prior=None, trained=False)
    out = decide(pools, rate=None, slo=no_prior, slo_state=blank)
    for d in out.values():
        assert d.hold and (d.result, d.reason) == (2, Reason.SLO_MODEL_UNAVAILABLE), d.formula
    no_load = decide(pools, rate=None, slo_state=state(pools, rate=None))
    assert all(d.hold and d.reason == Reason.SLO_MODEL_UNAVAILABLE for d in no_load.values())
    violated = decide(
        disagg(2, 2, ttft=1.0, itl=0.02),
        rate=None,
        slo=no_prior,
        slo_state=state(pools, rate=None, prior=None, trained=False),
    )
    assert (violated["prefill"].result, violated["prefill"].reason) == (4, Reason.SLO_VIOLATED)
    assert violated["decode"].result == 2


def test_the_forecast_starts_pods_before_the_load_arrives() -> None:
    pools = disagg(2, 2)
    steady = decide(pools, rate=8.0)
    assert steady["prefill"].result == 2  # 8/s: 2 prefill replicas meet the SLO at 8/0.8 = 10/s, 9/s would not
    rising = state(pools, rate=8.0, ramp=0.75)  # +3 requests/s per minute; 120 s start time
    d = decide(pools, rate=8.0, slo_state=rising)["prefill"]
    assert d.model is not None and d.model["forecastRate"] > 10.0 and d.model["planRate"] == d.model["forecastRate"]
    assert (d.result, d.reason) == (3, Reason.SLO_FORECAST), d.formula


def test_headroom_is_a_margin_on_the_load_not_on_the_targets() -> None:
    """``headroom`` h at λ decides as h = 1 at λ/h: the pools are sized to meet the full targets
    at the load ÷ h (the planned load uses at most h of the SLO capacity), not to meet h × target."""
    loose = replace(SLO, headroom=1.0)
    counts = []
    for rate in (2.0, 4.0, 8.0, 9.0, 12.0, 16.0):
        margin = decide(disagg(2, 2), rate=rate)
        scaled = decide(disagg(2, 2), rate=rate / SLO.headroom, slo=loose)
        plain = decide(disagg(2, 2), rate=rate, slo=loose)
        for name in ("prefill", "decode"):
            with_margin, at_scaled_rate = margin[name].model, scaled[name].model
            assert with_margin is not None and at_scaled_rate is not None
            assert with_margin["modelReplicas"] == at_scaled_rate["modelReplicas"], (rate, name)
            assert margin[name].result >= plain[name].result, (rate, name)
        counts.append((margin["prefill"].result, plain["prefill"].result))
    assert any(m > p for m, p in counts), counts  # the margin costs a pod somewhere in the range
    d = decide(disagg(2, 2), rate=8.0)["decode"]
    assert d.model is not None and "at λ/0.8 = 10.00/s" in d.formula, d.formula


def test_the_planned_rate_is_paired_with_the_current_mix_not_the_previous_one() -> None:
    """After a step from 8 req/s of 200-token outputs to 16 req/s of 1-token outputs the forecaster
    still remembers long outputs; planning 16 req/s × 200 tokens would scale the decode pool for
    work that no request carries (the e2e TTFT step did). The plan takes the window's own mix, and
    the forecaster's only for a window that saw no request."""
    pools = disagg(2, 1)
    before = state(pools, rate=8.0, prompt=1000.0, output=200.0)
    d = decide(pools, rate=16.0, slo_state=before, output=1.0)["decode"]
    assert d.model is not None and d.model["outputTokens"] == 1.0, d.formula
    assert d.result == 1, d.formula
    lagging = decide(pools, rate=16.0, slo_state=state(pools, rate=8.0, prompt=1000.0, output=200.0), output=200.0)
    assert lagging["decode"].result > 1  # the same rate with the long outputs does need more decode pods
    quiet = decide(pools, rate=0.0, slo_state=state(pools, rate=8.0, prompt=1000.0, output=200.0), output=0.0)
    model = quiet["decode"].model
    assert model is not None and model["outputTokens"] == 200.0, quiet["decode"].formula


def test_the_rate_still_to_come_takes_the_newest_requests_lengths() -> None:
    """Two seconds into a step from long to short outputs the window still holds mostly the old
    requests (mean 8 output tokens), while the forecast already counts the new ones: the part of
    the planned rate above the window's is sized with the last interval's mix (1 token), not the
    window's (the e2e TTFT step scaled decode on that pairing). Without a recent mix, or with no
    rate above the window's, the window's lengths stand."""
    current = LoadObservation(
        window_seconds=30.0,
        request_rate=12.0,
        prompt_tokens_mean=400.0,
        output_tokens_mean=8.0,
        prefix_hit_ratio=0.0,
        recent_prompt_tokens_mean=400.0,
        recent_output_tokens_mean=1.0,
    )
    forecast = replace(current, request_rate=20.0, recent_prompt_tokens_mean=None, recent_output_tokens_mean=None)
    planned = _plan_load(current, forecast)
    assert planned is not None and planned.request_rate == 20.0
    assert planned.output_tokens == (12.0 * 8.0 + 8.0 * 1.0) / 20.0 and planned.prompt_tokens == 400.0
    window_only = _plan_load(replace(current, recent_output_tokens_mean=None), forecast)
    assert window_only is not None and window_only.output_tokens == 8.0
    nothing_ahead = _plan_load(current, replace(forecast, request_rate=10.0))
    assert nothing_ahead is not None and (nothing_ahead.request_rate, nothing_ahead.output_tokens) == (12.0, 8.0)


def test_aggregated_pool_answers_for_both_metrics() -> None:
    pools = {"main": pool("aggregated", current=2)}
    calm = decide(pools, rate=0.5)["main"]
    assert calm.result <= 2 and calm.model is not None
    assert "ttftEstimateSeconds" in calm.model and "itlEstimateSeconds" in calm.model
    busy = decide({"main": pool("aggregated", current=2, itl=0.09)}, rate=0.5)["main"]
    assert (busy.result, busy.reason) == (4, Reason.SLO_VIOLATED), busy.formula


def test_queue_backlog_drives_scale_up_when_it_outlasts_a_pod_start() -> None:
    def with_backlog(waiting: float) -> Decision:
        pools = {
            "prefill": pool("prefill", current=2, waiting=waiting, waiting_tokens=waiting * 1000.0),
            "decode": pool("decode", current=2),
        }
        return decide(pools, rate=8.0)["prefill"]

    calm = decide(disagg(2, 2), rate=8.0)["prefill"]
    assert calm.result == 2
    # ~22 s of queued prefill (~25 s while new arrivals come at the margin's 10/s): cleared by
    # the 2 pods well within the 120 s start time
    short = with_backlog(400)
    assert short.result == 2 and "drain 24." in short.formula, short.formula
    # ~220 s of queued prefill: more pods, sized to clear it one start time after they arrive
    long = with_backlog(4000)
    assert long.result > 2 and long.model is not None, long.formula
    assert long.model["ttftEstimateSeconds"] > calm.model["ttftEstimateSeconds"]  # type: ignore[index]


def test_dry_run_is_marked_and_decisions_record_history() -> None:
    histories = {"prefill": RecommendationHistory(), "decode": RecommendationHistory()}
    out = decide(disagg(2, 2), rate=8.0, dry_run=True, histories=histories)
    assert all(d.dry_run and not d.write for d in out.values())
    assert histories["prefill"].samples == [(NOW, 2)]


def test_a_recent_burst_keeps_its_capacity_planned_after_the_rate_drops() -> None:
    """A burst 2 minutes ago: the rate is back to 4/s, which 1 prefill pod would serve, but the
    plan keeps the recent peak (the next burst arrives faster than a pod starts)."""
    pools = disagg(3, 3)
    calm = decide(pools, rate=4.0)["prefill"]
    assert calm.result < 3, calm.formula
    bursty = SloState.fresh()
    bursty.fits = state(pools, rate=None).fits
    for i in range(20):
        t = NOW - 15.0 * (19 - i)
        bursty.forecaster.update(load(12.0 if i < 12 else 4.0), now_seconds=t)
    d = decide(pools, rate=4.0, slo_state=bursty)["prefill"]
    assert d.model is not None and d.model["planRate"] > 8.0, d.formula
    assert d.result == 3, d.formula


def test_low_confidence_steps_down_one_replica_on_measured_evidence_alone() -> None:
    # a fit that never gets confident (noisy CPU pods) must not keep a burst's replicas forever
    ttft_target, itl_target = SLO.ttft_p99_seconds, SLO.itl_p99_seconds
    far_below = disagg(4, 4, ttft=0.05 * ttft_target, itl=0.05 * itl_target)
    unsure = state(far_below, rate=1.0, trained=False)
    out = decide(far_below, rate=1.0, slo_state=unsure)
    for d in out.values():
        assert (d.result, d.reason) == (3, Reason.SCALED_DOWN), d.formula
        assert "scale-down on measurements" in d.formula
    # measured within headroom, but not within half of it once scaled by N/(N-1): held
    near = disagg(4, 4, ttft=0.35 * ttft_target, itl=0.35 * itl_target)
    held = decide(near, rate=1.0, slo_state=state(near, rate=1.0, trained=False))
    assert all((d.result, d.reason) == (4, Reason.SLO_LOW_CONFIDENCE) for d in held.values())
    # idle: no request finished in the window (no latency measured) and nothing queued or running
    idle = disagg(3, 3)
    stepped = decide(idle, rate=0.0, slo_state=state(idle, rate=0.0, trained=False))
    assert all(d.result == 2 and "idle" in d.formula for d in stepped.values())


def test_without_a_prior_a_barely_fitted_model_adds_no_pods_but_measured_violations_do() -> None:
    no_prior = SloTarget(ttft_p99_seconds=0.5, itl_p99_seconds=0.05, attainment=0.99, headroom=0.8, prior=None)
    pools = disagg(1, 1)
    shaky = state(pools, rate=30.0, prior=TRUTH, trained=False)  # coefficients: the prior's; confidence 0
    for fit in shaky.fits.values():
        assert fit.confidence < 0.2
    held = decide(pools, rate=30.0, slo=no_prior, slo_state=shaky)
    for d in held.values():
        assert d.result == 1 and "ignored for scale-up" in d.formula, d.formula
    with_prior = decide(pools, rate=30.0, slo_state=state(pools, rate=30.0, trained=False))
    assert all(d.result > 1 for d in with_prior.values())  # the same model, stated as a prior, may
    violated = disagg(1, 1, ttft=0.9, itl=0.09)
    reactive = decide(violated, rate=30.0, slo=no_prior, slo_state=state(violated, rate=30.0, trained=False))
    assert all(d.result > 1 and d.reason == Reason.SLO_VIOLATED for d in reactive.values())


def test_without_a_prior_a_fit_is_trusted_only_for_the_mix_it_saw() -> None:
    """A decode pool that has only run batches of one: its fit (no prior) explains every
    window, but splits a step's cost between the fixed part and the row arbitrarily, and so
    prices the batches the planned load brings at several times their cost. The controller
    reads the fit's confidence at the planned mix, finds none, and adds no pods on it (a
    measured violation still would); windows of several batch sizes make the same plan count."""
    no_prior = SloTarget(ttft_p99_seconds=0.5, itl_p99_seconds=0.05, attainment=0.99, headroom=0.8, prior=None)
    pools = disagg(2, 1)
    st = state(pools, rate=30.0, prior=None)
    st.fits["decode"] = decode_fit(TRUTH, batches=[1.0] * 12, until=NOW)
    assert st.fits["decode"].confidence > 0.7
    held = decide(pools, rate=30.0, slo=no_prior, slo_state=st)["decode"]
    assert held.result == 1 and "ignored for scale-up" in held.formula, held.formula
    assert "at the planned mix (fit 0.8" in held.formula, held.formula
    st.fits["decode"] = decode_fit(TRUTH, batches=[1.0, 2.0, 4.0, 8.0, 16.0, 3.0, 6.0, 12.0] * 2, until=NOW)
    sized = decide(pools, rate=30.0, slo=no_prior, slo_state=st)["decode"]
    with_prior = decide(pools, rate=30.0)["decode"]
    assert sized.result == with_prior.result > 1, (sized.formula, with_prior.formula)
    assert sized.reason == Reason.SLO_PREDICTED


def test_a_model_driven_scale_up_at_the_current_load_says_so() -> None:
    # steady 30/s, nothing measured yet: the model alone says one pod of each misses the SLO
    pools = disagg(1, 1)
    out = decide(pools, rate=30.0)
    for d in out.values():
        assert d.result > 1 and d.reason == Reason.SLO_PREDICTED, (d.reason, d.formula)
