"""The CI-size bursty trace with the prompt-length shift: what is feasible, and where the
SLO controller lands.

A fixed fleet sized for the whole trace in hindsight (5 prefill, 6 decode) meets the 99 %
attainment, so the target is feasible for a policy that knows the future. The shift to
2k-token prompts at 450 s comes about 25 s before the next burst, less than one pod start
(60 s), and the router commits requests to the pods Ready at arrival: a reactive policy
cannot have the extra pods Ready in time, so the SLO controller is asserted at what it
reaches (about 97 %; it was 87 % before it planned on the recent peak and modelled the
committed queues), within 1.5x the hindsight fleet's GPU-hours (it scales past it while a
burst's backlog drains).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve_planner.simulator import DISAGGREGATED, FleetConfig, SimOptions, Simulator
from splitserve_planner.slo_compare import CI_SCENARIO, Outcome, attainment, compare, perf_of
from splitserve_planner.slo_traces import make_trace

BURSTY = replace(CI_SCENARIO, traces=("bursty-shift",))


def _fixed_fleet_attainment(prefill: int, decode: int) -> float:
    perf = perf_of(BURSTY)
    requests = make_trace("bursty-shift", BURSTY.shape, seed=BURSTY.seed)
    fleet = FleetConfig(mode=DISAGGREGATED, prefill_replicas=prefill, decode_replicas=decode, engine=BURSTY.engine)
    result = Simulator(fleet=fleet, perf=perf, requests=requests,
                       options=SimOptions(sample_interval_seconds=5.0, seed=BURSTY.seed)).run()
    return attainment(ttft=result.ttft_seconds, tpot=result.tpot_seconds, num_requests=result.num_measured,
                      slo=BURSTY.slo)


@pytest.fixture(scope="module")
def slo_outcome() -> Outcome:
    (outcome,) = compare(BURSTY, policies=("slo",))
    return outcome


def test_a_hindsight_fixed_fleet_meets_the_attainment_and_one_pod_less_does_not() -> None:
    assert _fixed_fleet_attainment(5, 6) >= BURSTY.slo.attainment
    assert _fixed_fleet_attainment(4, 6) < BURSTY.slo.attainment
    assert _fixed_fleet_attainment(5, 5) < BURSTY.slo.attainment


def test_the_slo_controller_gets_close_without_foresight(slo_outcome: Outcome) -> None:
    # 0.97 is what the controller reaches (97.2 % when written); 0.87 before the recent-peak
    # plan and the committed-queue wait
    assert slo_outcome.attainment >= 0.965, slo_outcome
    hindsight_hours = (5 + 6) * BURSTY.shape.duration_seconds / 3600.0
    assert slo_outcome.gpu_hours < 1.5 * hindsight_hours
