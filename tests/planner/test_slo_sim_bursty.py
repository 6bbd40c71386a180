"""The CI-size bursty trace with the prompt-length shift: what is feasible, and where the
SLO controller lands.

No policy that starts from the scenario's 2 prefill + 3 decode pods meets 99 % here: the trace
opens in its high state (27 req/s, the fleet is sized for the mean 20), the first tick is at
15 s and a pod asked for then is Ready at 75 s, and the router commits each request to a pod
Ready at its arrival, so about 1.2 % of the requests (those of the first 75 s) miss whatever a
policy does. Every pool at ``max_replicas`` from the first tick (``ceiling``) reaches 98.8 %.
The controller's misses all fall in the two stretches no decision taken on the evidence can
reach: that first one, and the one between the prompt shift (450 s; first seen by the 465 s
tick) and the first pod asked for after it being Ready (525 s).

A fixed fleet sized for the whole trace in hindsight (5 prefill, 6 decode, from t = 0, so
it serves the first 75 s too) meets the 99 % attainment: the target is feasible for a fleet
that knows the future. Its sixth decode pod is what absorbs the shifted burst. The shift to
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

from splitserve_bench.slo_compare import (
    CI_SCENARIO,
    Outcome,
    compare,
    first_tick_after,
    format_seed_summary,
    perf_of,
    run_fixed_fleet,
)
from splitserve_bench.slo_traces import make_trace, shift_seconds
from splitserve_planner.slo_attainment import attainment

BURSTY = replace(CI_SCENARIO, traces=("bursty-shift",))


def _fixed_fleet_attainment(prefill: int, decode: int) -> float:
    requests = make_trace("bursty-shift", BURSTY.shape, seed=BURSTY.seed)
    result = run_fixed_fleet(scenario=BURSTY, perf=perf_of(BURSTY), requests=requests, prefill=prefill, decode=decode)
    return attainment(
        ttft=result.ttft_seconds, tpot=result.tpot_seconds, num_requests=result.num_measured, slo=BURSTY.slo
    )


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    return {o.policy: o for o in compare(BURSTY, policies=("slo", "ceiling"))}


@pytest.fixture(scope="module")
def slo_outcome(outcomes: dict[str, Outcome]) -> Outcome:
    return outcomes["slo"]


FIRST_READY = BURSTY.interval_seconds + BURSTY.startup_seconds
"""A pod asked for at the first tick is Ready this late: requests before it meet the initial fleet."""
_SHIFT = shift_seconds("bursty-shift", BURSTY.shape)
assert _SHIFT is not None
SHIFT: float = _SHIFT
SHIFT_READY = first_tick_after(SHIFT, BURSTY.interval_seconds) + BURSTY.startup_seconds
"""The first tick after the shift sees it; a pod it asks for is Ready this late."""


def test_no_policy_from_the_initial_fleet_meets_the_attainment(outcomes: dict[str, Outcome]) -> None:
    ceiling = outcomes["ceiling"]
    assert 0.985 < ceiling.attainment < BURSTY.slo.attainment, ceiling
    # its misses are the first stretch's: more pods later change nothing
    missed = ceiling.num_requests * (1.0 - ceiling.attainment)
    assert ceiling.misses_between(0.0, FIRST_READY) >= 0.99 * missed - 1
    assert ceiling.misses_between(0.0, FIRST_READY) > (1.0 - BURSTY.slo.attainment) * ceiling.num_requests


def test_the_controller_misses_only_where_no_decision_on_the_evidence_reaches(
    slo_outcome: Outcome, outcomes: dict[str, Outcome]
) -> None:
    assert slo_outcome.misses_between(FIRST_READY, SHIFT) == 0, slo_outcome
    # after the shift's pods are Ready only the longest prompts miss, by a few ms: 8-12k tokens,
    # whose own chunked prefill takes most of the 1 s target on an idle pod (no count helps)
    requests = make_trace("bursty-shift", BURSTY.shape, seed=BURSTY.seed)
    missed = set(slo_outcome.missed_arrival_seconds.tolist())
    late = [r for r in requests if r.arrival_seconds >= SHIFT_READY and r.arrival_seconds in missed]
    assert len(late) <= 3 and all(r.num_prompt_tokens >= 8000 for r in late), late
    # the first stretch costs it what it costs the ceiling (to 2 %: the decode side differs)
    first, bound = slo_outcome.misses_between(0.0, FIRST_READY), outcomes["ceiling"].misses_between(0.0, FIRST_READY)
    assert abs(first - bound) <= 0.02 * bound + 1


def test_a_hindsight_fixed_fleet_meets_the_attainment_and_one_pod_less_does_not() -> None:
    assert _fixed_fleet_attainment(5, 6) >= BURSTY.slo.attainment
    assert _fixed_fleet_attainment(4, 6) < BURSTY.slo.attainment
    assert _fixed_fleet_attainment(5, 5) < BURSTY.slo.attainment


def test_the_slo_controller_gets_close_without_foresight(slo_outcome: Outcome) -> None:
    # 97.2 % when written (0.87 before the recent-peak plan and the committed-queue wait;
    # 97.15 % since the headroom is a margin on the load); the ceiling is 98.8 %
    assert slo_outcome.attainment >= 0.97, slo_outcome
    hindsight_hours = (5 + 6) * BURSTY.shape.duration_seconds / 3600.0
    assert slo_outcome.gpu_hours < 1.5 * hindsight_hours


def test_on_seed_4_no_reaction_to_the_shift_reaches_the_attainment() -> None:
    """Seed 4's shift lands as a burst begins: even every pool at 64 pods from the moment the
    prompts double (``shift-bound``: the controller's fleet until then, no measurement needed)
    misses 99 %, because 2.5x the prefill work queues on the Ready pods for a whole pod start,
    and those requests miss whatever is asked for. The controller lands within 3 points of it."""
    seed4 = replace(BURSTY, seed=4)
    by_policy = {o.policy: o for o in compare(seed4, policies=("slo", "shift-bound"))}
    bound, slo = by_policy["shift-bound"], by_policy["slo"]
    assert bound.peak_replicas == {"prefill": 64, "decode": 64}, bound
    assert bound.attainment < seed4.slo.attainment, bound
    budget = (1.0 - seed4.slo.attainment) * bound.num_requests
    assert bound.misses_between(SHIFT, SHIFT_READY) > budget, bound  # the shift's stretch alone
    assert bound.misses_between(SHIFT_READY, float("inf")) <= 3, bound
    assert slo.attainment >= bound.attainment - 0.03, (slo, bound)


def test_the_first_tick_after_a_moment_is_strictly_after_it() -> None:
    # a shift on a tick is first seen a tick later: that round's window holds shifted requests
    assert first_tick_after(450.0, 15.0) == 465.0
    assert first_tick_after(450.5, 15.0) == 465.0
    assert first_tick_after(449.0, 15.0) == 450.0
    assert first_tick_after(0.0, 15.0) == 15.0


REACH_SEEDS = tuple(range(1, 13))
REACH_MARGIN = 0.025
"""How far below ``shift-bound`` the controller may land on a seed the bound misses (at 0.8 it is
at most 2.5 points below it on seeds 1-12, 2.45 on seed 7; at headroom 1 up to 11.2)."""
TICK_MARGIN = 0.002
"""How far below ``tick-bound`` the controller may land on any seed (0.06 points at most on
seeds 1-12 when written: 97.15 against 97.19 % on seed 1, 92.62 against 92.68 on seed 4)."""


def test_over_twelve_seeds_the_controller_meets_wherever_a_reaction_to_the_shift_can() -> None:
    """Where the prompt shift is within reach of a reaction (``shift-bound`` meets), the controller
    meets it too; where it is not, the controller lands close to the bound, and that is its
    headroom's doing: without the margin (``slo@1``) it falls well below the bound.

    And against ``tick-bound`` (every pool at 64 from the first round that can have seen a
    shifted request): on every seed the controller attains what 64 pods per pool from its own
    first chance attain. Its reaction loses nothing that pods asked for then could save; what it
    loses against ``shift-bound`` is one interval of foresight."""
    by_seed = {
        seed: {
            o.policy: o
            for o in compare(replace(BURSTY, seed=seed), policies=("slo", "slo@1", "shift-bound", "tick-bound"))
        }
        for seed in REACH_SEEDS
    }
    target = BURSTY.slo.attainment
    reachable = [seed for seed, by in by_seed.items() if by["shift-bound"].attainment >= target]
    assert 3 <= len(reachable) < len(REACH_SEEDS), reachable  # (5 of 12 when written: 3, 8, 10, 11, 12)
    for seed in reachable:
        assert by_seed[seed]["slo"].attainment >= target, (seed, by_seed[seed]["slo"])
    for seed, by in by_seed.items():
        assert by["slo"].attainment >= by["shift-bound"].attainment - REACH_MARGIN, (seed, by["slo"], by["shift-bound"])
        assert by["slo"].attainment >= by["tick-bound"].attainment - TICK_MARGIN, (seed, by["slo"], by["tick-bound"])
        assert by["tick-bound"].peak_replicas == {"prefill": 64, "decode": 64}, (seed, by["tick-bound"])
    without_margin = [
        seed for seed, by in by_seed.items() if by["slo@1"].attainment < by["tick-bound"].attainment - REACH_MARGIN
    ]
    assert len(without_margin) >= 3, without_margin  # (6 when written: 1, 4, 5, 6, 7, 9)
    summary = format_seed_summary({seed: list(by.values()) for seed, by in by_seed.items()}, scenario=BURSTY)
    n = len(reachable)
    assert f"| bursty-shift | slo | {n} of 12 ({n} of shift-bound's {n}, " in summary, summary
