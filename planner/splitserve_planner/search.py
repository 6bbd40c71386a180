"""The cheapest pool sizes that meet the SLOs: analytic lower bounds, then simulation.

1. **Headroom rule (analytic)**. Demand: uncached prompt tokens/s (every shared prefix counted
   as a hit, an optimistic bound) and output tokens/s of the workload. Capacity per pod:
   prefill tokens/s of full ``max_batched_tokens`` steps; decode tokens/s at the largest batch
   whose step stays within the ITL SLO and whose KV fits. A pool must run at most ``headroom``
   of its capacity at the peak rate (the 70–80 % rule): that gives lower bounds on the counts.
2. **SLOs (simulated)**. From the bounds, search upwards (gallop, then bisect) for the
   smallest counts whose simulated p99 TTFT and p99 ITL meet the SLOs with nothing left
   unfinished. Disaggregated: the decode count first (ITL depends on decode only), then the
   prefill count for TTFT, then decode again if TTFT is still lost in decode admission.
   Aggregated: the count for each token budget in ``AGGREGATED_BUDGETS`` (a smaller budget
   bounds the ITL spike a prefill chunk causes), cheapest wins.

Every simulation of one search uses the same requests, so answers are monotone in load when
the workload is generated coupled across rates (:mod:`.workload`).

3. **Tensor parallelism** (:func:`plan_tensor_parallel`). Steps 1–2 for each TP size, smallest
   first: a size the model does not fit or cannot be split by is skipped with the reason, and
   so is one whose single pod already holds as many GPUs as the best plan so far uses (it cannot
   be cheaper). The fewest GPUs win; on a tie the smaller TP (less communication, more pods to
   scale by).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from splitserve_contract import capabilities as caps
from splitserve_contract import defaults

from .perf_model import (
    ModelDoesNotFit,
    RooflineModel,
    StepCost,
    TensorParallelRefused,
    decode_step_seconds,
    prefill_attention_pairs,
)
from .simulator import (
    AGGREGATED,
    DISAGGREGATED,
    EngineSettings,
    FleetConfig,
    SimOptions,
    SimResult,
    simulate,
)
from .speculation import decode_capacity, verify_step_seconds
from .supported import remedies, supported_tensor_parallel_sizes
from .workload import Request

AGGREGATED_BUDGETS = (defaults.MAX_NUM_BATCHED_TOKENS, 2048, 512)
"""Token budgets tried for aggregated pods: the runtime's default, then smaller ones (a smaller
budget bounds the ITL spike a prefill chunk causes)."""


class PlanError(ValueError):
    """The request cannot be planned (impossible SLO, nothing fits); the message says why."""


@dataclass(frozen=True, kw_only=True)
class Slo:
    ttft_p99_seconds: float
    itl_p99_seconds: float

    def met_by(self, result: SimResult) -> bool:
        return (
            result.num_unfinished == 0
            and result.ttft_percentile(99) <= self.ttft_p99_seconds
            and result.itl_percentile(99) <= self.itl_p99_seconds
        )


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    perf: StepCost
    requests: list[Request]
    slo: Slo
    headroom: float = 0.75
    engine: EngineSettings = EngineSettings()
    gpus_per_replica: int = 1
    router_policy: str = "prefix-affinity"
    kv_link_bytes_per_second: float = 50e9
    warmup_seconds: float = 10.0
    max_replicas: int = 128
    seed: int = 0
    what_if: bool = False
    """Allow a TP size this version does not serve (roofline what-if; never emitted)."""

    def __post_init__(self) -> None:
        if not self.what_if and self.gpus_per_replica not in supported_tensor_parallel_sizes():
            raise PlanError(caps.TENSOR_PARALLEL_SIZE.unsupported_message(self.gpus_per_replica))
        if not 0.1 <= self.headroom <= 1.0:
            raise PlanError(f"headroom must be in [0.1, 1.0] (e.g. 0.75 for the 70–80 % rule), got {self.headroom}")
        if len(self.requests) < 10:
            raise PlanError("the workload holds fewer than 10 requests; raise the rate or the duration")
        if self.slo.ttft_p99_seconds <= 0 or self.slo.itl_p99_seconds <= 0:
            raise PlanError("SLOs must be > 0 ms")


@dataclass(kw_only=True)
class Demand:
    span_seconds: float
    prompt_tokens_per_second: float
    uncached_prompt_tokens_per_second: float
    output_tokens_per_second: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    p99_uncached_prompt_tokens: int

    @classmethod
    def of(cls, requests: list[Request], *, prefix_caching: bool, block_size: int) -> Demand:
        span = max(requests[-1].arrival_seconds - requests[0].arrival_seconds, 1e-9)
        prompt = [r.num_prompt_tokens for r in requests]
        uncached = [
            r.num_prompt_tokens
            - ((r.num_prefix_tokens // block_size) * block_size if prefix_caching and r.prefix_group >= 0 else 0)
            for r in requests
        ]
        output = [r.num_output_tokens for r in requests]
        ordered = sorted(uncached)
        return cls(
            span_seconds=span,
            prompt_tokens_per_second=sum(prompt) / span,
            uncached_prompt_tokens_per_second=sum(uncached) / span,
            output_tokens_per_second=sum(output) / span,
            mean_prompt_tokens=sum(prompt) / len(prompt),
            mean_output_tokens=sum(output) / len(output),
            p99_uncached_prompt_tokens=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        )


@dataclass(kw_only=True)
class Capacity:
    prefill_tokens_per_second: float
    decode_batch: int
    decode_tokens_per_second: float
    decode_speculating: bool = False
    """The best decode batch is within the speculation rule (its forwards verify proposals)."""


def capacity(*, perf: StepCost, engine: EngineSettings, demand: Demand, itl_seconds: float) -> Capacity:
    budget = engine.max_batched_tokens
    per_seq = max(1.0, min(demand.mean_prompt_tokens, budget))
    seqs = max(1, int(budget // per_seq))
    pairs = int(seqs * prefill_attention_pairs(num_new_tokens=int(per_seq), num_computed_tokens=0))
    step = perf.step_seconds(num_tokens=budget, num_seqs=seqs, num_attention_pairs=pairs, num_kv_tokens=0)
    context = demand.mean_prompt_tokens + demand.mean_output_tokens / 2
    decode = decode_capacity(
        perf,
        itl_seconds=itl_seconds,
        mean_context_tokens=context,
        max_num_seqs=engine.max_num_seqs,
        speculation=engine.speculation,
    )
    return Capacity(
        prefill_tokens_per_second=budget / step,
        decode_batch=decode.batch,
        decode_tokens_per_second=decode.tokens_per_second,
        decode_speculating=decode.speculating,
    )


@dataclass(kw_only=True)
class Plan:
    """One searched configuration with its simulated result."""

    mode: str
    prefix_caching: bool
    prefill_replicas: int
    decode_replicas: int
    aggregated_replicas: int
    gpus_per_replica: int
    max_batched_tokens: int
    result: SimResult
    utilization: dict[str, float]
    """Analytic demand / capacity per pool at the peak rate (the headroom rule's figure)."""
    simulations: int
    notes: list[str] = field(default_factory=list)

    @property
    def num_gpus(self) -> int:
        return (self.prefill_replicas + self.decode_replicas + self.aggregated_replicas) * self.gpus_per_replica


def check_feasible(inputs: PlanInputs) -> None:
    """Reject SLOs no fleet size can meet, with the reason (raises :class:`PlanError`)."""
    perf, slo, engine = inputs.perf, inputs.slo, inputs.engine
    roofline = perf if isinstance(perf, RooflineModel) else None
    remedy = remedies(
        tensor_parallel=inputs.gpus_per_replica,
        what_if=inputs.what_if,
        precision=roofline.precision if roofline else None,
        gpu=roofline.gpu if roofline else None,
    )
    demand = Demand.of(inputs.requests, prefix_caching=engine.prefix_caching, block_size=engine.block_size)
    single = decode_step_seconds(perf, batch_size=1, num_context_tokens=int(demand.mean_prompt_tokens))
    if single > slo.itl_p99_seconds:
        raise PlanError(
            f"impossible ITL SLO: p99 {slo.itl_p99_seconds * 1e3:g} ms is below one decode step of a "
            f"single sequence ({single * 1e3:.2f} ms for {perf.name}); relax --itl-p99-ms or use "
            f"{remedy}"
        )
    spec = engine.speculation
    if spec.applies(1):
        verify = verify_step_seconds(
            perf, batch_size=1, num_context_tokens=int(demand.mean_prompt_tokens), num_tokens=spec.num_tokens
        )
        if verify > slo.itl_p99_seconds:
            raise PlanError(
                f"impossible ITL SLO with speculation: p99 {slo.itl_p99_seconds * 1e3:g} ms is below one "
                f"verification forward of a single sequence (1 + {spec.num_tokens} tokens, "
                f"{verify * 1e3:.2f} ms for {perf.name}); lower --num-speculative-tokens, turn "
                "--speculative off or relax --itl-p99-ms"
            )
    tokens = demand.p99_uncached_prompt_tokens
    chunk = min(tokens, engine.max_batched_tokens)
    steps = math.ceil(tokens / chunk)
    alone = sum(
        perf.step_seconds(
            num_tokens=chunk,
            num_seqs=1,
            num_kv_tokens=i * chunk,
            num_attention_pairs=prefill_attention_pairs(num_new_tokens=chunk, num_computed_tokens=i * chunk),
        )
        for i in range(steps)
    )
    if alone > slo.ttft_p99_seconds:
        raise PlanError(
            f"impossible TTFT SLO: p99 {slo.ttft_p99_seconds * 1e3:g} ms is below the prefill of a "
            f"p99-length prompt ({tokens} uncached tokens) on an idle pod ({alone * 1e3:.1f} ms for "
            f"{perf.name}); relax --ttft-p99-ms or use {remedy}"
        )
    longest = max(r.num_prompt_tokens + r.num_output_tokens for r in inputs.requests)
    if longest > perf.kv_capacity_tokens:
        raise PlanError(
            f"a request of {longest} tokens does not fit the KV cache of one pod "
            f"({perf.kv_capacity_tokens} tokens); use {remedy}"
        )


def _smallest(low: int, high: int, ok: Callable[[int], bool]) -> int | None:
    """Smallest n in [low, high] with ok(n), assuming ok is monotone: gallop, then bisect."""
    if low > high:
        return None
    if ok(low):
        return low
    bad, step = low, 1
    while True:
        probe = min(bad + step, high)
        if ok(probe):
            good = probe
            break
        if probe == high:
            return None
        bad, step = probe, step * 2
    while good - bad > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


class _Runner:
    """Simulations of one search, memoised by configuration."""

    def __init__(self, inputs: PlanInputs, engine: EngineSettings) -> None:
        self.inputs = inputs
        self.engine = engine
        self.cache: dict[tuple[int, int, int], SimResult] = {}

    def run(self, *, prefill: int = 0, decode: int = 0, aggregated: int = 0) -> SimResult:
        key = (prefill, decode, aggregated)
        if key not in self.cache:
            i = self.inputs
            fleet = FleetConfig(
                mode=AGGREGATED if aggregated else DISAGGREGATED,
                prefill_replicas=prefill,
                decode_replicas=decode,
                aggregated_replicas=aggregated,
                gpus_per_replica=i.gpus_per_replica,
                engine=self.engine,
                router_policy=i.router_policy,
                kv_link_bytes_per_second=i.kv_link_bytes_per_second,
            )
            self.cache[key] = simulate(
                fleet=fleet,
                perf=i.perf,
                requests=i.requests,
                options=SimOptions(warmup_seconds=i.warmup_seconds, seed=i.seed, sample_interval_seconds=0),
            )
        return self.cache[key]


def plan_disaggregated(inputs: PlanInputs) -> Plan | None:
    engine, slo = inputs.engine, inputs.slo
    demand = Demand.of(inputs.requests, prefix_caching=engine.prefix_caching, block_size=engine.block_size)
    cap = capacity(perf=inputs.perf, engine=engine, demand=demand, itl_seconds=slo.itl_p99_seconds)
    if cap.decode_batch == 0:
        return None
    p_low = max(
        1, math.ceil(demand.uncached_prompt_tokens_per_second / (cap.prefill_tokens_per_second * inputs.headroom))
    )
    d_low = max(1, math.ceil(demand.output_tokens_per_second / (cap.decode_tokens_per_second * inputs.headroom)))
    runner = _Runner(inputs, engine)
    limit = inputs.max_replicas
    p_generous = min(limit, 2 * p_low + 1)

    def itl_ok(d: int) -> bool:
        r = runner.run(prefill=p_generous, decode=d)
        return r.num_unfinished == 0 and r.itl_percentile(99) <= slo.itl_p99_seconds

    decode = _smallest(d_low, limit, itl_ok)
    if decode is None:
        return None
    prefill: int | None = None
    for _ in range(8):
        d = decode

        def ttft_ok(p: int, d: int = d) -> bool:
            return slo.met_by(runner.run(prefill=p, decode=d))

        prefill = _smallest(p_low, limit, ttft_ok)
        if prefill is not None:
            break
        decode += max(1, decode // 4)  # TTFT lost in decode admission: more decode pods
        if decode > limit:
            return None
    if prefill is None:
        return None
    result = runner.run(prefill=prefill, decode=decode)
    return Plan(
        mode=DISAGGREGATED,
        prefix_caching=engine.prefix_caching,
        prefill_replicas=prefill,
        decode_replicas=decode,
        aggregated_replicas=0,
        gpus_per_replica=inputs.gpus_per_replica,
        max_batched_tokens=engine.max_batched_tokens,
        result=result,
        simulations=len(runner.cache),
        utilization={
            "prefill": demand.uncached_prompt_tokens_per_second / (prefill * cap.prefill_tokens_per_second),
            "decode": demand.output_tokens_per_second / (decode * cap.decode_tokens_per_second),
        },
        notes=[
            f"decode batch at the ITL SLO: {cap.decode_batch}"
            + (
                f" (speculating, {engine.speculation.tokens_per_forward:.2f} tokens/forward)"
                if cap.decode_speculating
                else ""
            ),
            f"lower bounds from {inputs.headroom:.0%} headroom: prefill {p_low}, decode {d_low}",
        ],
    )


def plan_aggregated(inputs: PlanInputs, *, budgets: tuple[int, ...] = AGGREGATED_BUDGETS) -> Plan | None:
    best: Plan | None = None
    for budget in budgets:
        if budget < inputs.engine.max_num_seqs:
            continue
        engine = replace(inputs.engine, max_batched_tokens=budget)
        demand = Demand.of(inputs.requests, prefix_caching=engine.prefix_caching, block_size=engine.block_size)
        cap = capacity(perf=inputs.perf, engine=engine, demand=demand, itl_seconds=inputs.slo.itl_p99_seconds)
        if cap.decode_batch == 0:
            continue
        load = (
            demand.uncached_prompt_tokens_per_second / cap.prefill_tokens_per_second
            + demand.output_tokens_per_second / cap.decode_tokens_per_second
        )
        low = max(1, math.ceil(load / inputs.headroom))
        high = inputs.max_replicas if best is None else best.aggregated_replicas - 1
        runner = _Runner(inputs, engine)

        def meets(n: int, runner: _Runner = runner) -> bool:
            return inputs.slo.met_by(runner.run(aggregated=n))

        count = _smallest(low, high, meets)
        if count is None:
            continue
        best = Plan(
            mode=AGGREGATED,
            prefix_caching=engine.prefix_caching,
            prefill_replicas=0,
            decode_replicas=0,
            aggregated_replicas=count,
            gpus_per_replica=inputs.gpus_per_replica,
            max_batched_tokens=budget,
            result=runner.run(aggregated=count),
            simulations=len(runner.cache),
            utilization={"aggregated": load / count},
            notes=[f"lower bound from {inputs.headroom:.0%} headroom: {low}"],
        )
    return best


@dataclass(kw_only=True)
class PlanTable:
    """Every searched variant; ``best`` is the cheapest one that met the SLOs."""

    plans: dict[str, Plan | None]

    @property
    def best(self) -> Plan | None:
        found = [p for p in self.plans.values() if p is not None]
        return min(found, key=lambda p: (p.num_gpus, p.result.ttft_percentile(99))) if found else None


def plan_all(inputs: PlanInputs, *, compare_prefix_caching: bool = True) -> PlanTable:
    """Disaggregated and aggregated, with prefix caching as configured and (when the workload
    shares prefixes and caching is on) without it."""
    check_feasible(inputs)
    plans: dict[str, Plan | None] = {}
    caching_variants = [inputs.engine.prefix_caching]
    if compare_prefix_caching and inputs.engine.prefix_caching and any(r.prefix_group >= 0 for r in inputs.requests):
        caching_variants.append(False)
    for caching in caching_variants:
        variant = replace(inputs, engine=replace(inputs.engine, prefix_caching=caching))
        suffix = "prefix cache" if caching else "no prefix cache"
        plans[f"{DISAGGREGATED}, {suffix}"] = plan_disaggregated(variant)
        plans[f"{AGGREGATED}, {suffix}"] = plan_aggregated(variant)
    return PlanTable(plans=plans)


@dataclass(kw_only=True)
class TensorParallelOption:
    """One TP size of a :func:`plan_tensor_parallel` search: its plans, or why it has none."""

    tensor_parallel: int
    inputs: PlanInputs | None = None
    table: PlanTable | None = None
    reason: str = ""
    """Why there is no plan: does not fit, cannot be split, an impossible SLO, not searched."""

    @property
    def best(self) -> Plan | None:
        return self.table.best if self.table is not None else None


@dataclass(kw_only=True)
class TensorParallelSearch:
    options: list[TensorParallelOption]

    @property
    def best(self) -> TensorParallelOption | None:
        """The option whose best plan uses the fewest GPUs (then the smaller TP)."""
        found = [o for o in self.options if o.best is not None]
        return min(found, key=lambda o: (_num_gpus(o), o.tensor_parallel)) if found else None

    def reasons(self) -> str:
        """``TP=1: reason; TP=2: reason`` for every size without a plan."""
        return "; ".join(f"TP={o.tensor_parallel}: {o.reason}" for o in self.options if o.best is None)


def _num_gpus(option: TensorParallelOption) -> int:
    plan = option.best
    assert plan is not None
    return plan.num_gpus


def plan_tensor_parallel(
    inputs_at: Callable[[int], PlanInputs], sizes: Iterable[int], *, compare_prefix_caching: bool = True
) -> TensorParallelSearch:
    """:func:`plan_all` at each TP size (see the module docstring, step 3). ``inputs_at(tp)``
    builds the inputs of one size and raises :class:`~.perf_model.ModelDoesNotFit` or
    :class:`~.perf_model.TensorParallelRefused` for a size the model cannot use."""
    options: list[TensorParallelOption] = []
    for tp in sorted(sizes):
        search = TensorParallelSearch(options=options)
        leader = search.best
        if leader is not None and tp >= _num_gpus(leader):
            options.append(
                TensorParallelOption(
                    tensor_parallel=tp,
                    reason=f"not searched: one pod of {tp} GPUs cannot beat "
                    f"{_num_gpus(leader)} GPUs at TP={leader.tensor_parallel}",
                )
            )
            continue
        try:
            inputs = inputs_at(tp)
            table = plan_all(inputs, compare_prefix_caching=compare_prefix_caching)
        except (ModelDoesNotFit, TensorParallelRefused, PlanError) as exc:
            options.append(TensorParallelOption(tensor_parallel=tp, reason=str(exc)))
            continue
        reason = (
            ""
            if table.best is not None
            else f"no configuration with at most {inputs.max_replicas} replicas per pool meets the SLOs"
        )
        options.append(TensorParallelOption(tensor_parallel=tp, inputs=inputs, table=table, reason=reason))
    return TensorParallelSearch(options=options)
