"""How fast the fleet simulator runs: one hour of traffic at 100 req/s, sim-seconds per wall-second.

Workload: Llama-3.1-8B shape on H200 (roofline), Poisson 100 req/s, lognormal prompts (mean
1024) and outputs (mean 256), half the requests sharing one of 8 system prompts of 512 tokens.
Fleets: disaggregated 3 prefill + 6 decode pods, and aggregated 8 pods.

    python bench/simulator_speed.py [--rate 100] [--seconds 3600] [--no-macro-steps]
"""

from __future__ import annotations

import argparse
import sys
import time

from splitserve_planner.gpus import get_gpu
from splitserve_planner.model_presets import load_model
from splitserve_planner.perf_model import roofline_model
from splitserve_planner.simulator import (
    AGGREGATED,
    DISAGGREGATED,
    FleetConfig,
    SimOptions,
    simulate,
)
from splitserve_planner.workload import Arrivals, LengthDist, WorkloadSpec


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--no-macro-steps", action="store_true")
    args = parser.parse_args(argv)
    name, config = load_model(name_or_path="llama-3.1-8b")
    perf = roofline_model(name=name, config=config, gpu=get_gpu("H200"), tensor_parallel=1, dtype="bfloat16")
    spec = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=args.rate),
        prompt_tokens=LengthDist.parse("lognormal:1024:0.8"),
        output_tokens=LengthDist.parse("lognormal:256:0.8"),
        prefix_share=0.5,
        prefix_tokens=512,
    )
    t0 = time.perf_counter()
    requests = spec.generate(duration_seconds=args.seconds, seed=0)
    print(f"workload: {len(requests)} requests over {args.seconds:.0f} s generated in {time.perf_counter() - t0:.2f} s")
    options = SimOptions(warmup_seconds=60, macro_steps=not args.no_macro_steps)
    for fleet in (
        FleetConfig(mode=DISAGGREGATED, prefill_replicas=3, decode_replicas=6),
        FleetConfig(mode=AGGREGATED, aggregated_replicas=8),
    ):
        result = simulate(fleet=fleet, perf=perf, requests=requests, options=options)
        s = result.summary()
        print(
            f"{fleet.mode:>14}: {result.sim_seconds:.0f} sim-s in {result.wall_seconds:.1f} wall-s = "
            f"{result.sim_seconds / result.wall_seconds:.0f} sim-s/wall-s, {result.num_events / result.wall_seconds:,.0f} events/s "
            f"({result.num_events:,} events); TTFT p99 {s['ttft_p99_ms']:.0f} ms, ITL p99 {s['itl_p99_ms']:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
