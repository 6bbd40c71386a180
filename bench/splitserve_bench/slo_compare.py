"""Target tracking vs the SLO controller, in the fleet simulator (``bench/slo_autoscaling.py``).

Why: the claim of SLO autoscaling is "meets the SLO with fewer GPUs than target tracking, with
no per-service tuning". That needs one harness that runs the *same* requests through the
simulator under each policy and scores them the same way:

* **attainment** — the fraction of requests (arrived in the trace) whose TTFT meets the TTFT
  target *and* whose mean inter-token latency (TPOT) meets the ITL target; unfinished requests
  miss both;
* **GPU-hours** — every pod from its creation (a starting pod already holds its GPU) until it
  finished draining, over the trace's span ``[0, last arrival]``.

Policies: ``default`` is target tracking with the spec's default targets
(:class:`~splitserve_planner.sim.config.AutoscaleSettings`); ``tuned`` is target tracking with targets chosen
per trace by a grid search (:data:`TUNING_GRID`, fewest GPU-hours among the points meeting the
attainment, else the best attainment) — the hand-tuning an operator would have to do;
``tuned-floor`` searches the pools' ``min_replicas`` too (:data:`TUNING_FLOORS`); ``slo``
is the SLO controller (:func:`splitserve_operator.autoscaler.slo.controller.decide_slo`) with
the roofline prior (:mod:`splitserve_planner.slo_prior`) and no per-trace setting at all; ``ceiling`` is not a
policy but a bound: every pool at ``max_replicas`` from the first tick. Pods asked for then are
Ready only ``interval + startup`` seconds in, and the router commits each request to a pod Ready
at its arrival, so the requests of that first stretch meet the initial fleet whatever a policy
does: no policy starting from the same fleet attains more than the ceiling (on the CI-size
bursty trace, which opens in its high state at 1.35x the rate the initial fleet is sized for,
it is below 99 %). ``shift-bound`` is a bound too, on traces with a prompt shift only: the SLO
controller until the shift and every pool at ``max_replicas`` from the first tick at or after
it, the most any reaction to the shift attains from the fleet the controller holds when it
comes (it knows of the shift at once and needs no measurement). ``tick-bound`` is the same
from the first tick strictly after the shift (:func:`first_tick_after`): the earliest round
whose window can hold one shifted request, so the most any controller that observes and ticks
every ``interval`` attains; what separates the two is foresight of one interval.
:attr:`Outcome.missed_arrival_seconds` says when the misses arrived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from splitserve_operator.autoscaler.slo.inputs import SloTarget
from splitserve_planner.gpus import get_gpu
from splitserve_planner.model_presets import load_model
from splitserve_planner.perf_model import StepCost, roofline_model
from splitserve_planner.sim.config import (
    DISAGGREGATED,
    AutoscaleSettings,
    EngineSettings,
    FleetConfig,
    SimOptions,
)
from splitserve_planner.sim.observe import gpu_seconds
from splitserve_planner.sim.results import SimResult
from splitserve_planner.simulator import Simulator
from splitserve_planner.slo_attainment import attainment, meets
from splitserve_planner.slo_prior import fit_prior
from splitserve_planner.workload import Request

from .slo_traces import TRACE_KINDS, TraceShape, make_trace, shift_seconds

TUNING_GRID: tuple[tuple[float, float, float], ...] = tuple(
    (prefill_queue, decode_queue, decode_kv)
    for prefill_queue in (0.5, 1.0, 4.0)
    for decode_queue, decode_kv in ((1.0, 0.3), (2.0, 0.5), (2.0, 0.8))
)
"""(prefill queue-depth target, decode queue-depth target, decode KV-utilization target)."""
TUNING_FLOORS: tuple[int, ...] = (1, 2, 3)
"""``min_replicas`` of both pools, the ``tuned-floor`` policy's extra tuning dimension: target
tracking with a floor near the mean load's fleet (2 prefill + 3 decode pods) does not fall to one
pod in a lull, which is what makes the unfloored grid ratchet up to the maximum on the 1-hour
traces."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Model, hardware, SLO, trace sizes and the fleet every policy starts from."""

    model: str = "llama-3.1-8b"
    gpu: str = "L40S"
    slo: SloTarget = SloTarget(ttft_p99_seconds=1.0, itl_p99_seconds=0.05, attainment=0.99)
    shape: TraceShape = TraceShape(mean_rate=20.0, duration_seconds=3600.0)
    seed: int = 1
    initial_prefill: int = 2
    initial_decode: int = 3
    """The fleet at t=0 (enough for the steady trace's mean rate): every policy starts from it."""
    interval_seconds: float = 15.0
    startup_seconds: float = 60.0
    engine: EngineSettings = EngineSettings()
    traces: tuple[str, ...] = TRACE_KINDS
    tuning_seed: int | None = None
    """Where ``tuned`` and ``tuned-floor`` search their setting: None, on the trace they are
    scored on (hindsight); a seed, on that seed's sample of the same trace kind, and the setting
    found there is scored on this scenario's trace (tuned on yesterday's traffic, run on today's)."""
    prefill_overflow_tokens: int = 0
    """The router's ``prefillOverflowTokens`` for every policy (:class:`splitserve_planner.sim.config.FleetConfig`);
    0, the default and the docs' tables: no overflow."""
    observation_lag_seconds: float = 0.0
    """How stale the load the SLO rounds read is (:attr:`splitserve_planner.sim.config.SimOptions.observation_lag_seconds`);
    0, the docs' tables."""


CI_SCENARIO = Scenario(shape=TraceShape(mean_rate=20.0, duration_seconds=900.0))
"""Small enough for a test on one core (each run ~1 s)."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    trace: str
    policy: str
    """``default``, ``tuned`` or ``slo``."""
    attainment: float
    gpu_hours: float
    ttft_p99_seconds: float
    itl_p99_seconds: float
    peak_replicas: dict[str, int]
    settings: str
    """What was configured (targets, or the SLO)."""
    num_requests: int
    overflowed: int = 0
    """Requests the router sent to a decode pod because the prefill pool was full."""
    timeline: list[dict[str, float]] = field(default_factory=list, repr=False)
    missed_arrival_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Arrival times of the finished requests that missed the SLO (unfinished ones are
    ``num_requests`` minus the finished, and miss too)."""

    def misses_between(self, start_seconds: float, end_seconds: float) -> int:
        """Finished requests arrived in ``[start_seconds, end_seconds)`` that missed the SLO."""
        arrived = self.missed_arrival_seconds
        return int(np.count_nonzero((arrived >= start_seconds) & (arrived < end_seconds)))


def perf_of(scenario: Scenario) -> StepCost:
    name, config = load_model(name_or_path=scenario.model)
    return roofline_model(name=name, config=config, gpu=get_gpu(scenario.gpu), tensor_parallel=1, dtype="bfloat16")


def run_policy(
    *,
    scenario: Scenario,
    perf: StepCost,
    requests: list[Request],
    trace: str,
    policy: str,
    autoscale: AutoscaleSettings,
) -> Outcome:
    """One simulated run of ``requests`` under ``autoscale``; scored as the module docstring says."""
    fleet = FleetConfig(
        mode=DISAGGREGATED,
        prefill_replicas=scenario.initial_prefill,
        decode_replicas=scenario.initial_decode,
        engine=scenario.engine,
        autoscale=autoscale,
        prefill_overflow_tokens=scenario.prefill_overflow_tokens,
    )
    sim = Simulator(
        fleet=fleet,
        perf=perf,
        requests=requests,
        options=SimOptions(
            sample_interval_seconds=5.0, seed=scenario.seed, observation_lag_seconds=scenario.observation_lag_seconds
        ),
    )
    result = sim.run()
    end = requests[-1].arrival_seconds if requests else 0.0
    hours = gpu_seconds(sim.all_pods, start_s=0.0, end_s=end, gpus_per_replica=fleet.gpus_per_replica) / 3600.0
    peaks = {
        role: int(
            max(
                (row.get(f"{role}_replicas", 0.0) + row.get(f"{role}_starting", 0.0) for row in result.timeline),
                default=0.0,
            )
        )
        for role in sim.pools
    }
    q = 100.0 * scenario.slo.attainment
    met = meets(ttft=result.ttft_seconds, tpot=result.tpot_seconds, slo=scenario.slo)
    if policy == "ceiling":
        settings = f"every pool at {autoscale.min_replicas} from the first tick (a bound, not a policy)"
    elif autoscale.max_from_seconds is not None:
        settings = (
            f"the SLO controller, every pool at {autoscale.max_replicas} from {autoscale.max_from_seconds:g} s "
            "(a bound, not a policy)"
        )
    elif autoscale.slo is not None:
        settings = (
            f"SLO ttft {autoscale.slo.ttft_p99_seconds * 1e3:g} ms, itl {autoscale.slo.itl_p99_seconds * 1e3:g} ms"
            f" @ {autoscale.slo.attainment:g}, headroom {autoscale.slo.headroom:g}"
        )
    else:
        settings = (
            f"prefill queue {autoscale.prefill_target_queue_depth:g}, decode queue "
            f"{autoscale.decode_target_queue_depth:g}, kv {autoscale.decode_target_kv_utilization:g}"
        )
        if autoscale.min_replicas > 1:
            settings += f", min {autoscale.min_replicas}"
    return Outcome(
        trace=trace,
        policy=policy,
        attainment=attainment(
            ttft=result.ttft_seconds, tpot=result.tpot_seconds, num_requests=result.num_measured, slo=scenario.slo
        ),
        gpu_hours=hours,
        ttft_p99_seconds=result.ttft_percentile(q),
        itl_p99_seconds=result.itl_percentile(q),
        peak_replicas=peaks,
        settings=settings,
        num_requests=result.num_measured,
        overflowed=sim.overflowed,
        timeline=result.timeline,
        missed_arrival_seconds=result.arrival_seconds[~met],
    )


def run_fixed_fleet(
    *, scenario: Scenario, perf: StepCost, requests: list[Request], prefill: int, decode: int
) -> SimResult:
    """The requests on a fleet that never scales (a hindsight reference, or a model check)."""
    fleet = FleetConfig(
        mode=DISAGGREGATED,
        prefill_replicas=prefill,
        decode_replicas=decode,
        engine=scenario.engine,
        prefill_overflow_tokens=scenario.prefill_overflow_tokens,
    )
    return Simulator(
        fleet=fleet, perf=perf, requests=requests, options=SimOptions(sample_interval_seconds=5.0, seed=scenario.seed)
    ).run()


def base_settings(scenario: Scenario) -> AutoscaleSettings:
    return AutoscaleSettings(interval_seconds=scenario.interval_seconds, startup_seconds=scenario.startup_seconds)


def slo_settings(
    scenario: Scenario, perf: StepCost, *, headroom: float | None = None, with_prior: bool = True
) -> AutoscaleSettings:
    """The SLO controller with the roofline prior; nothing tuned per trace (``headroom``: the
    spec's ``headroom`` instead of the scenario's, for the ``slo@H`` sweep; ``with_prior``
    False: no prior at all, the fit learns from the pods alone, as for a user who never ran
    ``splitserve plan``: the ``slo-no-prior`` policy)."""
    prior = (
        fit_prior(
            perf, max_batched_tokens=scenario.engine.max_batched_tokens, max_num_seqs=scenario.engine.max_num_seqs
        ).coefficients
        if with_prior
        else None
    )
    slo = replace(scenario.slo, prior=prior)
    if headroom is not None:
        slo = replace(slo, headroom=headroom)
    return replace(base_settings(scenario), slo=slo)


def headroom_of(policy: str) -> float | None:
    """The headroom of an ``slo@H`` policy name (``slo@0.9``), None for any other name;
    ``ValueError`` when H is not a number in (0, 1]."""
    name, at, value = policy.partition("@")
    if name != "slo" or not at:
        return None
    try:
        headroom = float(value)
    except ValueError:
        raise ValueError(f"policy {policy!r}: the headroom after 'slo@' must be a number in (0, 1]") from None
    if not 0.0 < headroom <= 1.0:
        raise ValueError(f"policy {policy!r}: the headroom after 'slo@' must be in (0, 1]")
    return headroom


def ceiling_settings(scenario: Scenario) -> AutoscaleSettings:
    """Every pool at ``max_replicas`` from the first tick on (the module docstring's ceiling)."""
    base = base_settings(scenario)
    return replace(base, min_replicas=base.max_replicas)


def tune(
    *,
    scenario: Scenario,
    perf: StepCost,
    requests: list[Request],
    trace: str,
    floors: tuple[int, ...] = (1,),
    policy: str = "tuned",
    tuning_requests: list[Request] | None = None,
) -> Outcome:
    """Target tracking with the :data:`TUNING_GRID` point (× ``floors``, the pools'
    ``min_replicas``) that meets the attainment with the fewest GPU-hours (none meets it: the
    best attainment, then the fewest GPU-hours).

    ``tuning_requests``: search on these (another sample of the same trace kind: the traffic
    an operator tuned on) and report the chosen setting run on ``requests`` (the traffic it then
    serves); None: search and report on ``requests`` (tuning with hindsight)."""
    search_on = requests if tuning_requests is None else tuning_requests
    best: tuple[Outcome, AutoscaleSettings] | None = None
    for floor in floors:
        for prefill_queue, decode_queue, decode_kv in TUNING_GRID:
            settings = replace(
                base_settings(scenario),
                prefill_target_queue_depth=prefill_queue,
                decode_target_queue_depth=decode_queue,
                decode_target_kv_utilization=decode_kv,
                min_replicas=floor,
            )
            outcome = run_policy(
                scenario=scenario, perf=perf, requests=search_on, trace=trace, policy=policy, autoscale=settings
            )
            if best is None or _better(outcome, best[0], target=scenario.slo.attainment):
                best = (outcome, settings)
    assert best is not None
    if tuning_requests is None:
        return best[0]
    served = run_policy(scenario=scenario, perf=perf, requests=requests, trace=trace, policy=policy, autoscale=best[1])
    return replace(served, settings=f"{served.settings} (tuned on seed {scenario.tuning_seed})")


def _better(a: Outcome, b: Outcome, *, target: float) -> bool:
    a_meets, b_meets = a.attainment >= target, b.attainment >= target
    if a_meets != b_meets:
        return a_meets
    if a_meets:
        return a.gpu_hours < b.gpu_hours
    return (a.attainment, -a.gpu_hours) > (b.attainment, -b.gpu_hours)


POLICIES = ("default", "tuned", "tuned-floor", "slo", "slo-no-prior", "ceiling", "shift-bound", "tick-bound")
"""The named policies; ``slo@H`` is the SLO controller with ``headroom`` H (a sweep, the same
setting on every trace), ``slo-no-prior`` the controller with no prior (online calibration
alone). ``shift-bound`` and ``tick-bound`` run on the traces with a prompt shift only."""


BOUNDS = ("shift-bound", "tick-bound")
"""The bounds on reacting to a prompt shift, loosest first."""


def first_tick_after(seconds: float, interval_seconds: float) -> float:
    """The first autoscaler tick (at ``k × interval``, k ≥ 1) strictly after ``seconds``: the
    earliest round whose window can hold a request that arrived after that moment."""
    return (math.floor(seconds / interval_seconds) + 1) * interval_seconds


def compare(scenario: Scenario, *, policies: tuple[str, ...] = ("default", "tuned", "slo")) -> list[Outcome]:
    """Every policy on every trace of the scenario, in trace then policy order."""
    perf = perf_of(scenario)
    out: list[Outcome] = []
    for trace in scenario.traces:
        requests = make_trace(trace, scenario.shape, seed=scenario.seed)
        tuning_seed = scenario.tuning_seed
        tuning = (
            make_trace(trace, scenario.shape, seed=tuning_seed)
            if tuning_seed not in (None, scenario.seed) and {"tuned", "tuned-floor"} & set(policies)
            else None
        )
        for policy in policies:
            if policy == "default":
                out.append(
                    run_policy(
                        scenario=scenario,
                        perf=perf,
                        requests=requests,
                        trace=trace,
                        policy=policy,
                        autoscale=base_settings(scenario),
                    )
                )
            elif policy == "tuned":
                out.append(tune(scenario=scenario, perf=perf, requests=requests, trace=trace, tuning_requests=tuning))
            elif policy == "tuned-floor":
                out.append(
                    tune(
                        scenario=scenario,
                        perf=perf,
                        requests=requests,
                        trace=trace,
                        floors=TUNING_FLOORS,
                        policy=policy,
                        tuning_requests=tuning,
                    )
                )
            elif policy == "slo":
                out.append(
                    run_policy(
                        scenario=scenario,
                        perf=perf,
                        requests=requests,
                        trace=trace,
                        policy=policy,
                        autoscale=slo_settings(scenario, perf),
                    )
                )
            elif policy == "slo-no-prior":
                out.append(
                    run_policy(
                        scenario=scenario,
                        perf=perf,
                        requests=requests,
                        trace=trace,
                        policy=policy,
                        autoscale=slo_settings(scenario, perf, with_prior=False),
                    )
                )
            elif (headroom := headroom_of(policy)) is not None:
                out.append(
                    run_policy(
                        scenario=scenario,
                        perf=perf,
                        requests=requests,
                        trace=trace,
                        policy=policy,
                        autoscale=slo_settings(scenario, perf, headroom=headroom),
                    )
                )
            elif policy == "ceiling":
                out.append(
                    run_policy(
                        scenario=scenario,
                        perf=perf,
                        requests=requests,
                        trace=trace,
                        policy=policy,
                        autoscale=ceiling_settings(scenario),
                    )
                )
            elif policy in ("shift-bound", "tick-bound"):
                shift = shift_seconds(trace, scenario.shape)
                if shift is not None:
                    at = shift if policy == "shift-bound" else first_tick_after(shift, scenario.interval_seconds)
                    out.append(
                        run_policy(
                            scenario=scenario,
                            perf=perf,
                            requests=requests,
                            trace=trace,
                            policy=policy,
                            autoscale=replace(slo_settings(scenario, perf), max_from_seconds=at),
                        )
                    )
            else:
                raise ValueError(
                    f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}, or slo@H "
                    "(H the headroom, in (0, 1])"
                )
    return out


def _ms(seconds: float) -> str:
    return "inf" if not math.isfinite(seconds) else f"{seconds * 1e3:.0f}"


def format_table(outcomes: list[Outcome], *, scenario: Scenario) -> str:
    """A markdown table, one row per (trace, policy)."""
    slo = scenario.slo
    lines = [
        f"{scenario.model} on {scenario.gpu}, SLO TTFT {slo.ttft_p99_seconds * 1e3:g} ms / ITL "
        f"{slo.itl_p99_seconds * 1e3:g} ms at {slo.attainment:.0%}; mean {scenario.shape.mean_rate:g} req/s "
        f"over {scenario.shape.duration_seconds:g} s, seed {scenario.seed}",
        "",
        "| trace | policy | attainment | GPU-hours | TTFT p | ITL p | peak P/D | configured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        meets = "" if o.attainment >= slo.attainment else " (miss)"
        lines.append(
            f"| {o.trace} | {o.policy} | {o.attainment:.2%}{meets} | {o.gpu_hours:.2f} | "
            f"{_ms(o.ttft_p99_seconds)} ms | {_ms(o.itl_p99_seconds)} ms | "
            f"{o.peak_replicas.get('prefill', 0)}/{o.peak_replicas.get('decode', 0)} | {o.settings} |"
        )
    return "\n".join(lines)


def format_seed_summary(by_seed: dict[int, list[Outcome]], *, scenario: Scenario) -> str:
    """One row per (trace, policy) over several seeds: on how many the policy met the attainment,
    and its attainment and GPU-hours on each (a ``(miss)`` where it did not meet). Where the
    trace has a ``shift-bound`` or ``tick-bound`` row, the other rows also count the seeds they
    meet among those each bound meets: a seed ``tick-bound`` misses is out of reach of any
    reaction to the shift by a controller ticking every ``interval``, one ``shift-bound`` misses
    out of reach even of foresight."""
    seeds = sorted(by_seed)
    target = scenario.slo.attainment
    cells: dict[tuple[str, str], dict[int, Outcome]] = {}
    for seed in seeds:
        for o in by_seed[seed]:
            cells.setdefault((o.trace, o.policy), {})[seed] = o
    lines = [
        f"| trace | policy | meets | {' | '.join(f'seed {seed}' for seed in seeds)} |",
        "| --- | --- | --- |" + " --- |" * len(seeds),
    ]
    for (trace, policy), row in cells.items():
        met_seeds = {seed for seed, o in row.items() if o.attainment >= target}
        met = f"{len(met_seeds)} of {len(row)}"
        within = []
        for bound_name in BOUNDS:
            bound = cells.get((trace, bound_name))
            if bound is not None and policy != bound_name:
                reachable = {seed for seed, o in bound.items() if o.attainment >= target}
                within.append(f"{len(met_seeds & reachable)} of {bound_name}'s {len(reachable)}")
        if within:
            met += f" ({', '.join(within)})"
        values = [
            (
                "-"
                if seed not in row
                else f"{row[seed].gpu_hours:.2f}"
                if row[seed].attainment >= target
                else f"{row[seed].attainment:.2%} (miss), {row[seed].gpu_hours:.2f}"
            )
            for seed in seeds
        ]
        lines.append(f"| {trace} | {policy} | {met} | {' | '.join(values)} |")
    return "\n".join(lines)
