"""``splitserve plan``: size prefill/decode pools for a model, a GPU, a workload and SLOs.

Prints a table of the cheapest configuration per variant (disaggregated / aggregated, with /
without prefix caching), each found by :mod:`.search` (headroom rule, then simulation), and
the overall choice. ``--emit-manifest`` writes an InferenceService for the choice,
``--plot`` a PNG of p99 latency vs load for it. Bad input exits with code 2 and one line
saying what is wrong (unknown GPU: the known ones; a model that does not fit: the memory it
needs; an SLO no fleet can meet: why). Settings this version of splitserve does not serve
(:mod:`splitserve_contract.capabilities`) are refused with the capabilities table's message, as
the CRD refuses them; ``--what-if`` prices them with the roofline instead, labelled as such, and
never emits a manifest for them.

``--tp auto`` (the default) plans every tensor-parallel size the model fits and can be split by
and keeps the one with the fewest GPUs (:func:`~.search.plan_tensor_parallel`), printing each
size's outcome; ``--tp N`` plans that size only. At TP > 1 the header says how much of a decode
step the all-reduces take (:meth:`~.perf_model.RooflineModel.communication_seconds`).

Precision is three flags, priced separately (:mod:`.precision`): ``--dtype`` (activations,
embeddings, LM head), ``--quantization none|fp8|int8|int4`` (linear-layer weights and their
GEMM rate) and ``--kv-cache-dtype auto|fp8``; ``--dtype fp8`` still means ``--quantization fp8``.

``--slo ttft=500ms,itl=50ms[,attainment=0.99][,headroom=0.8]`` sets the SLOs (instead of
``--ttft-p99-ms``/``--itl-p99-ms``) and then runs the operator's SLO controller in the simulator
over the workload from the chosen plan's counts (:mod:`.slo_plan`): it prints the replicas per
pool over time, the GPU-hours and the attainment, and ``--emit-manifest`` writes
``spec.autoscaling.slo`` with the roofline prior (:mod:`.slo_prior`) the online fit starts from.

``--speculative ngram`` prices speculative decoding on decode and aggregated pods
(:mod:`.speculation`): ``--spec-acceptance`` is the workload's per-position acceptance,
``--num-speculative-tokens`` and ``--speculative-max-num-seqs`` the runtime's flags, written
to the manifest as ``spec.scheduling.speculative``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from splitserve_contract import capabilities as caps
from splitserve_contract import defaults
from splitserve_operator.autoscaler.slo.inputs import SloTarget

from .gpus import get_gpu
from .model_presets import HF_IDS, load_model
from .perf_model import (
    ModelDoesNotFit,
    RooflineModel,
    StepCost,
    TensorParallelRefused,
    decode_step_seconds,
    prefill_seconds,
    roofline_model,
)
from .precision import ACTIVATION_BYTES, FP8_ALIAS, KV_CACHE_DTYPES, QUANTIZATIONS, Precision
from .profile import ProfileError, ProfileModel, load_profile
from .search import (
    Demand,
    Plan,
    PlanError,
    PlanInputs,
    PlanTable,
    Slo,
    TensorParallelOption,
    capacity,
    plan_all,
    plan_tensor_parallel,
)
from .simulator import (
    AGGREGATED,
    ROUTER_POLICIES,
    EngineSettings,
    FleetConfig,
    SimOptions,
    simulate,
)
from .slo_plan import format_report, parse_slo, simulate_controller, slo_manifest
from .speculation import DEFAULT_ACCEPTANCE, DEFAULT_NUM_TOKENS, Speculation, decode_forward_seconds
from .speculation import DEFAULT_MAX_NUM_SEQS as DEFAULT_SPEC_MAX_NUM_SEQS
from .speculation import METHODS as SPECULATIVE_METHODS
from .supported import (
    known_tensor_parallel_sizes,
    remedies,
    supported_tensor_parallel_sizes,
    unsupported_settings,
)
from .workload import Arrivals, LengthDist, Request, WorkloadSpec, load_trace

EXIT_BAD_INPUT = 2
AUTO = "auto"
MIN_SIMULATED_REQUESTS = 3000
MAX_SIMULATED_REQUESTS = 20000


def _values(values: Iterable[object]) -> str:
    """``1, 2, 4 or 8``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"splitserve plan: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _tensor_parallel(text: str) -> int | None:
    """``--tp``: a size, or ``auto`` (None)."""
    if text == AUTO:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {AUTO} or a size, got {text!r}") from None


def _slo_arg(text: str) -> SloTarget:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="splitserve plan", description=__doc__.splitlines()[0] if __doc__ else None)
    m = p.add_argument_group("model and hardware")
    m.add_argument(
        "--model",
        default="llama-3.1-8b",
        help="preset (llama-3.1-8b, llama-3.1-70b, qwen2-7b, tiny) or a config.json path",
    )
    m.add_argument("--gpu", default="H100-SXM", help="GPU type (H100-SXM, H200, A100-80GB, L40S, ...)")
    m.add_argument(
        "--tp",
        type=_tensor_parallel,
        default=None,
        metavar=f"{{{AUTO},N}}",
        help=f"tensor-parallel GPUs per pod (this version serves {_values(supported_tensor_parallel_sizes())}; "
        f"others only with --what-if); {AUTO} (default): plan each size the model fits, "
        "keep the fewest GPUs",
    )
    m.add_argument(
        "--dtype",
        default="bfloat16",
        help=f"activation dtype (spec.model.dtype): {_values(ACTIVATION_BYTES)}; "
        f"{FP8_ALIAS} is an alias for --quantization fp8",
    )
    m.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="weight quantization of the linear layers (spec.model.quantization): fp8/int8 W8A8 "
        "(FP8/INT8 tensor cores; fp8 needs an FP8 GPU), int4 W4A16 group 128",
    )
    m.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache element type (spec.kvCache.dtype): auto = the activation dtype, fp8 = 1 byte",
    )
    m.add_argument(
        "--what-if",
        action="store_true",
        help="price settings this version does not serve with the roofline; "
        "labelled as a what-if, never with --emit-manifest",
    )
    m.add_argument("--profile", type=Path, default=None, help="measured profile (JSON/YAML) instead of the roofline")
    m.add_argument("--memory-fraction", type=float, default=defaults.KV_MEMORY_FRACTION)
    m.add_argument(
        "--compute-efficiency", type=float, default=None, help="override the GPU default (fraction of peak FLOP/s)"
    )
    m.add_argument(
        "--bandwidth-efficiency", type=float, default=None, help="override the GPU default (fraction of HBM bandwidth)"
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--rate", type=float, default=None, help="peak requests/s (with --trace: rescale the trace to this rate)"
    )
    w.add_argument("--arrival", choices=("poisson", "bursty"), default="poisson")
    w.add_argument("--burst-factor", type=float, default=4.0, help="bursty: high/low rate ratio")
    w.add_argument("--burst-seconds", type=float, default=30.0, help="bursty: mean time in each state")
    w.add_argument(
        "--prompt-tokens",
        default="lognormal:1024:0.8",
        help="N, exponential:MEAN, lognormal:MEAN:SIGMA or uniform:LOW:HIGH",
    )
    w.add_argument("--output-tokens", default="lognormal:256:0.8")
    w.add_argument(
        "--prefix-share", type=float, default=0.0, help="fraction of requests sharing a prefix (system prompt)"
    )
    w.add_argument("--prefix-tokens", type=int, default=0, help="tokens of each shared prefix (added to the prompt)")
    w.add_argument("--prefix-groups", type=int, default=8, help="distinct shared prefixes")
    w.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="CSV: timestamp,prompt_tokens,output_tokens[,prefix_group,prefix_tokens]",
    )
    w.add_argument(
        "--duration-s", type=float, default=None, help="simulated seconds (default: enough for 3,000 requests, >= 60 s)"
    )
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("SLOs and sizing")
    s.add_argument("--ttft-p99-ms", type=float, default=1000.0)
    s.add_argument("--itl-p99-ms", type=float, default=50.0)
    s.add_argument(
        "--slo",
        type=_slo_arg,
        default=None,
        metavar="ttft=500ms,itl=50ms[,attainment=0.99]",
        help="SLOs for planning and for the SLO controller (spec.autoscaling.slo); reports what it would do",
    )
    s.add_argument("--headroom", type=float, default=0.75, help="peak utilization limit per pool (0.7-0.8 rule)")
    s.add_argument("--max-replicas", type=int, default=128, help="search limit per pool")
    s.add_argument("--min-rate", type=float, default=None, help="off-peak rate for replicas.min (default: rate / 4)")
    e = p.add_argument_group("engine and router")
    e.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS)
    e.add_argument("--max-batched-tokens", type=int, default=defaults.MAX_NUM_BATCHED_TOKENS)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--router", choices=[r for r in ROUTER_POLICIES if r != "central-queue"], default="prefix-affinity")
    e.add_argument("--kv-link-gbps", type=float, default=50.0, help="prefill->decode KV link, GB/s")
    e.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default="none",
        help="speculative decoding of decode/aggregated pods (spec.scheduling.speculative.method): ngram = prompt lookup",
    )
    e.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=DEFAULT_NUM_TOKENS,
        help="proposals verified per sequence and forward (spec.scheduling.speculative.numTokens)",
    )
    e.add_argument(
        "--spec-acceptance",
        type=float,
        default=DEFAULT_ACCEPTANCE,
        help="per-position acceptance a of the proposals (i.i.d. model: (1 - a^(k+1)) / (1 - a) tokens "
        f"per forward); default {DEFAULT_ACCEPTANCE:g}, n-gram proposals on open-ended chat measured "
        "by bench/speculative.py; text that repeats its prompt accepts far more",
    )
    e.add_argument(
        "--speculative-max-num-seqs",
        type=int,
        default=DEFAULT_SPEC_MAX_NUM_SEQS,
        help="speculate only in steps with at most this many decoding sequences (spec.scheduling.speculative.maxNumSeqs)",
    )
    o = p.add_argument_group("outputs")
    o.add_argument("--emit-manifest", type=Path, default=None, help="write an InferenceService YAML for the choice")
    o.add_argument("--name", default=None, help="InferenceService name (default: from the model)")
    o.add_argument("--model-uri", default=None, help="spec.model.uri (default: the preset's hf:// id or file:// path)")
    o.add_argument("--plot", type=Path, default=None, help="write a PNG of p99 latency vs load for the choice")
    return p


def _perf(args: argparse.Namespace, *, tensor_parallel: int) -> tuple[StepCost, str]:
    name, config = load_model(name_or_path=args.model)
    if args.profile is not None:
        profile = load_profile(path=args.profile)
        if tensor_parallel != profile.tensor_parallel:
            raise ValueError(
                f"--profile {args.profile} was measured at TP={profile.tensor_parallel}, "
                f"not TP={tensor_parallel}: drop --tp or give a profile measured at it"
            )
        return ProfileModel(profile=profile), f"profile {args.profile} ({profile.device})"
    gpu = get_gpu(args.gpu)
    precision = _precision(args)
    perf = roofline_model(
        name=name,
        config=config,
        gpu=gpu,
        tensor_parallel=tensor_parallel,
        dtype=precision.dtype,
        quantization=precision.quantization,
        kv_cache_dtype=precision.kv_cache_dtype,
        memory_fraction=args.memory_fraction,
        compute_efficiency=args.compute_efficiency,
        bandwidth_efficiency=args.bandwidth_efficiency,
    )
    return perf, f"roofline on {gpu.name}"


def _requests(args: argparse.Namespace, *, rate: float | None = None) -> tuple[list[Request], str]:
    rate = rate if rate is not None else args.rate
    if args.trace is not None:
        requests = load_trace(path=args.trace, default_prefix_tokens=args.prefix_tokens)
        span = max(requests[-1].arrival_seconds, 1e-9)
        native = len(requests) / span
        if rate is not None:
            for r in requests:
                r.arrival_seconds *= native / rate
        return requests, f"trace {args.trace} ({len(requests)} requests, {rate or native:.2f} req/s)"
    if rate is None:
        raise ValueError("give --rate (requests/s) or --trace")
    spec = WorkloadSpec(
        arrivals=Arrivals(
            rate_per_second=rate, kind=args.arrival, burst_factor=args.burst_factor, burst_seconds=args.burst_seconds
        ),
        prompt_tokens=LengthDist.parse(args.prompt_tokens),
        output_tokens=LengthDist.parse(args.output_tokens),
        prefix_share=args.prefix_share,
        prefix_tokens=args.prefix_tokens,
        prefix_groups=args.prefix_groups,
    )
    base = args.rate if args.rate else rate
    duration = args.duration_s or min(max(60.0, MIN_SIMULATED_REQUESTS / base), MAX_SIMULATED_REQUESTS / base)
    requests = spec.generate(duration_seconds=duration, seed=args.seed)
    share = (
        f", {args.prefix_share:.0%} behind {args.prefix_groups} shared {args.prefix_tokens}-token prefixes"
        if args.prefix_share
        else ""
    )
    return requests, (
        f"{args.arrival} {rate:g} req/s, prompt {args.prompt_tokens}{share}, output {args.output_tokens}; "
        f"{duration:.0f} s simulated, {len(requests)} requests, seed {args.seed}"
    )


def _validate(args: argparse.Namespace) -> None:
    if args.rate is not None and not args.rate > 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")
    if args.ttft_p99_ms <= 0 or args.itl_p99_ms <= 0:
        raise ValueError("--ttft-p99-ms and --itl-p99-ms must be > 0")
    if args.tp is not None and args.tp not in known_tensor_parallel_sizes():
        raise ValueError(f"--tp must be {AUTO} or {_values(known_tensor_parallel_sizes())}, got {args.tp}")
    if args.dtype not in ACTIVATION_BYTES and args.dtype != FP8_ALIAS:
        raise ValueError(
            f"--dtype must be {_values(ACTIVATION_BYTES)} (or {FP8_ALIAS}, an alias for "
            f"--quantization fp8), got {args.dtype!r}; weight quantization is "
            f"--quantization {'|'.join(QUANTIZATIONS)}"
        )
    precision = _precision(args)
    if args.profile is not None and precision != Precision(dtype=precision.dtype):
        raise ValueError(
            f"--profile holds timings measured at one precision; {precision.label} is priced by the "
            "roofline only: drop --profile"
        )
    unsupported = _unsupported(args)
    if unsupported and not args.what_if:
        raise caps.UnsupportedError("; ".join(unsupported) + "; --what-if prices it with the roofline anyway")
    if unsupported and args.emit_manifest is not None:
        raise caps.UnsupportedError("--emit-manifest writes only what this version serves: " + "; ".join(unsupported))
    if args.kv_link_gbps <= 0:
        raise ValueError("--kv-link-gbps must be > 0")
    if args.name is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", args.name):
        raise ValueError(f"--name {args.name!r} must be a lowercase DNS label")
    _speculation(args)  # ValueError for out-of-range speculation flags


def _speculation(args: argparse.Namespace) -> Speculation:
    return Speculation(
        method=args.speculative,
        num_tokens=args.num_speculative_tokens,
        acceptance=args.spec_acceptance,
        max_num_seqs=args.speculative_max_num_seqs,
    )


def _precision(args: argparse.Namespace) -> Precision:
    """The precision the flags ask for (``--dtype fp8``: bf16 activations, fp8 weights)."""
    return Precision.of(dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)


def _unsupported(args: argparse.Namespace, *, tensor_parallel: int | None = None) -> list[str]:
    """Capability messages for the settings given (``--tp auto``: the size chosen, else 1) that
    this version does not serve."""
    tp = tensor_parallel if tensor_parallel is not None else (args.tp or 1)
    return unsupported_settings(tensor_parallel=tp, precision=_precision(args))


def _tensor_parallel_sizes(args: argparse.Namespace) -> tuple[int, ...]:
    """The sizes ``--tp auto`` plans: the profile's, or every size this version serves (what-if:
    every size the API knows)."""
    if args.profile is not None:
        return (load_profile(path=args.profile).tensor_parallel,)
    return known_tensor_parallel_sizes() if args.what_if else supported_tensor_parallel_sizes()


def _communication_note(perf: StepCost, *, detail: bool = False) -> str:
    """How much of a one-sequence decode step (1k context) the TP collectives take (empty at TP 1
    or for a measured profile, which has no breakdown); ``detail``: how it is counted."""
    if not isinstance(perf, RooflineModel) or perf.tensor_parallel == 1:
        return ""
    step = decode_step_seconds(perf, batch_size=1, num_context_tokens=1024)
    comm = perf.communication_seconds(num_tokens=1, num_seqs=1)
    tp = perf.tensor_parallel
    note = f"all-reduce {comm * 1e3:.2f} ms of it, {comm / step:.0%}"
    if detail:
        note += (
            f": {perf.all_reduces_per_step} ring all-reduces of {perf.shape.hidden_size} x "
            f"{perf.precision.activation_bytes} B per token, 2({tp}-1)/{tp} of each over "
            f"{perf.gpu.interconnect_bytes_per_second / 1e9:g} GB/s, and the logits' all-gather"
        )
    return note


def _option_line(option: TensorParallelOption) -> str:
    plan = option.best
    if plan is None or option.inputs is None:
        return f"TP={option.tensor_parallel}: {option.reason}"
    perf = option.inputs.perf
    step = decode_step_seconds(perf, batch_size=1, num_context_tokens=1024)
    comm = _communication_note(perf, detail=True)
    return (
        f"TP={option.tensor_parallel}: {plan.num_gpus} GPUs ({plan.mode}"
        f"{', prefix cache' if plan.prefix_caching else ''}), KV {perf.kv_capacity_tokens:,} tokens/pod, "
        f"decode step (1 seq, 1k ctx) {step * 1e3:.2f} ms" + (f", {comm}" if comm else "")
    )


def _fmt_ms(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf"
    return f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def _table(table: PlanTable, *, slo: Slo) -> str:
    head = (
        f"{'configuration':<32} {'prefill':>7} {'decode':>6} {'engine':>6} {'GPUs':>5} {'TTFT p50/p99 ms':>16} "
        f"{'ITL p50/p99 ms':>15} {'goodput/GPU':>11} {'util (analytic)':>18}"
    )
    lines = [head, "-" * len(head)]
    for label, plan in table.plans.items():
        if plan is None:
            lines.append(f"{label:<32} {'no configuration within --max-replicas meets the SLOs':>60}")
            continue
        r = plan.result
        util = " ".join(f"{k[:3]} {v:.0%}" for k, v in plan.utilization.items())
        good = r.goodput(ttft_slo_seconds=slo.ttft_p99_seconds, tpot_slo_seconds=slo.itl_p99_seconds)
        lines.append(
            f"{label:<32} {plan.prefill_replicas or '-':>7} {plan.decode_replicas or '-':>6} "
            f"{plan.aggregated_replicas or '-':>6} {plan.num_gpus:>5} "
            f"{_fmt_ms(r.ttft_percentile(50)) + '/' + _fmt_ms(r.ttft_percentile(99)):>16} "
            f"{_fmt_ms(r.itl_percentile(50)) + '/' + _fmt_ms(r.itl_percentile(99)):>15} {good:>11.2f} {util:>18}"
        )
    return "\n".join(lines)


def _off_peak_counts(*, plan: Plan, inputs: PlanInputs, args: argparse.Namespace) -> dict[str, int]:
    rate = args.min_rate if args.min_rate is not None else (args.rate or 1.0) / 4
    requests, _ = _requests(args, rate=rate)
    engine = replace(inputs.engine, prefix_caching=plan.prefix_caching, max_batched_tokens=plan.max_batched_tokens)
    demand = Demand.of(requests, prefix_caching=plan.prefix_caching, block_size=engine.block_size)
    cap = capacity(perf=inputs.perf, engine=engine, demand=demand, itl_seconds=inputs.slo.itl_p99_seconds)
    prefill = demand.uncached_prompt_tokens_per_second / (cap.prefill_tokens_per_second * inputs.headroom)
    decode = demand.output_tokens_per_second / max(cap.decode_tokens_per_second * inputs.headroom, 1e-9)
    return {"prefill": math.ceil(prefill), "decode": math.ceil(decode), "aggregated": math.ceil(prefill + decode)}


def _plot(*, plan: Plan, inputs: PlanInputs, args: argparse.Namespace, path: Path, title: str) -> None:
    from .plot import plot_latency_vs_load

    base = args.rate if args.rate else len(inputs.requests) / max(inputs.requests[-1].arrival_seconds, 1e-9)
    rates = [base * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)]
    fleet = FleetConfig(
        mode=plan.mode,
        prefill_replicas=plan.prefill_replicas,
        decode_replicas=plan.decode_replicas,
        aggregated_replicas=plan.aggregated_replicas,
        gpus_per_replica=plan.gpus_per_replica,
        engine=replace(inputs.engine, prefix_caching=plan.prefix_caching, max_batched_tokens=plan.max_batched_tokens),
        router_policy=inputs.router_policy,
        kv_link_bytes_per_second=inputs.kv_link_bytes_per_second,
    )
    ttft: list[float] = []
    itl: list[float] = []
    for rate in rates:
        requests, _ = _requests(args, rate=rate)
        r = simulate(
            fleet=fleet,
            perf=inputs.perf,
            requests=requests,
            options=SimOptions(warmup_seconds=inputs.warmup_seconds, seed=args.seed, sample_interval_seconds=0),
        )
        ttft.append(1e3 * min(r.ttft_percentile(99), 1e6))
        itl.append(1e3 * min(r.itl_percentile(99), 1e6))
    plot_latency_vs_load(
        path=path,
        title=title,
        rates=rates,
        ttft_p99_ms=ttft,
        itl_p99_ms=itl,
        ttft_slo_ms=args.ttft_p99_ms,
        itl_slo_ms=args.itl_p99_ms,
        planned_rate=base,
    )


def _default_uri(args: argparse.Namespace) -> str:
    if args.model_uri:
        return str(args.model_uri)
    if args.model in HF_IDS:
        return f"hf://{HF_IDS[args.model]}"
    if args.model == "tiny":
        return "hf://splitserve/tiny-llama"
    path = Path(args.model).resolve()
    return f"file://{path.parent if path.is_file() else path}"


def run(args: argparse.Namespace) -> int:
    if args.slo is not None:  # --slo sets the planning SLOs too
        args.ttft_p99_ms, args.itl_p99_ms = args.slo.ttft_p99_seconds * 1e3, args.slo.itl_p99_seconds * 1e3
    _validate(args)
    requests, workload_label = _requests(args)
    speculation = _speculation(args)
    engine = EngineSettings(
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        prefix_caching=not args.no_prefix_caching,
        speculation=speculation,
    )
    slo = Slo(ttft_p99_seconds=args.ttft_p99_ms / 1e3, itl_p99_seconds=args.itl_p99_ms / 1e3)
    perf_label = ""

    def inputs_at(tp: int) -> PlanInputs:
        nonlocal perf_label
        perf, perf_label = _perf(args, tensor_parallel=tp)
        return PlanInputs(
            perf=perf,
            requests=requests,
            slo=slo,
            headroom=args.headroom,
            engine=engine,
            gpus_per_replica=tp,
            router_policy=args.router,
            kv_link_bytes_per_second=args.kv_link_gbps * 1e9,
            max_replicas=args.max_replicas,
            seed=args.seed,
            what_if=args.what_if,
        )

    searched: PlanTable | None = None
    if args.tp is None:
        search = plan_tensor_parallel(inputs_at, _tensor_parallel_sizes(args))
        print(f"tensor parallelism (--tp {AUTO}: each size the model fits, the fewest GPUs win):")
        for option in search.options:
            print(f"  {_option_line(option)}")
        chosen_size = search.best
        if chosen_size is None or chosen_size.inputs is None:
            raise PlanError(f"no tensor-parallel size has a plan: {search.reasons()}")
        inputs, searched = chosen_size.inputs, chosen_size.table
        print()
    else:
        inputs = inputs_at(args.tp)
    perf, tp = inputs.perf, inputs.gpus_per_replica
    step_1 = decode_step_seconds(perf, batch_size=1, num_context_tokens=1024)
    prefill_1k = prefill_seconds(perf, num_tokens=1024)
    comm = _communication_note(perf)
    print(
        f"model {args.model}, TP={tp}, {_precision(args).label}, {perf_label}: KV {perf.kv_capacity_tokens:,} tokens/pod, "
        f"decode step (1 seq, 1k ctx) {step_1 * 1e3:.2f} ms{f' ({comm})' if comm else ''}, "
        f"prefill 1k tokens {prefill_1k * 1e3:.1f} ms"
    )
    if speculation.enabled:
        forward = decode_forward_seconds(perf, batch_size=1, num_context_tokens=1024, speculation=speculation)
        print(
            f"{speculation.label}: decode (1 seq, 1k ctx) {forward / speculation.tokens_per_forward * 1e3:.2f} ms/token "
            f"(verification forward {forward * 1e3:.2f} ms, the p99 gap)"
        )
    what_if = _unsupported(args, tensor_parallel=tp)
    if what_if:
        print(f"WHAT-IF (not servable by this version, no manifest): {'; '.join(what_if)}")
    print(f"workload: {workload_label}")
    print(
        f"SLOs: TTFT p99 <= {args.ttft_p99_ms:g} ms, ITL p99 <= {args.itl_p99_ms:g} ms; headroom {args.headroom:.0%}; "
        f"router {args.router}\n"
    )
    table = searched if searched is not None else plan_all(inputs)
    print(_table(table, slo=slo))
    best = table.best
    if best is None:
        print(
            f"\nsplitserve plan: error: no configuration with at most {args.max_replicas} replicas per pool meets "
            f"the SLOs; relax them, raise --max-replicas, or use {remedies(tensor_parallel=tp, what_if=args.what_if, precision=_precision(args), gpu=None if args.profile else get_gpu(args.gpu))}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    label = next(k for k, v in table.plans.items() if v is best)
    pods = (
        f"{best.aggregated_replicas} pods"
        if best.mode == AGGREGATED
        else f"{best.prefill_replicas} prefill + {best.decode_replicas} decode pods"
    )
    chosen = "what-if, not servable by this version" if what_if else "chosen"
    print(
        f"\n{chosen}: {label}: {pods} x {best.gpus_per_replica} GPU = {best.num_gpus} GPUs "
        f"(token budget {best.max_batched_tokens}); {'; '.join(best.notes)}"
    )
    slo_report = None
    if args.slo is not None:
        counts = (
            {"aggregated": best.aggregated_replicas}
            if best.mode == AGGREGATED
            else {"prefill": best.prefill_replicas, "decode": best.decode_replicas}
        )
        slo_report = simulate_controller(
            perf=perf,
            requests=requests,
            slo=args.slo,
            mode=best.mode,
            replicas=counts,
            engine=replace(engine, max_batched_tokens=best.max_batched_tokens),
            gpus_per_replica=best.gpus_per_replica,
            max_replicas=args.max_replicas,
            router_policy=args.router,
            kv_link_bytes_per_second=args.kv_link_gbps * 1e9,
            seed=args.seed,
        )
        print()
        print(format_report(slo_report))
    if args.emit_manifest is not None:
        from splitserve_operator.api import InferenceService

        from .manifest import build_manifest, manifest_yaml

        name = args.name or re.sub(r"[^a-z0-9-]+", "-", Path(args.model).name.lower()).strip("-")[:40] or "planned"
        manifest = build_manifest(
            plan=best,
            name=name,
            model_uri=_default_uri(args),
            precision=_precision(args),
            min_replicas=_off_peak_counts(plan=best, inputs=inputs, args=args),
            router_policy=args.router,
            memory_fraction=args.memory_fraction,
            max_num_seqs=args.max_num_seqs,
            block_size=engine.block_size,
            speculation=speculation,
        )
        if slo_report is not None:
            manifest["spec"]["autoscaling"]["slo"] = slo_manifest(slo_report)
            InferenceService.parse(manifest)  # the API must accept the SLO block as written
        header = (
            f"Planned by `splitserve plan` for {workload_label}\nSLOs TTFT p99 {args.ttft_p99_ms:g} ms, "
            f"ITL p99 {args.itl_p99_ms:g} ms; {label}; {perf_label}"
        )
        args.emit_manifest.write_text(manifest_yaml(manifest, header=header), encoding="utf-8")
        print(f"wrote {args.emit_manifest}")
    if args.plot is not None:
        _plot(
            plan=best,
            inputs=inputs,
            args=args,
            path=args.plot,
            title=f"{'what-if: ' if what_if else ''}{args.model} {label}: {pods}",
        )
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (PlanError, ModelDoesNotFit, TensorParallelRefused, ProfileError, ValueError, OSError) as exc:
        print(f"splitserve plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
