"""The SLO controller against target tracking hand-tuned per trace, at CI size.

The issue's goal is "fewer GPU-hours than default targets and within 5 % of targets tuned for
each trace, without per-trace tuning". On the steady trace the controller meets it (below the
tuned point: it no longer chases a passing cluster of arrivals with a pod the scale-down window
keeps for 5 min). On the diurnal trace it does not, and the reason is asserted: the model is
right (its ITL estimate at the tuned point's decode count is within a few percent of what the
simulator measures there), but the controller keeps the margin it is told to keep, ``headroom``
0.8: every pool meets the targets at the planned load ÷ 0.8, and the tuned point has no such
margin (its decode pool runs at 45 ms of the 50 ms ITL target at the peak). Without the margin
(``headroom`` 1) the controller is within 5 % of the tuned point. And the tuned point is tuned
with hindsight, on the trace it is scored on: the diurnal setting seed 1 selects, run on seed
2's diurnal trace (the next day of the same traffic), ratchets to the maximum and misses, where
the controller meets both. See docs/slo-autoscaling-simulation.md.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve_bench.slo_compare import (
    CI_SCENARIO,
    Outcome,
    compare,
    perf_of,
    run_fixed_fleet,
    slo_settings,
)
from splitserve_bench.slo_traces import make_trace
from splitserve_operator.autoscaler.slo.estimate import Workload, estimate_decode

STEADY_AND_DIURNAL = replace(CI_SCENARIO, traces=("steady", "diurnal"))


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, str], Outcome]:
    return {(o.trace, o.policy): o for o in compare(STEADY_AND_DIURNAL, policies=("tuned", "slo", "slo@1"))}


def test_steady_meets_the_goal_within_five_percent_of_tuned_targets(
    outcomes: dict[tuple[str, str], Outcome],
) -> None:
    tuned, slo = outcomes[("steady", "tuned")], outcomes[("steady", "slo")]
    assert tuned.attainment >= CI_SCENARIO.slo.attainment  # the tuned point is a real competitor
    assert slo.attainment >= CI_SCENARIO.slo.attainment, slo
    assert slo.gpu_hours <= 1.05 * tuned.gpu_hours, (slo, tuned)


def test_diurnal_costs_more_than_tuned_by_the_headroom(outcomes: dict[tuple[str, str], Outcome]) -> None:
    tuned, slo, bare = outcomes[("diurnal", "tuned")], outcomes[("diurnal", "slo")], outcomes[("diurnal", "slo@1")]
    target = CI_SCENARIO.slo
    assert slo.attainment >= target.attainment, slo
    # what the controller reaches (+15 % when written): the goal's 5 % does not hold here
    assert slo.gpu_hours <= 1.2 * tuned.gpu_hours, (slo, tuned)
    # the margin is the difference: without it (headroom 1) the controller meets the attainment
    # within 5 % of the tuned point (+2.5 % when written), whose decode pool runs closer to the
    # target than the controller's
    assert bare.attainment >= target.attainment, bare
    assert bare.gpu_hours <= 1.05 * tuned.gpu_hours, (bare, tuned)
    assert tuned.itl_p99_seconds > slo.itl_p99_seconds, (tuned, slo)


def test_the_decode_model_is_not_what_costs_the_extra_pod() -> None:
    """At the tuned point's 3 decode pods on the steady trace the ITL estimate (roofline prior)
    matches the simulator's measured p99 to 5 %, and at the trace's mean rate ÷ headroom the
    estimate for 3 pods is the 50 ms target itself: 3 pods have exactly the margin at the mean
    rate, and the controller's fourth decode pod is the margin on a planned rate above the mean
    (the recent peak of 15 s windows), not a pessimistic model."""
    perf = perf_of(CI_SCENARIO)
    requests = make_trace("steady", CI_SCENARIO.shape, seed=CI_SCENARIO.seed)
    measured = run_fixed_fleet(scenario=CI_SCENARIO, perf=perf, requests=requests, prefill=2, decode=3)
    prior = slo_settings(CI_SCENARIO, perf).slo
    assert prior is not None and prior.prior is not None
    span = requests[-1].arrival_seconds
    load = Workload(
        request_rate=len(requests) / span,
        prompt_tokens=sum(r.num_prompt_tokens for r in requests) / len(requests),
        output_tokens=sum(r.num_output_tokens for r in requests) / len(requests),
    )
    estimate = estimate_decode(prior.prior, load, replicas=3, attainment=CI_SCENARIO.slo.attainment)
    itl_p99 = measured.itl_percentile(100.0 * CI_SCENARIO.slo.attainment)
    assert estimate.itl_seconds == pytest.approx(itl_p99, rel=0.05)
    margin = estimate_decode(
        prior.prior, load.with_margin(CI_SCENARIO.slo.headroom), replicas=3, attainment=CI_SCENARIO.slo.attainment
    )
    assert margin.itl_seconds == pytest.approx(CI_SCENARIO.slo.itl_p99_seconds, rel=0.02)


def test_targets_tuned_on_one_day_ratchet_on_the_next_where_the_controller_meets_both() -> None:
    # the setting the diurnal trace of seed 1 selects (prefill queue 1, decode queue 2, KV 0.5),
    # run on seed 2's diurnal trace: a lull takes prefill to one pod, the next rise ratchets it
    # to the 64-pod maximum; the controller, tuned on nothing, meets both days
    next_day = replace(CI_SCENARIO, traces=("diurnal",), seed=2, tuning_seed=1)
    by_policy = {o.policy: o for o in compare(next_day, policies=("tuned", "slo"))}
    tuned, slo = by_policy["tuned"], by_policy["slo"]
    assert tuned.settings.endswith("(tuned on seed 1)")
    assert tuned.attainment < CI_SCENARIO.slo.attainment, tuned
    assert tuned.peak_replicas["prefill"] == 64, tuned
    assert slo.attainment >= CI_SCENARIO.slo.attainment, slo
    assert slo.gpu_hours < tuned.gpu_hours
