"""SLO autoscaling vs target tracking, in the fleet simulator: attainment and GPU-hours per trace.

Three seeded traces (:mod:`splitserve_bench.slo_traces`: steady Poisson, a diurnal ramp, a
bursty 2-state MMPP whose prompts double mid-trace) run through the simulator under

(a) target tracking with the spec's default targets,
(b) target tracking with targets hand-tuned per trace — a grid search over the prefill queue
    target and the decode queue/KV targets (``TUNING_GRID``) keeping the fewest GPU-hours that
    meet the attainment (none meets it: the best attainment); ``tuned-floor`` searches the
    pools' ``min_replicas`` too (``TUNING_FLOORS``: 1, 2, 3), as an operator tuning target
    tracking by hand would,
(c) the SLO controller (the operator's ``decide_slo``, imported) with the roofline prior and
    nothing tuned per trace (``slo-no-prior``: with no prior at all, learning online alone),

and prints the ``ceiling``: every pool at ``max_replicas`` from the first tick, the most any
policy starting from the same fleet can attain (the first ``interval + startup`` seconds of
requests meet the initial fleet whatever a policy does), and, on the bursty trace, the
``shift-bound``: the controller until the prompts double, every pool at ``max_replicas`` from
that moment, the most any reaction to the shift attains from the fleet held when it comes, and
the ``tick-bound``: the same from the first tick after the shift, the most a controller that
must see a shifted request before it acts (every ``interval``, 15 s) attains.

Attainment is the fraction of requests whose TTFT and mean inter-token latency both meet the
SLO; GPU-hours count every pod from creation to drained over the trace. Figures, not
assertions (``tests/planner/test_slo_sim.py`` asserts the CI-size claims).

``--observation-lag 15`` has the SLO rounds read the load (rate, lengths) of the window ending
15 s before each round, as stale as the operator's Prometheus view can be (the tables in the docs
are at 0).

``--headrooms 0.9,1.0`` adds the SLO controller at those ``headroom`` values (policies
``slo@0.9``, ``slo@1.0``: one setting for every trace), the trade between margin and GPU-hours
that ``docs/slo-autoscaling-simulation.md`` reports.

    python bench/slo_autoscaling.py [--ci] [--policies default,tuned,tuned-floor,slo,ceiling,shift-bound,tick-bound]
        [--headrooms 0.9,0.95,1.0] [--traces ...] [--seed N | --seeds 1,2,3,4] [--tune-seed M]

``--seeds 1,2,3,4`` runs each seed's traces and ends with a summary: on how many seeds each
policy met the attainment, and its GPU-hours on each. ``--tune-seed M`` scores the tuned
policies out of sample: their setting is the best on seed M's trace, run on seed N's (an
operator tunes on past traffic); by default they are searched on the very trace they are scored
on, which is hindsight no operator has.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from splitserve_bench.slo_compare import (
    CI_SCENARIO,
    POLICIES,
    TUNING_FLOORS,
    TUNING_GRID,
    Outcome,
    Scenario,
    compare,
    format_seed_summary,
    format_table,
    headroom_of,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="CI size: 900 s traces (about a minute on one core)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--headrooms", default="", help="comma-separated headrooms in (0, 1]: adds the SLO controller at each (slo@H)"
    )
    parser.add_argument("--traces", default=None, help="comma-separated subset of steady,diurnal,bursty-shift")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--seeds", default="", help="comma-separated seeds: the table of each, then a summary over them"
    )
    parser.add_argument(
        "--prefill-overflow-tokens",
        type=int,
        default=0,
        help="the router's prefillOverflowTokens for every policy (default 0: no overflow)",
    )
    parser.add_argument(
        "--observation-lag",
        type=float,
        default=0.0,
        help="seconds: the SLO rounds read the load of the window ending this long ago "
        "(the operator's Prometheus view is staler than the simulator's; default 0)",
    )
    parser.add_argument(
        "--tune-seed",
        type=int,
        default=None,
        help="search the tuned settings on this seed's trace and score them on --seed's "
        "(default: on the scored trace itself, with hindsight)",
    )
    args = parser.parse_args()
    scenario = CI_SCENARIO if args.ci else Scenario()
    if args.traces:
        scenario = replace(scenario, traces=tuple(args.traces.split(",")))
    if args.seed is not None:
        scenario = replace(scenario, seed=args.seed)
    if args.tune_seed is not None:
        scenario = replace(scenario, tuning_seed=args.tune_seed)
    if args.prefill_overflow_tokens:
        scenario = replace(scenario, prefill_overflow_tokens=args.prefill_overflow_tokens)
    if args.observation_lag:
        scenario = replace(scenario, observation_lag_seconds=args.observation_lag)
    started = time.perf_counter()
    policies = [p for p in args.policies.split(",") if p]
    policies += [f"slo@{headroom_of(f'slo@{h}'):g}" for h in args.headrooms.split(",") if h]
    seeds = [int(seed) for seed in args.seeds.split(",") if seed] or [scenario.seed]
    by_seed: dict[int, list[Outcome]] = {}
    for seed in seeds:
        at_seed = replace(scenario, seed=seed)
        by_seed[seed] = compare(at_seed, policies=tuple(policies))
        print(format_table(by_seed[seed], scenario=at_seed) + "\n")
    if len(seeds) > 1:
        print(
            f"Over seeds {', '.join(map(str, seeds))}: GPU-hours where the policy meets "
            f"{scenario.slo.attainment:.0%}, else attainment and GPU-hours\n"
        )
        print(format_seed_summary(by_seed, scenario=scenario))
    print(
        f"\n(b) tuned: best of {len(TUNING_GRID)} target settings per trace, tuned-floor: of "
        f"{len(TUNING_GRID) * len(TUNING_FLOORS)} (x min replicas {TUNING_FLOORS}); "
        f"{time.perf_counter() - started:.0f} s wall"
    )


if __name__ == "__main__":
    main()
