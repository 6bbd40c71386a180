"""Check the seed document's three serving claims with the fleet simulator; print Markdown tables.

Model: Llama-3.1-8B shape, bf16, H100-SXM, TP=1, roofline defaults (``gpus.py``). Each claim is
measured on a few representative workloads; every figure comes from the simulator, so the
table shows what *our model of the system* predicts, with the parameters beside it.

1. Disaggregation's throughput gain (seed: 30–60 %): the highest Poisson rate 8 GPUs sustain
   with p99 TTFT and p99 ITL within the SLOs, disaggregated (best prefill/decode split) vs
   aggregated (best token budget of 8192/2048/512, chunked prefill), bisected to ~3 %.
2. Prefix caching's compute saving with shared system prompts (seed: 50–80 %): prefill GPU
   time and prefill tokens with vs without the prefix cache (disaggregated, prefix-affinity
   router), and the planner's GPU count for the whole fleet with vs without it.
3. Continuous batching's utilization (seed: from 30–50 % to 70–90 %): one aggregated pod
   (max 64 sequences) under overload; batch-slot occupancy (running sequences / 64 while busy)
   and output tokens/s, static batching (a batch runs to completion) vs continuous.

    python bench/planner_claims.py [--quick] [--update-doc docs/capacity-planning.md]

``--update-doc`` replaces the text between ``<!-- claims:begin -->`` and ``<!-- claims:end -->``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from splitserve_planner.gpus import get_gpu
from splitserve_planner.model_presets import load_model
from splitserve_planner.perf_model import RooflineModel, roofline_model
from splitserve_planner.search import (
    AGGREGATED_BUDGETS,
    Demand,
    PlanError,
    PlanInputs,
    Slo,
    capacity,
    check_feasible,
    plan_aggregated,
    plan_disaggregated,
)
from splitserve_planner.simulator import (
    AGGREGATED,
    DISAGGREGATED,
    EngineSettings,
    FleetConfig,
    SimOptions,
    SimResult,
    simulate,
)
from splitserve_planner.workload import Arrivals, LengthDist, Request, WorkloadSpec

GPUS = 8
SECONDS = 60.0


@dataclass(frozen=True)
class Shape:
    label: str
    prompt: str
    output: str
    prefix_share: float = 0.0
    prefix_tokens: int = 0
    prefix_groups: int = 8

    def requests(self, *, rate: float, seconds: float = SECONDS, seed: int = 0) -> list[Request]:
        return WorkloadSpec(
            arrivals=Arrivals(rate_per_second=rate),
            prompt_tokens=LengthDist.parse(self.prompt),
            output_tokens=LengthDist.parse(self.output),
            prefix_share=self.prefix_share,
            prefix_tokens=self.prefix_tokens,
            prefix_groups=self.prefix_groups,
        ).generate(duration_seconds=seconds, seed=seed)


def _perf() -> RooflineModel:
    name, config = load_model(name_or_path="llama-3.1-8b")
    return roofline_model(name=name, config=config, gpu=get_gpu("H100-SXM"), tensor_parallel=1, dtype="bfloat16")


def _meets(result: SimResult, slo: Slo) -> bool:
    return slo.met_by(result)


def _sim(perf: RooflineModel, fleet: FleetConfig, requests: list[Request]) -> SimResult:
    return simulate(
        fleet=fleet, perf=perf, requests=requests, options=SimOptions(warmup_seconds=10, sample_interval_seconds=0)
    )


def _meets_at(perf: RooflineModel, fleet: FleetConfig, shape: Shape, slo: Slo) -> Callable[[float], bool]:
    """Whether ``fleet`` meets ``slo`` on ``shape`` at a request rate (the bisection's test)."""

    def ok(rate: float) -> bool:
        return _meets(_sim(perf, fleet, shape.requests(rate=rate)), slo)

    return ok


def _max_rate(ok: Callable[[float], bool], *, low: float, high: float, rel: float = 0.03) -> float:
    """Largest rate in [low, high] with ok(rate) (monotone), by bisection; 0 if none."""
    while not ok(low):
        low, high = low / 2, low
        if low < 0.05:
            return 0.0
    while ok(high):
        low, high = high, high * 2
    while high - low > rel * low:
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return low


def _capacity(perf: RooflineModel, shape: Shape, *, engine: EngineSettings, slo: Slo) -> tuple[float, float, Demand]:
    demand = Demand.of(shape.requests(rate=10.0), prefix_caching=True, block_size=engine.block_size)
    cap = capacity(perf=perf, engine=engine, demand=demand, itl_seconds=slo.itl_p99_seconds)
    return cap.prefill_tokens_per_second, cap.decode_tokens_per_second, demand


def claim_disaggregation(perf: RooflineModel, *, slo: Slo, shapes: list[Shape]) -> list[str]:
    rows = [
        "| workload | SLO (p99 TTFT / ITL) | aggregated: max req/s (budget) | disaggregated: max req/s (P+D) | gain |",
        "|---|---|---|---|---|",
    ]
    for shape in shapes:
        try:
            check_feasible(PlanInputs(perf=perf, requests=shape.requests(rate=20.0), slo=slo))
        except PlanError as exc:
            rows.append(
                f"| {shape.label} | {slo.ttft_p99_seconds * 1e3:.0f} ms / {slo.itl_p99_seconds * 1e3:.0f} ms | "
                f"infeasible: {str(exc).split(';')[0]} | | |"
            )
            continue
        best_agg: tuple[float, int] = (0.0, 0)
        for budget in AGGREGATED_BUDGETS:
            engine = EngineSettings(max_batched_tokens=budget)
            cap_p, cap_d, demand = _capacity(perf, shape, engine=engine, slo=slo)
            if cap_d == 0:
                continue
            estimate = GPUS / (demand.mean_prompt_tokens / cap_p + demand.mean_output_tokens / cap_d)
            fleet = FleetConfig(mode=AGGREGATED, aggregated_replicas=GPUS, engine=engine)
            rate = _max_rate(_meets_at(perf, fleet, shape, slo), low=0.3 * estimate, high=1.2 * estimate)
            best_agg = max(best_agg, (rate, budget))
        cap_p, cap_d, demand = _capacity(perf, shape, engine=EngineSettings(), slo=slo)
        estimates = {
            p: min(p * cap_p / demand.mean_prompt_tokens, (GPUS - p) * cap_d / demand.mean_output_tokens)
            for p in range(1, GPUS)
        }
        best_dis: tuple[float, str] = (0.0, "")
        for prefill in sorted(estimates, key=lambda p: -estimates[p])[:3]:  # the 3 analytically best splits
            fleet = FleetConfig(mode=DISAGGREGATED, prefill_replicas=prefill, decode_replicas=GPUS - prefill)
            rate = _max_rate(
                _meets_at(perf, fleet, shape, slo), low=0.3 * estimates[prefill], high=1.2 * estimates[prefill]
            )
            best_dis = max(best_dis, (rate, f"{prefill}+{GPUS - prefill}"))
        gain = best_dis[0] / best_agg[0] - 1 if best_agg[0] else float("inf")
        rows.append(
            f"| {shape.label} | {slo.ttft_p99_seconds * 1e3:.0f} ms / {slo.itl_p99_seconds * 1e3:.0f} ms | "
            f"{best_agg[0]:.1f} ({best_agg[1]}) | {best_dis[0]:.1f} ({best_dis[1]}) | {gain:+.0%} |"
        )
    return rows


def claim_prefix_caching(perf: RooflineModel, *, slo: Slo, shapes: list[Shape], rate: float) -> list[str]:
    rows = [
        "| workload | prefill tokens saved | prefill GPU-time saved | fleet GPUs without → with cache (planner) | fleet saving |",
        "|---|---|---|---|---|",
    ]
    for shape in shapes:
        requests = shape.requests(rate=rate)
        busy: dict[bool, float] = {}
        computed: dict[bool, int] = {}
        for caching in (False, True):
            fleet = FleetConfig(
                mode=DISAGGREGATED, prefill_replicas=4, decode_replicas=4, engine=EngineSettings(prefix_caching=caching)
            )
            pool = _sim(perf, fleet, requests).pools["prefill"]
            busy[caching] = pool.busy_fraction
            computed[caching] = pool.prefill_tokens_computed
        gpus: dict[bool, int] = {}
        for caching in (False, True):
            inputs = PlanInputs(perf=perf, requests=requests, slo=slo, engine=EngineSettings(prefix_caching=caching))
            plans = [p for p in (plan_disaggregated(inputs), plan_aggregated(inputs)) if p is not None]
            gpus[caching] = min(p.num_gpus for p in plans)
        rows.append(
            f"| {shape.label} | {1 - computed[True] / computed[False]:.0%} | {1 - busy[True] / busy[False]:.0%} | "
            f"{gpus[False]} → {gpus[True]} | {1 - gpus[True] / gpus[False]:.0%} |"
        )
    return rows


def claim_continuous_batching(perf: RooflineModel, *, shapes: list[Shape], rate: float) -> list[str]:
    rows = [
        "| workload (outputs) | static: slot occupancy, output tok/s | continuous: slot occupancy, output tok/s | throughput gain |",
        "|---|---|---|---|",
    ]
    for shape in shapes:
        requests = shape.requests(rate=rate, seconds=120)
        figures = {}
        for batching in ("static", "continuous"):
            fleet = FleetConfig(
                mode=AGGREGATED, aggregated_replicas=1, engine=EngineSettings(max_num_seqs=64, batching=batching)
            )
            r = simulate(
                fleet=fleet,
                perf=perf,
                requests=requests,
                options=SimOptions(sample_interval_seconds=0, drain_limit_seconds=0),
            )
            pool = r.pools[AGGREGATED]
            figures[batching] = (pool.batch_occupancy, pool.decode_tokens / r.sim_seconds)
        (so, st), (co, ct) = figures["static"], figures["continuous"]
        rows.append(f"| {shape.label} | {so:.0%}, {st:,.0f} | {co:.0%}, {ct:,.0f} | {ct / st - 1:+.0%} |")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one workload per claim")
    parser.add_argument("--update-doc", type=Path, default=None, help="rewrite the claims block of this Markdown file")
    args = parser.parse_args(argv)
    perf = _perf()
    started = time.perf_counter()
    slo = Slo(ttft_p99_seconds=1.0, itl_p99_seconds=0.05)
    strict = Slo(ttft_p99_seconds=0.3, itl_p99_seconds=0.015)
    disagg_shapes = [
        Shape("chat: prompt ~1k, output ~256", "lognormal:1024:0.8", "lognormal:256:0.8"),
        Shape("RAG/summarize: prompt ~4k, output ~128", "lognormal:4096:0.6", "lognormal:128:0.8"),
        Shape("generation: prompt ~256, output ~1k", "lognormal:256:0.8", "lognormal:1024:0.8"),
    ]
    prefix_shapes = [
        Shape(
            "support bot: 90% share 1 system prompt of 2k + ~200 own",
            "lognormal:200:0.8",
            "lognormal:200:0.8",
            0.9,
            2048,
            1,
        ),
        Shape(
            "code assistant: 50% share 16 contexts of 4k + ~500 own",
            "lognormal:500:0.8",
            "lognormal:150:0.8",
            0.5,
            4096,
            16,
        ),
        Shape("mixed: 20% share 8 prompts of 512 + ~1k own", "lognormal:1024:0.8", "lognormal:256:0.8", 0.2, 512, 8),
    ]
    batch_shapes = [
        Shape("prompt 512, outputs exponential mean 256", "512", "exponential:256"),
        Shape("prompt 512, outputs lognormal mean 256 sigma 1", "512", "lognormal:256:1.0"),
        Shape("prompt 512, outputs fixed 256", "512", "256"),
    ]
    if args.quick:
        disagg_shapes, prefix_shapes, batch_shapes = disagg_shapes[:1], prefix_shapes[:1], batch_shapes[:1]
    lines = [
        f"Llama-3.1-8B bf16 on H100-SXM (TP=1, roofline: compute eff {perf.gpu.compute_efficiency}, "
        f"bandwidth eff {perf.gpu.bandwidth_efficiency}, step overhead {perf.gpu.step_overhead_seconds * 1e3:g} ms); "
        f"Poisson arrivals, {SECONDS:.0f} s simulated per point, seed 0.",
        "",
        f"#### 1. Disaggregation: the highest rate {GPUS} GPUs sustain within the SLOs",
        "",
    ]
    lines += claim_disaggregation(perf, slo=slo, shapes=disagg_shapes)
    lines += claim_disaggregation(perf, slo=strict, shapes=disagg_shapes)[2:]
    lines += ["", "#### 2. Prefix caching at 20 req/s (compute columns: 4 prefill GPUs, disaggregated)", ""]
    lines += claim_prefix_caching(perf, slo=slo, shapes=prefix_shapes, rate=20.0)
    lines += ["", "#### 3. Continuous vs static batching: one pod, max 64 sequences, 40 req/s offered (overload)", ""]
    lines += claim_continuous_batching(perf, shapes=batch_shapes, rate=40.0)
    lines += ["", f"(generated by `python bench/planner_claims.py` in {time.perf_counter() - started:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    if args.update_doc is not None:
        doc = args.update_doc.read_text(encoding="utf-8")
        block = re.compile(r"(<!-- claims:begin -->\n).*?(\n<!-- claims:end -->)", re.S)
        if not block.search(doc):
            print(f"{args.update_doc} has no <!-- claims:begin --> ... <!-- claims:end --> block", file=sys.stderr)
            return 2
        args.update_doc.write_text(block.sub(lambda m: m.group(1) + text + m.group(2), doc), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
