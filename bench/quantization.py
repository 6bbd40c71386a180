"""Weight quantization on a real model: memory, accuracy and CPU speed of every method, side by side.

Model: SmolLM2-135M-Instruct (:mod:`splitserve_e2e.smollm2`). The only real weights available
offline are its Q4_1 GGUF file, so the fp32 baseline is that file dequantized by transformers
into an HF directory (``hf_dir()``), and every other method re-quantizes weights that already
sit on a 4-bit grid: the rows compare methods on the same footing, but absolute quality is
that of SmolLM2 Q4_1, not of the bf16 release.

Rows: each is one function that builds the runtime's engine for it (a model URI plus serve
flags, exactly what an InferenceService would run):

- ``fp32``: the dense HF directory; ``fp32-kv-fp8``: the same with ``--kv-cache-dtype fp8``;
- ``load-fp8`` / ``load-int8`` / ``load-int4``: ``--quantization`` on the dense directory
  (W8A8 fp8, W8A8 int8, W4A16);
- ``ct-fp8`` / ``ct-int8`` / ``ct-w8a16``: compressed-tensors checkpoints (FP8_DYNAMIC, W8A8,
  per-channel W8A16) and ``autofp8`` (``quant_method: fp8``, per-tensor scales), written by
  :mod:`splitserve_e2e.quant_checkpoints`;
- ``awq-g64`` / ``awq-g32``, ``gptq-sym-g64`` / ``gptq-asym-g64``: AutoAWQ gemm and GPTQ v1
  checkpoints, round-to-nearest (not the AWQ/GPTQ calibration: an accuracy lower bound).
  Group size 128 cannot be used on this model: K = hidden size = 576 = 4.5 x 128;
- ``gguf``: the Q4_1 GGUF file served directly. Its ``max|dlogit|`` against ``fp32`` (its own
  dequantized HF directory) checks the GGUF loader: it should be float rounding only.

The ``hf-fp32`` row is the oracle: transformers in fp32 on the dense directory.

Columns: ``weight MiB``: every weight as the runtime holds it (``LlamaForCausalLM.weight_nbytes``,
dense parts in ``--dtype``); ``KV blocks``: ``(--budget-mib - weights) / bytes per block`` of
``--block-size`` tokens, for a 16-bit and an fp8 KV cache; ``PPL``: perplexity of the first
``--ppl-tokens`` tokens of /usr/share/common-licenses/Apache-2.0 in independent windows of
``--window`` tokens (all positions' logits from the runtime model's forward); ``top-1``:
teacher-forced agreement with fp32's greedy continuations of ``--prompts`` prompts x
``--new-tokens`` tokens; ``same``: free-running greedy continuations identical to fp32's;
``max|dlogit|``: against fp32 over the first window; ``tok/s``: the engine generating
``--prompts`` x ``--new-tokens`` greedy tokens in one batch on the CPU, best of ``--repeats``
after a warm-up, ``--threads`` torch threads.

A row the runtime cannot load or run fails with its error in the table (full traceback on
stderr) and the script exits 1: never a number made up. Writes ``--json`` and
``$OUT/quantization.json`` (when ``OUT`` is set).

    python bench/quantization.py                       # SmolLM2-135M, every row
    python bench/quantization.py --rows fp32,awq-g64   # some rows
    python bench/quantization.py --smoke               # tiny random model: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from splitserve_contract import ServeArgs
from splitserve_e2e.quant_checkpoints import MAKERS
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.model_runner import allocate_kv_caches
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.step_inputs import PrefillRow, build_step_inputs
from splitserve_runtime.model.llama import LlamaForCausalLM

TEXT = Path("/usr/share/common-licenses/Apache-2.0")
CACHE = Path.home() / ".cache" / "splitserve" / "quant-bench"
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "A good way to learn a new language is",
    "The main ingredients of bread are",
    "In the morning, the birds",
    "The theory of relativity was developed by",
    "My favourite season of the year is",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The most important rule of programming is",
    "Dogs are popular pets because",
    "The ocean covers most of the Earth and",
)


@dataclasses.dataclass(frozen=True)
class Context:
    """What every row's loading function needs."""

    dense_dir: Path
    gguf: Path | None
    cache: Path
    dtype: str
    block_size: int
    rebuild: bool


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    what: str
    load: Callable[[Context], LLMEngine]


@dataclasses.dataclass
class Result:
    name: str
    what: str
    error: str | None = None
    weight_bytes: int | None = None
    kv_blocks_16bit: int | None = None
    kv_blocks_fp8: int | None = None
    ppl: float | None = None
    top1_agreement: float | None = None
    same_greedy: int | None = None
    max_logit_diff: float | None = None
    tokens_per_s: float | None = None


# ---------------------------------------------------------------- rows: how each is loaded


def _serve(ctx: Context, model: Path, *, quantization: str = "none", kv_cache_dtype: str = "auto") -> LLMEngine:
    args = ServeArgs(
        model=str(model),
        device="cpu",
        dtype=ctx.dtype,
        block_size=ctx.block_size,
        num_kv_blocks=256,
        max_model_len=2048,
        max_num_seqs=len(PROMPTS),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    return LLMEngine.from_args(args)


def _checkpoint(ctx: Context, kind: str) -> Path:
    """The ``kind`` checkpoint of the dense model, made once and cached."""
    path = ctx.cache / f"{ctx.dense_dir.name}-{kind}"
    if ctx.rebuild and path.exists():
        shutil.rmtree(path)
    if not path.exists():
        MAKERS[kind](ctx.dense_dir, path)
    return path


def _gguf(ctx: Context) -> Path:
    if ctx.gguf is None:
        raise RuntimeError("no GGUF file for this model")
    return ctx.gguf


def _prequantized(kind: str, what: str) -> Method:
    return Method(kind, what, lambda ctx: _serve(ctx, _checkpoint(ctx, kind)))


METHODS: tuple[Method, ...] = (
    Method("fp32", "dense HF dir (the GGUF dequantized)", lambda ctx: _serve(ctx, ctx.dense_dir)),
    Method("fp32-kv-fp8", "dense, --kv-cache-dtype fp8", lambda ctx: _serve(ctx, ctx.dense_dir, kv_cache_dtype="fp8")),
    Method("load-fp8", "--quantization fp8 (W8A8)", lambda ctx: _serve(ctx, ctx.dense_dir, quantization="fp8")),
    Method("load-int8", "--quantization int8 (W8A8)", lambda ctx: _serve(ctx, ctx.dense_dir, quantization="int8")),
    Method("load-int4", "--quantization int4 (W4A16)", lambda ctx: _serve(ctx, ctx.dense_dir, quantization="int4")),
    _prequantized("ct-fp8", "compressed-tensors FP8_DYNAMIC"),
    _prequantized("ct-int8", "compressed-tensors W8A8 int8"),
    _prequantized("ct-w8a16", "compressed-tensors W8A16 int8"),
    _prequantized("autofp8", "AutoFP8 fp8, per-tensor"),
    _prequantized("awq-g64", "AWQ gemm g64 (RTN)"),
    _prequantized("awq-g32", "AWQ gemm g32 (RTN)"),
    _prequantized("gptq-sym-g64", "GPTQ v1 sym g64 (RTN)"),
    _prequantized("gptq-asym-g64", "GPTQ v1 asym g64 (RTN)"),
    Method("gguf", "GGUF Q4_1 file, served directly", lambda ctx: _serve(ctx, _gguf(ctx))),
)
ORACLE = "hf-fp32"


# ---------------------------------------------------------------- measurements


def _logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits of every position of one sequence, through the runtime model's forward
    (its own KV cache, in the engine's cache layout and dtype)."""
    runner = engine.runner
    num_blocks = math.ceil(len(token_ids) / runner.block_size)
    caches = allocate_kv_caches(
        spec=runner.spec, num_blocks=num_blocks, block_size=runner.block_size, device=engine.device
    )
    inputs = build_step_inputs(
        prefills=[PrefillRow(token_ids=token_ids, start_position=0, block_table=list(range(num_blocks)))],
        decodes=[],
        sample_prefill=[False],
        block_size=runner.block_size,
        device=engine.device,
    )
    hidden = runner.model.forward(
        input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=caches, md=inputs.md
    )
    return runner.model.compute_logits(hidden).float()


def _perplexity(
    windows: list[list[int]],
    logits_of: Callable[[list[int]], torch.Tensor],
) -> tuple[float, torch.Tensor]:
    """Perplexity over the windows, and the first window's logits."""
    nll, count = 0.0, 0
    first = torch.empty(0)
    for i, window in enumerate(windows):
        logits = logits_of(window)
        if i == 0:
            first = logits
        targets = torch.tensor(window[1:])
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum"))
        count += len(window) - 1
    return math.exp(nll / count), first


def _top1(prompts: list[list[int]], reference: Reference, logits_of: Callable[[list[int]], torch.Tensor]) -> float:
    """Teacher-forced: fraction of positions where the argmax is the reference's token (EOS
    excluded, as the generation that made the reference banned it)."""
    hits = total = 0
    for prompt, continuation in zip(prompts, reference.continuations, strict=True):
        logits = logits_of(prompt + continuation[:-1])[len(prompt) - 1 :]
        banned = torch.tensor(sorted(reference.banned_token_ids), dtype=torch.int64)
        predicted = logits.index_fill(1, banned, -math.inf).argmax(dim=-1)
        hits += int((predicted == torch.tensor(continuation)).sum())
        total += len(continuation)
    return hits / total


def _generate(
    engine: LLMEngine, prompts: list[list[int]], *, new_tokens: int, repeats: int
) -> tuple[float, list[list[int]]]:
    """Greedy continuations (min_tokens = max_tokens: no early EOS) and the best tokens/s."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    best = math.inf
    outputs: list[list[int]] = []
    for rep in range(repeats + 1):  # the first round is warm-up
        engine.block_manager.reset_prefix_cache()
        tokens: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(request_id=f"r{rep}-{i}", prompt_token_ids=prompt, params=params)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        elapsed = time.perf_counter() - t0
        if rep > 0 or repeats == 0:
            best = min(best, elapsed)
        outputs = [tokens[f"r{rep}-{i}"] for i in range(len(prompts))]
    return len(prompts) * new_tokens / best, outputs


@dataclasses.dataclass
class Reference:
    """fp32's outputs every other row is compared with."""

    first_logits: torch.Tensor
    continuations: list[list[int]]
    banned_token_ids: frozenset[int]
    """EOS: generating exactly ``--new-tokens`` tokens bans it (``min_tokens``)."""


def _kv_blocks(budget_bytes: int, weight_bytes: int, spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    per_block = dataclasses.replace(spec, dtype=dtype).bytes_per_block(block_size=block_size)
    return max(0, (budget_bytes - weight_bytes) // per_block)


def measure_row(
    method: Method,
    ctx: Context,
    *,
    windows: list[list[int]],
    prompts: list[list[int]],
    reference: Reference | None,
    opts: argparse.Namespace,
) -> tuple[Result, Reference]:
    """One row's numbers, compared with ``reference`` (fp32's outputs; None: this row is fp32,
    compared with itself, which checks that the engine's decode agrees with the full forward).
    Returns the result and this row's own outputs."""
    result = Result(method.name, method.what)
    engine = method.load(ctx)
    model = cast(LlamaForCausalLM, engine.runner.model)
    result.weight_bytes = model.weight_nbytes()
    budget = opts.budget_mib * 2**20
    spec = engine.runner.spec
    result.kv_blocks_16bit = _kv_blocks(budget, result.weight_bytes, spec, ctx.block_size, torch.bfloat16)
    result.kv_blocks_fp8 = _kv_blocks(budget, result.weight_bytes, spec, ctx.block_size, torch.float8_e4m3fn)

    def logits_of(ids: list[int]) -> torch.Tensor:
        return _logits(engine, ids)

    result.ppl, first = _perplexity(windows, logits_of)
    result.tokens_per_s, continuations = _generate(engine, prompts, new_tokens=opts.new_tokens, repeats=opts.repeats)
    own = Reference(first, continuations, engine.eos_token_ids)
    against = reference or own
    result.max_logit_diff = float((first - against.first_logits).abs().max())
    result.top1_agreement = _top1(prompts, against, logits_of)
    result.same_greedy = sum(a == b for a, b in zip(continuations, against.continuations, strict=True))
    return result, own


def measure_oracle(
    dense_dir: Path,
    *,
    windows: list[list[int]],
    prompts: list[list[int]],
    reference: Reference | None,
    opts: argparse.Namespace,
) -> Result:
    """transformers in fp32: the numbers our fp32 row should reproduce."""
    from transformers import AutoModelForCausalLM

    result = Result(ORACLE, "transformers fp32 (oracle)")
    hf = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32)  # in eval mode
    result.weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())

    def logits_of(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return cast(torch.Tensor, hf(torch.tensor([ids])).logits[0].float())

    result.ppl, first = _perplexity(windows, logits_of)
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    best = math.inf
    generated = torch.empty(0)
    for rep in range(opts.repeats + 1):
        t0 = time.perf_counter()
        with torch.inference_mode():
            generated = hf.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=opts.new_tokens,
                min_new_tokens=opts.new_tokens,
                pad_token_id=0,
            )[:, width:]
        if rep > 0 or opts.repeats == 0:
            best = min(best, time.perf_counter() - t0)
    result.tokens_per_s = len(prompts) * opts.new_tokens / best
    if reference is not None:
        result.max_logit_diff = float((first - reference.first_logits).abs().max())
        result.top1_agreement = _top1(prompts, reference, logits_of)
        result.same_greedy = sum(generated[i].tolist() == c for i, c in enumerate(reference.continuations))
    return result


# ---------------------------------------------------------------- driver


def _fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[Result], *, opts: argparse.Namespace, num_prompts: int) -> None:
    base = next((r.ppl for r in results if r.name == "fp32" and r.ppl is not None), None)
    print(
        f"{'method':<15}{'what':<37}{'weight MiB':>11}{'KV blk 16b':>11}{'KV blk fp8':>11}"
        f"{'PPL':>9}{'dPPL %':>8}{'top-1 %':>8}{'same':>6}{'max|dlogit|':>12}{'tok/s':>8}"
    )
    for r in results:
        if r.error is not None:
            print(f"{r.name:<15}{r.what:<37}FAILED: {r.error}")
            continue
        dppl = None if base is None or r.ppl is None else 100 * (r.ppl / base - 1)
        same = "-" if r.same_greedy is None else f"{r.same_greedy}/{num_prompts}"
        mib = None if r.weight_bytes is None else r.weight_bytes / 2**20
        top1 = None if r.top1_agreement is None else 100 * r.top1_agreement
        print(
            f"{r.name:<15}{r.what:<37}{_fmt(mib, '.1f'):>11}{_fmt(r.kv_blocks_16bit, 'd'):>11}"
            f"{_fmt(r.kv_blocks_fp8, 'd'):>11}{_fmt(r.ppl, '.3f'):>9}{_fmt(dppl, '+.2f'):>8}"
            f"{_fmt(top1, '.1f'):>8}{same:>6}{_fmt(r.max_logit_diff, '.2e'):>12}"
            f"{_fmt(r.tokens_per_s, '.0f'):>8}"
        )
    gguf = next((r for r in results if r.name == "gguf" and r.max_logit_diff is not None), None)
    if gguf is not None:
        print(
            f"GGUF direct vs its dequantized HF dir (fp32): max |logit diff| = "
            f"{gguf.max_logit_diff:.3e} over the first {opts.window}-token window"
        )


def _windows(token_ids: list[int], *, total: int, window: int) -> list[list[int]]:
    ids = token_ids[:total]
    if len(ids) < total:
        raise RuntimeError(f"{TEXT} has only {len(ids)} tokens, --ppl-tokens asks {total}")
    return [ids[i : i + window] for i in range(0, total, window) if len(ids[i : i + window]) > 1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [m.name for m in METHODS] + [ORACLE]
    parser.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated rows (fp32 always runs first; default: all but gguf with --smoke): {', '.join(names)}",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny random model, few tokens: checks the script, not the methods"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--budget-mib", type=int, default=1024, help="memory for weights + KV cache in the KV-blocks columns"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where quantized checkpoints are kept")
    parser.add_argument("--rebuild", action="store_true", help="remake cached quantized checkpoints")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    if opts.rows is None:
        opts.rows = ",".join(n for n in names if not (opts.smoke and n == "gguf"))
    unknown = set(opts.rows.split(",")) - set(names)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    if opts.smoke:
        opts.ppl_tokens, opts.window, opts.new_tokens, opts.repeats = 256, 128, 8, 0
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = _parse(argv)
    torch.set_num_threads(opts.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if opts.smoke:
            from splitserve_runtime.model.tiny import write_tiny_model

            dense_dir = write_tiny_model(out_dir=Path(tmp) / "tiny-llama", arch="llama", seed=0)
            gguf: Path | None = None
            cache = Path(tmp) / "quantized"
        else:
            from splitserve_e2e.smollm2 import gguf_path, hf_dir

            dense_dir, gguf, cache = hf_dir(), gguf_path(), opts.cache
        ctx = Context(
            dense_dir=dense_dir,
            gguf=gguf,
            cache=cache,
            dtype=opts.dtype,
            block_size=opts.block_size,
            rebuild=opts.rebuild,
        )
        results = run(ctx, opts)
    print(
        f"model {dense_dir.name}, dtype {opts.dtype}, {opts.threads} thread(s); PPL over "
        f"{opts.ppl_tokens} tokens of {TEXT.name} in {opts.window}-token windows; "
        f"{len(PROMPTS)} prompts x {opts.new_tokens} greedy tokens; KV blocks of "
        f"{opts.block_size} tokens in {opts.budget_mib} MiB minus the weights"
    )
    print_table(results, opts=opts, num_prompts=len(PROMPTS))
    failures = [{"row": r.name, "error": r.error} for r in results if r.error is not None]
    report = {
        "model": dense_dir.name,
        "smoke": opts.smoke,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
        "rows": [dataclasses.asdict(r) for r in results],
        "failures": failures,
    }
    for path in [opts.json] + ([Path(os.environ["OUT"], "quantization.json")] if os.environ.get("OUT") else []):
        if path is not None:
            path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if failures else 0


def run(ctx: Context, opts: argparse.Namespace) -> list[Result]:
    from splitserve_runtime.model.tokenizer import Tokenizer

    wanted = opts.rows.split(",")
    tokenizer = Tokenizer.from_dir(model_dir=ctx.dense_dir)
    text_ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    windows = _windows(text_ids, total=opts.ppl_tokens, window=opts.window)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    results: list[Result] = []
    reference: Reference | None = None
    for method in [m for m in METHODS if m.name == "fp32" or m.name in wanted]:
        try:
            if method.name != "fp32" and reference is None:
                raise RuntimeError("no fp32 reference to compare with (the fp32 row failed)")
            result, own = measure_row(method, ctx, windows=windows, prompts=prompts, reference=reference, opts=opts)
            gc.collect()  # the row's engine and model are garbage now
            if method.name == "fp32":
                reference = own
        except Exception as exc:  # a row that cannot run reports why; the others still run
            traceback.print_exc()
            result = Result(method.name, method.what, error=_error(exc))
        results.append(result)
        print(f"  {method.name}: {'FAILED' if result.error else 'done'}", file=sys.stderr, flush=True)
    if ORACLE in wanted:
        try:
            results.insert(
                0, measure_oracle(ctx.dense_dir, windows=windows, prompts=prompts, reference=reference, opts=opts)
            )
        except Exception as exc:
            traceback.print_exc()
            results.insert(0, Result(ORACLE, "transformers fp32 (oracle)", error=_error(exc)))
    return results


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


if __name__ == "__main__":
    raise SystemExit(main())
