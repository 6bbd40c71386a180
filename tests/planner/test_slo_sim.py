"""The simulator running the operator's SLO controller: mechanics, and the CI-size comparison.

The comparison asserts what the CI-size table (``bench/slo_autoscaling.py --ci``) shows: on
every trace the SLO controller beats target tracking with default targets on both attainment
and GPU-hours, and it meets the attainment on the steady and diurnal traces. On the CI-size
bursty trace with the prompt-length shift it reaches about 97 % (99.65 % at full size): no policy
starting from the scenario's fleet meets 99 % there (``test_slo_sim_bursty.py`` asserts the
ceiling and where the misses fall; ``test_slo_sim_tuned.py`` the comparison with tuned targets;
see docs/slo-autoscaling-simulation.md).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve_bench.slo_compare import (
    CI_SCENARIO,
    Outcome,
    base_settings,
    compare,
    format_seed_summary,
    headroom_of,
    perf_of,
    run_policy,
    slo_settings,
    tune,
)
from splitserve_bench.slo_traces import TraceShape, make_trace
from splitserve_operator.autoscaler.decision import Decision
from splitserve_planner.perf_model import RooflineModel
from splitserve_planner.simulator import (
    DISAGGREGATED,
    AutoscaleSettings,
    FleetConfig,
    SimOptions,
    Simulator,
)


@pytest.fixture(scope="module")
def ci_outcomes() -> dict[tuple[str, str], Outcome]:
    return {(o.trace, o.policy): o for o in compare(CI_SCENARIO, policies=("default", "slo"))}


@pytest.mark.parametrize("trace", CI_SCENARIO.traces)
def test_slo_controller_beats_default_targets_on_attainment_and_gpu_hours(
    ci_outcomes: dict[tuple[str, str], Outcome], trace: str
) -> None:
    default, slo = ci_outcomes[(trace, "default")], ci_outcomes[(trace, "slo")]
    assert slo.num_requests == default.num_requests > 10_000
    assert slo.gpu_hours < default.gpu_hours
    assert slo.attainment > default.attainment


@pytest.mark.parametrize("trace", ["steady", "diurnal"])
def test_slo_controller_meets_the_attainment_without_tuning(
    ci_outcomes: dict[tuple[str, str], Outcome], trace: str
) -> None:
    slo = ci_outcomes[(trace, "slo")]
    assert slo.attainment >= CI_SCENARIO.slo.attainment
    assert ci_outcomes[(trace, "default")].attainment < CI_SCENARIO.slo.attainment  # the baseline does not


def _slo_sim(*, floors: bool = False, startup: float = 45.0, prefill_queue_target: float = 4.0) -> Simulator:
    scenario = replace(CI_SCENARIO, shape=TraceShape(mean_rate=20.0, duration_seconds=480.0), startup_seconds=startup)
    perf = perf_of(scenario)
    settings = replace(
        slo_settings(scenario, perf),
        slo_target_floors=floors,
        prefill_target_queue_depth=prefill_queue_target,
        scale_down_stabilization_seconds=60.0,
    )  # the 480 s trace's fall must show a removal
    fleet = FleetConfig(mode=DISAGGREGATED, prefill_replicas=1, decode_replicas=1, autoscale=settings)
    sim = Simulator(
        fleet=fleet,
        perf=perf,
        requests=make_trace("diurnal", scenario.shape, seed=2),
        options=SimOptions(sample_interval_seconds=5),
    )
    sim.run()
    return sim


def _peak(sim: Simulator, role: str) -> int:
    return max(d.result for d in sim.scaler.decisions if d.pool == role)


def test_slo_mode_uses_the_operator_controller_and_measures_pod_start() -> None:
    sim = _slo_sim(startup=45.0)
    decisions = sim.scaler.decisions
    assert decisions and all(isinstance(d, Decision) for d in decisions)
    assert {d.pool for d in decisions} == {"prefill", "decode"}
    assert any(d.direction == "up" for d in decisions)  # one pod each is too few for 20 req/s
    modelled = [d for d in decisions if d.model]
    assert modelled and all("confidence" in d.model for d in modelled if d.model is not None)
    state = sim.scaler.slo_state
    assert state.fits["prefill"].points > 0 and state.fits["decode"].points > 0
    # replicas write -> Ready is 45 s here; a tick sees it within one interval (15 s) after
    measured = [state.pod_start_seconds(role) for role in ("prefill", "decode") if role in state.start_seconds]
    assert measured and all(45.0 <= s <= 60.0 for s in measured)
    removed = {p.index for p in sim.all_pods if not p.accepting}
    assert removed  # the diurnal trace's fall scaled pods away
    final = sim._observe_window(quantile=0.99)
    live = {p.index for pods in sim.pools.values() for p in pods}
    assert set(sim._last_counters) <= live  # counters of scaled-away pods are forgotten
    assert sum(p.ready_replicas for p in final.pools.values()) == len(live)


def test_target_floors_raise_the_slo_decision_to_target_tracking() -> None:
    # a prefill queue target of 0.01 makes target tracking want far more prefill pods than the SLO needs
    plain = _slo_sim(floors=False, prefill_queue_target=0.01)
    floored = _slo_sim(floors=True, prefill_queue_target=0.01)
    assert _peak(floored, "prefill") > _peak(plain, "prefill")
    assert len(floored.scaler.floor_histories["prefill"].samples) > 2  # target tracking ran in its own history


def test_slo_mode_needs_the_window_inputs(llama8b_h100: RooflineModel) -> None:
    from splitserve_planner.autoscale import PoolObservation, SimAutoscaler

    settings = slo_settings(CI_SCENARIO, llama8b_h100)
    scaler = SimAutoscaler(settings=settings, initial_replicas={"prefill": 1, "decode": 1}, gpus_per_replica=1)
    obs = PoolObservation(current_replicas=1, ready_replicas=1, requests_waiting=0.0, kv_cache_usage_ratio=0.0)
    with pytest.raises(ValueError, match="SloInputs"):
        scaler.step(now_seconds=15.0, observations={"prefill": obs, "decode": obs})
    # target tracking is unchanged without an SLO
    plain = SimAutoscaler(
        settings=AutoscaleSettings(), initial_replicas={"prefill": 1, "decode": 1}, gpus_per_replica=1
    )
    assert plain.step(now_seconds=15.0, observations={"prefill": obs, "decode": obs}) == {"prefill": 1, "decode": 1}


def test_run_policy_scores_attainment_and_gpu_hours() -> None:
    scenario = replace(CI_SCENARIO, shape=TraceShape(mean_rate=5.0, duration_seconds=300.0))
    perf = perf_of(scenario)
    requests = make_trace("steady", scenario.shape, seed=0)
    outcome = run_policy(
        scenario=scenario,
        perf=perf,
        requests=requests,
        trace="steady",
        policy="default",
        autoscale=base_settings(scenario),
    )
    assert outcome.num_requests == len(requests)
    assert 0.0 <= outcome.attainment <= 1.0
    missed = len(outcome.missed_arrival_seconds)
    assert missed == round((1.0 - outcome.attainment) * outcome.num_requests)  # every request finished here
    assert outcome.misses_between(0.0, float("inf")) == missed
    assert outcome.misses_between(0.0, 0.0) == 0
    span_hours = requests[-1].arrival_seconds / 3600.0
    fewest = span_hours * 2  # one prefill and one decode pod at least, the whole span
    assert outcome.gpu_hours >= fewest * 0.999
    assert outcome.gpu_hours <= span_hours * (scenario.initial_prefill + scenario.initial_decode) * 1.001


def test_the_headroom_sweep_runs_the_controller_at_each_headroom() -> None:
    steady = replace(CI_SCENARIO, traces=("steady",))
    by_policy = {o.policy: o for o in compare(steady, policies=("slo", "slo@1"))}
    planned, edge = by_policy["slo"], by_policy["slo@1"]
    assert planned.settings.endswith("headroom 0.8") and edge.settings.endswith("headroom 1")
    # planning at the full targets instead of 80 % of them takes fewer pods, and runs closer to the ITL target
    assert edge.gpu_hours < 0.95 * planned.gpu_hours
    assert edge.itl_p99_seconds > planned.itl_p99_seconds
    assert headroom_of("slo@0.95") == 0.95
    assert headroom_of("slo") is None and headroom_of("tuned") is None
    for bad in ("slo@0", "slo@1.5", "slo@fast"):
        with pytest.raises(ValueError, match="headroom after 'slo@'"):
            headroom_of(bad)
    with pytest.raises(ValueError, match="or slo@H"):
        compare(steady, policies=("slo-ish",))


def test_tuning_out_of_sample_scores_the_setting_found_on_another_seed() -> None:
    scenario = replace(
        CI_SCENARIO, shape=TraceShape(mean_rate=8.0, duration_seconds=240.0), traces=("steady",), seed=2, tuning_seed=1
    )
    perf = perf_of(scenario)
    served, tuning = (make_trace("steady", scenario.shape, seed=seed) for seed in (2, 1))
    hindsight = tune(scenario=scenario, perf=perf, requests=tuning, trace="steady")
    transferred = tune(scenario=scenario, perf=perf, requests=served, trace="steady", tuning_requests=tuning)
    # the setting is the one found on seed 1's trace, scored on seed 2's requests
    assert transferred.settings == f"{hindsight.settings} (tuned on seed 1)"
    assert transferred.num_requests == len(served) != hindsight.num_requests
    (via_compare,) = compare(scenario, policies=("tuned",))
    assert via_compare.settings == transferred.settings
    assert via_compare.gpu_hours == pytest.approx(transferred.gpu_hours)


def test_the_controller_meets_steady_and_diurnal_traffic_on_every_seed() -> None:
    """Seed 1's figures are not luck: on seeds 1-4 of the steady and diurnal traces the controller,
    with nothing tuned, meets the attainment (on the bursty prompt-shift trace it does not in
    general: docs/slo-autoscaling-simulation.md, "Across seeds")."""
    scenario = replace(CI_SCENARIO, traces=("steady", "diurnal"))
    by_seed = {seed: compare(replace(scenario, seed=seed), policies=("slo",)) for seed in (1, 2, 3, 4)}
    for seed, outcomes in by_seed.items():
        for o in outcomes:
            assert o.attainment >= scenario.slo.attainment, (seed, o)
    summary = format_seed_summary(by_seed, scenario=scenario).splitlines()
    assert summary[0] == "| trace | policy | meets | seed 1 | seed 2 | seed 3 | seed 4 |"
    assert summary[2].startswith("| steady | slo | 4 of 4 | ") and summary[3].startswith("| diurnal | slo | 4 of 4 | ")


def test_without_a_prior_the_controller_learns_online_and_still_meets_steady_and_diurnal_traffic() -> None:
    """No offline profiling (Dynamo's planner needs a profiling job per model and GPU): with no
    prior at all the fit starts from nothing and learns from the pods' step counters alone. On
    seeds 1-2 of the CI steady and diurnal traces it meets the attainment, at 8-13 % more
    GPU-hours than with the roofline prior (the first windows run on measured latency alone)."""
    learning = slo_settings(CI_SCENARIO, perf_of(CI_SCENARIO), with_prior=False).slo
    assert learning is not None and learning.prior is None
    scenario = replace(CI_SCENARIO, traces=("steady", "diurnal"))
    for seed in (1, 2):
        by_policy = {
            (o.trace, o.policy): o for o in compare(replace(scenario, seed=seed), policies=("slo", "slo-no-prior"))
        }
        for trace in scenario.traces:
            learned, primed = by_policy[(trace, "slo-no-prior")], by_policy[(trace, "slo")]
            assert learned.attainment >= scenario.slo.attainment, (seed, learned)
            assert learned.gpu_hours <= 1.2 * primed.gpu_hours, (seed, learned, primed)
