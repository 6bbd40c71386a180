"""The simulator's observation side for the SLO controller, its traces and the roofline prior."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import pytest

from splitserve_bench.slo_traces import TraceShape, diurnal_rate, make_trace
from splitserve_operator.autoscaler.slo.inputs import StepCoefficients, StepSample
from splitserve_planner.perf_model import RooflineModel
from splitserve_planner.sim.observe import gpu_seconds
from splitserve_planner.sim.state import ARRIVAL, STEP_END
from splitserve_planner.simulator import (
    AGGREGATED,
    DISAGGREGATED,
    AutoscaleSettings,
    FleetConfig,
    SimOptions,
    Simulator,
)
from splitserve_planner.slo_prior import (
    fit_prior,
    prior_manifest,
    representative_steps,
    step_seconds,
)
from splitserve_planner.workload import LengthDist, Request


@dataclass(frozen=True)
class LinearCost:
    """A step cost exactly linear in the engine's inputs, so the step counters must explain it exactly."""

    fixed: float = 4e-3
    per_token: float = 2e-5
    per_pair: float = 3e-9

    @property
    def name(self) -> str:
        return "linear"

    @property
    def kv_capacity_tokens(self) -> int:
        return 200_000

    @property
    def kv_bytes_per_token(self) -> int:
        return 1024

    def step_seconds(self, *, num_tokens: int, num_seqs: int, num_attention_pairs: int, num_kv_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens + self.per_pair * num_attention_pairs

    def coefficients(self) -> StepCoefficients:
        # the engine prices a decode row as one token plus (context + 1) pairs
        return StepCoefficients(
            step=self.fixed,
            prefill_token=self.per_token,
            prefill_pair=self.per_pair,
            decode_row=self.per_token + self.per_pair,
            decode_context=self.per_pair,
        )


def _requests(count: int, *, rate: float, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, size=count))
    prompts = rng.integers(100, 3000, size=count)
    outputs = rng.integers(10, 400, size=count)
    return [Request(i, float(t[i]), int(prompts[i]), int(outputs[i])) for i in range(count)]


def _predicted(sample: StepSample, coefficients: StepCoefficients) -> float:
    return float(np.dot(sample.features(), coefficients.as_tuple()))


@pytest.mark.parametrize("mode", [DISAGGREGATED, AGGREGATED])
def test_window_step_samples_explain_the_busy_time_exactly(mode: str) -> None:
    cost = LinearCost()
    fleet = (
        FleetConfig(mode=mode, prefill_replicas=2, decode_replicas=2, autoscale=AutoscaleSettings(max_replicas=2))
        if mode == DISAGGREGATED
        else FleetConfig(mode=mode, aggregated_replicas=2, autoscale=AutoscaleSettings(max_replicas=2))
    )
    sim = Simulator(fleet=fleet, perf=cost, requests=_requests(600, rate=6.0), options=SimOptions())
    sim._init_observer()
    sim._push(sim.requests[0].arrival_seconds, ARRIVAL, 0)
    windows = []
    for end in np.arange(15.0, 100.0, 15.0):
        while sim.events and sim.events[0][0] <= end:  # the event loop by hand, up to each tick
            at, _, kind, payload = heapq.heappop(sim.events)
            sim.now = at
            if kind == STEP_END:
                if at == payload.step_end_s:
                    sim._step_end(payload)
            else:
                sim._dispatch(kind, payload)
        sim.now = float(end)
        windows.append(sim._observe_window(quantile=0.99))
    samples = [s for w in windows for p in w.pools.values() for s in p.step_samples]
    assert len(samples) >= 10
    assert any(s.prefill_tokens > 0 for s in samples) and any(s.decode_rows > 0 for s in samples)
    truth = cost.coefficients()
    for sample in samples:
        assert _predicted(sample, truth) == pytest.approx(sample.seconds, rel=1e-6)
    # windows are deltas: summed per pod they are the pod's counters (minus steps still running)
    total = sum(s.seconds for s in samples)
    assert total <= sum(p.counters.seconds for p in sim.all_pods) + 1e-9
    assert total > 0.9 * sum(p.counters.seconds for p in sim.all_pods)
    loads = [w.load for w in windows if w.load is not None]
    assert loads and 3.0 < np.mean([load.request_rate for load in loads]) < 9.0
    assert all(w.pools[next(iter(w.pools))].ttft_p99_seconds is not None for w in windows[1:])


def test_drained_pods_leave_the_window_and_give_their_gpu_back(llama8b_h100: RooflineModel) -> None:
    burst = [Request(i, 0.02 * i, 4000, 300) for i in range(6000)]  # 50 req/s for 120 s, then a trickle
    quiet = [Request(6000 + i, 120.0 + 2.0 * i, 500, 50) for i in range(300)]
    settings = AutoscaleSettings(interval_seconds=15, startup_seconds=20, scale_down_stabilization_seconds=30)
    fleet = FleetConfig(mode=DISAGGREGATED, prefill_replicas=1, decode_replicas=1, autoscale=settings)
    sim = Simulator(
        fleet=fleet, perf=llama8b_h100, requests=burst + quiet, options=SimOptions(sample_interval_seconds=5)
    )
    sim.run()
    removed = [p for p in sim.all_pods if not p.accepting]
    assert removed, "the burst should have been scaled up and back down"
    assert all(p.gone_s >= p.born_s for p in removed)
    end = quiet[-1].arrival_seconds
    held = gpu_seconds(sim.all_pods, start_s=0.0, end_s=end, gpus_per_replica=1)
    assert held < len(sim.all_pods) * end  # removed pods stopped counting once drained
    assert held >= 2 * end  # the two pods that were always there


def test_traces_are_seeded_and_shaped() -> None:
    shape = TraceShape(
        mean_rate=10.0,
        duration_seconds=1200.0,
        prompt_tokens=LengthDist(kind="fixed", mean=500),
        shifted_prompt_tokens=LengthDist(kind="fixed", mean=3000),
        burst_factor=4.0,
        burst_seconds=120.0,
    )
    for kind in ("steady", "diurnal", "bursty-shift"):
        a, b = make_trace(kind, shape, seed=3), make_trace(kind, shape, seed=3)
        assert [(r.arrival_seconds, r.num_prompt_tokens) for r in a] == [
            (r.arrival_seconds, r.num_prompt_tokens) for r in b
        ]
        assert 0.8 * 12000 < len(a) < 1.2 * 12000
        assert a != make_trace(kind, shape, seed=4)
    diurnal = make_trace("diurnal", shape, seed=3)
    edges = sum(1 for r in diurnal if r.arrival_seconds < 200 or r.arrival_seconds >= 1000)
    middle = sum(1 for r in diurnal if 500 <= r.arrival_seconds < 700)
    assert middle > 1.8 * edges / 2  # per 200 s, the middle is much busier than the ends
    assert diurnal_rate(shape, 0.0) == pytest.approx(shape.diurnal_trough * diurnal_rate(shape, 600.0))
    shifted = make_trace("bursty-shift", shape, seed=3)
    assert {r.num_prompt_tokens for r in shifted if r.arrival_seconds < 600} == {500}
    assert {r.num_prompt_tokens for r in shifted if r.arrival_seconds >= 600} == {3000}
    counts = np.histogram([r.arrival_seconds for r in shifted], bins=40, range=(0, 1200))[0]
    assert counts.max() > 2.5 * max(counts.min(), 1)  # bursts: a 2-state MMPP, not Poisson
    with pytest.raises(ValueError, match="unknown trace"):
        make_trace("weekly", shape, seed=0)


def test_prior_fit_recovers_a_linear_model_and_approximates_the_roofline(llama8b_h100: RooflineModel) -> None:
    cost = LinearCost()
    exact = fit_prior(cost, max_batched_tokens=8192, max_num_seqs=256)
    for got, want in zip(exact.coefficients.as_tuple(), cost.coefficients().as_tuple(), strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15)
    assert exact.relative_rms_error < 1e-9
    roofline = fit_prior(llama8b_h100, max_batched_tokens=8192, max_num_seqs=256)
    assert all(v >= 0 for v in roofline.coefficients.as_tuple())
    assert roofline.relative_rms_error < 0.25
    steps = representative_steps(
        max_batched_tokens=8192, max_num_seqs=256, kv_capacity_tokens=llama8b_h100.kv_capacity_tokens
    )
    big_prefill = max(steps, key=lambda s: s.prefill_tokens + s.prefill_attention_pairs / 1e4)
    assert _predicted(big_prefill, roofline.coefficients) == pytest.approx(
        step_seconds(llama8b_h100, big_prefill), rel=0.25
    )
    manifest = prior_manifest(roofline.coefficients)
    assert set(manifest) == {"step", "prefillToken", "prefillPair", "decodeRow", "decodeContext"}
    assert manifest["step"] == pytest.approx(roofline.coefficients.step, rel=1e-3)


def test_an_observation_lag_shows_the_prompt_shift_to_the_controller_that_much_later() -> None:
    """``SimOptions.observation_lag_seconds``: the SLO round reads the load of the window ending
    that long ago (the operator reads Prometheus scrapes of counters that count a request when it
    finishes). The CI bursty trace's prompts double at 450 s; the round at 465 s reads them at
    once without a lag, and only the round after with a 15 s one."""
    from splitserve_bench.slo_compare import CI_SCENARIO, perf_of, slo_settings
    from splitserve_bench.slo_traces import shift_seconds

    scenario = CI_SCENARIO
    perf = perf_of(scenario)
    shift = shift_seconds("bursty-shift", scenario.shape)
    assert shift == 450.0
    requests = [r for r in make_trace("bursty-shift", scenario.shape, seed=1) if r.arrival_seconds < shift + 60]

    def planned_prompts(lag: float) -> dict[float, float]:
        fleet = FleetConfig(
            mode=DISAGGREGATED,
            prefill_replicas=2,
            decode_replicas=3,
            engine=scenario.engine,
            autoscale=slo_settings(scenario, perf),
        )
        sim = Simulator(
            fleet=fleet,
            perf=perf,
            requests=requests,
            options=SimOptions(sample_interval_seconds=5.0, seed=1, observation_lag_seconds=lag),
        )
        sim.run()
        return {
            d.time_seconds: float(d.model["promptTokens"])
            for d in sim.scaler.decisions
            if d.pool == "prefill" and d.model and "promptTokens" in d.model
        }

    now, lagged = planned_prompts(0.0), planned_prompts(15.0)
    assert now[shift] < 1300 and now[shift + 15] > 1800, now  # 1k-token prompts, then 2k
    assert lagged[shift + 15] < 1300 and lagged[shift + 30] > 1800, lagged
