"""The engine on one GPU: KV pool sizing, decode speed vs the memory roofline, and how long
the device sits idle between steps waiting for Python (docs/architecture.md, "Performance method").

The model has the Llama-3.1-8B shape (32 layers, hidden 4096, MLP 14336, 32 query / 8 KV
heads, vocab 128256) with random bf16 weights built in memory (nothing to download). For
each batch size, every request gets a random 512-token prompt and decodes ``--new-tokens``
greedy tokens; decode steps are timed three ways:

- wall time per step (``LLMEngine.step()``, host view);
- device time per step (CUDA events around the runner's launch);
- device idle gap between consecutive steps = host bookkeeping the GPU waited for.

The roofline step time is (weight bytes + K/V bytes read) / 4.3 TB/s (measured H200 copy
bandwidth). Output overlap (text work of step n during step n+1) is compared on vs off at
the largest batch. Writes ``$OUT/gpu_engine.json`` and prints a table.

``--speculative ngram [--num-speculative-tokens K]`` adds a second engine on the same weights
with n-gram speculation in every step (its ``--speculative-max-num-seqs`` raised to the
largest batch) and runs each batch on both, the same requests: decode tokens/s, mean time per
output token, device ms per forward, tokens per forward per sequence, and the **break-even
tokens per forward** (speculative forward / plain step: the acceptance must give more tokens
per forward than this for speculation to pay at that batch). With random weights the
acceptance itself says little (greedy output of a random model loops, which prompt lookup
predicts well); the cost of a forward of ``1 + K`` rows per sequence against a plain step is
the model-independent part, and what ``splitserve plan --speculative`` prices with the roofline.

``--tp N`` serves the model with tensor parallelism over N GPUs (``tensor_parallel_size=N``,
ranks 1..N-1 are worker processes, which load their shards from disk): the random weights are
written once as a safetensors checkpoint (HF names, sharded, in the temporary directory: about
15 GiB for the 8B shape; with the tiny model's 512-token tokenizer, so random ids beyond it
decode to empty text, which this bench never reads) and every engine is built from it with
``LLMEngine.from_args``. All figures are rank 0's: the device timeline of GPU 0, and a roofline
of rank 0's shard of the weights and of its KV heads (collectives are not in the roofline).
``tp`` is recorded in the JSON.

    python bench/gpu_engine.py                 # on the GPU
    python bench/gpu_engine.py --tp 2          # two GPUs, tensor parallel
    python bench/gpu_engine.py --smoke         # CPU, tiny shape: checks the script itself
    python bench/gpu_engine.py --smoke --tp 2  # CPU, tiny shape, two gloo ranks
    python bench/gpu_engine.py --speculative ngram --num-speculative-tokens 4 --batches 1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from splitserve_contract import ServeArgs
from splitserve_contract.model_config import ModelConfig
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.model_runner import LaunchedStep
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.scheduler import SchedulerOutput
from splitserve_runtime.engine.speculative import SpeculativeConfig
from splitserve_runtime.model.llama import LlamaForCausalLM
from splitserve_runtime.ops import get_ops

HBM_BYTES_PER_S = 4.3e12
PROMPT_TOKENS = 512
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
TINY = {
    **LLAMA_8B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def build_model(
    *, raw_config: dict[str, Any], device: torch.device, dtype: torch.dtype, backend: str
) -> LlamaForCausalLM:
    config = ModelConfig.from_dict(raw_config)
    ops = get_ops(name=backend, device=device)
    model = LlamaForCausalLM(config=config, ops=ops, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # norms
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model


class EngineFactory(Protocol):
    """Builds an engine on the bench's weights; returns it and the seconds it took."""

    def __call__(
        self, *, max_num_seqs: int, num_kv_blocks: int, speculative: SpeculativeConfig | None = None
    ) -> tuple[LLMEngine, float]: ...


def write_checkpoint(*, raw_config: dict[str, Any], out_dir: Path, dtype: torch.dtype, device: torch.device) -> Path:
    """A random checkpoint of ``raw_config``'s shape that ``LLMEngine.from_args`` loads (what
    tensor-parallel worker ranks need: they load from disk): HF tensor names, one safetensors
    shard per few layers (host memory stays at one shard), weights drawn on ``device`` as
    :func:`build_model` draws them, and the tiny model's tokenizer."""
    from splitserve_runtime.model.tiny import write_tiny_model

    write_tiny_model(out_dir=out_dir)  # tokenizer and generation config; its weights are replaced
    config = json.loads((out_dir / "config.json").read_text())
    config.update(raw_config)
    config["head_dim"] = raw_config["hidden_size"] // raw_config["num_attention_heads"]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["tie_word_embeddings"] = False
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "model.safetensors").unlink()
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[("model.embed_tokens.weight", (vocab, hidden))]]
    for i in range(layers):
        if i % 4 == 0:
            groups.append([])
        p = f"model.layers.{i}."
        groups[-1] += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    groups.append([("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))])
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0
    for index, group in enumerate(groups):
        name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for tensor_name, shape in group:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if len(shape) == 1:
                tensor.fill_(1.0)  # norms
            else:
                tensor.normal_(0.0, 0.02, generator=gen)
            tensors[tensor_name] = tensor.cpu()
            weight_map[tensor_name] = name
            total += tensor.numel() * tensor.element_size()
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return out_dir


def build_tp_engine(
    *,
    checkpoint: Path,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    max_num_seqs: int,
    num_kv_blocks: int,
    speculative: SpeculativeConfig | None = None,
) -> tuple[LLMEngine, float]:
    """An engine of ``tp`` ranks on ``checkpoint`` (build_engine's settings); the seconds include
    starting the workers and loading every rank's shard."""
    spec = speculative or SpeculativeConfig()
    args = ServeArgs(
        model=str(checkpoint),
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        attention_backend=backend,
        max_model_len=4096,
        block_size=16,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        tensor_parallel_size=tp,
        speculative_method=spec.method,
        num_speculative_tokens=spec.num_tokens,
        speculative_max_num_seqs=spec.max_num_seqs,
        served_model_name="llama-8b-shape",
    )
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(args)
    model = engine.runner.model
    assert isinstance(model, torch.nn.Module)
    engine.bench_weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    return engine, time.perf_counter() - t0


def build_engine(
    *,
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    num_kv_blocks: int,
    speculative: SpeculativeConfig | None = None,
) -> tuple[LLMEngine, float]:
    config = model.config
    spec = KVCacheSpec(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(
        model=model,
        kv_spec=spec,
        vocab_size=config.vocab_size,
        device=device,
        config=EngineConfig(
            max_model_len=4096,
            block_size=16,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=8192,
        ),
        model_name="llama-8b-shape",
        speculative=speculative,
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine.bench_weight_bytes = weight_bytes  # type: ignore[attr-defined]
    return engine, time.perf_counter() - t0


class StepTimer:
    """Wraps the runner's launch with CUDA events (device view) of every step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.cuda = engine.device.type == "cuda"
        self.events: list[tuple[Any, Any]] = []
        runner = engine.runner
        original = runner.launch

        def launch(sched: SchedulerOutput) -> LaunchedStep:
            if not self.cuda:
                return original(sched)
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            out = original(sched)
            end.record()
            self.events.append((start, end))
            return out

        runner.launch = launch  # type: ignore[method-assign]

    def device_ms(self) -> tuple[list[float], list[float]]:
        """Per-step busy ms and the idle ms between consecutive steps."""
        if not self.events:
            return [], []
        torch.cuda.synchronize()
        busy = [s.elapsed_time(e) for s, e in self.events]
        idle = [self.events[i][1].elapsed_time(self.events[i + 1][0]) for i in range(len(self.events) - 1)]
        return busy, idle


def run_batch(*, engine: LLMEngine, timer: StepTimer, batch: int, new_tokens: int, tag: str) -> dict[str, float]:
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
        engine.add_request(request_id=f"{tag}-{i}", prompt_token_ids=prompt, params=params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # prefill
    timer.events.clear()
    walls: list[float] = []
    num_tokens = 0
    stats0 = engine.stats()
    t_start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        walls.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    stats1 = engine.stats()
    busy, idle = timer.device_ms()
    context = PROMPT_TOKENS + new_tokens / 2
    kv_bytes = batch * context * engine.runner.spec.bytes_per_block(block_size=1)
    roofline_ms = (engine.bench_weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3  # type: ignore[attr-defined]
    wall_ms = statistics.median(walls) * 1e3
    result = {
        "batch": batch,
        "tokens_per_s": num_tokens / elapsed,
        "wall_ms_per_step": wall_ms,
        "roofline_ms_per_step": roofline_ms,
        "wall_vs_roofline": wall_ms / roofline_ms,
        "ms_per_output_token": elapsed / max(num_tokens / batch, 1e-9) * 1e3,
        "tokens_per_forward": num_tokens / max(len(walls) * batch, 1),
    }
    proposed = stats1.spec_decode_proposed_tokens_total - stats0.spec_decode_proposed_tokens_total
    if proposed:
        accepted = stats1.spec_decode_accepted_tokens_total - stats0.spec_decode_accepted_tokens_total
        result["acceptance_rate"] = accepted / proposed
    if busy:
        result["device_ms_per_step"] = statistics.median(busy)
        result["idle_ms_between_steps"] = statistics.median(idle) if idle else 0.0
        result["idle_fraction"] = sum(idle) / (sum(idle) + sum(busy))
    return result


def compare_speculative(
    *,
    plain: tuple[LLMEngine, StepTimer],
    make_engine: EngineFactory,
    batches: list[int],
    new_tokens: int,
    speculative: SpeculativeConfig,
    num_kv_blocks: int,
) -> dict[str, Any]:
    """Each batch on the plain engine and on a speculative one with the same weights, back to back."""
    engine, _ = make_engine(max_num_seqs=max(batches), num_kv_blocks=num_kv_blocks, speculative=speculative)
    timer = StepTimer(engine)
    run_batch(engine=engine, timer=timer, batch=min(batches), new_tokens=8, tag="spec-warmup")
    rows: list[dict[str, Any]] = []
    for batch in batches:
        off = run_batch(engine=plain[0], timer=plain[1], batch=batch, new_tokens=new_tokens, tag=f"off{batch}")
        on = run_batch(engine=engine, timer=timer, batch=batch, new_tokens=new_tokens, tag=f"spec{batch}")
        step_off = off.get("device_ms_per_step", off["wall_ms_per_step"])
        step_on = on.get("device_ms_per_step", on["wall_ms_per_step"])
        rows.append(
            {
                "batch": batch,
                "off": off,
                "spec": on,
                "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                "forward_cost_ratio": step_on / step_off,
            }
        )
    print(
        f"\nspeculative {speculative.method} k={speculative.num_tokens} (every step speculates) vs off, "
        f"same requests; break-even = tokens/forward needed to pay = spec forward / plain step"
    )
    print(
        f"{'batch':>6}{'off tok/s':>11}{'spec tok/s':>12}{'ratio':>7}{'off ms/tok':>12}{'spec ms/tok':>13}"
        f"{'off ms/fwd':>12}{'spec ms/fwd':>13}{'tok/fwd':>9}{'accept':>8}{'break-even':>12}"
    )
    for row in rows:
        off, on = row["off"], row["spec"]
        print(
            f"{row['batch']:>6}{off['tokens_per_s']:>11.0f}{on['tokens_per_s']:>12.0f}{row['speedup']:>7.2f}"
            f"{off['ms_per_output_token']:>12.2f}{on['ms_per_output_token']:>13.2f}"
            f"{off.get('device_ms_per_step', off['wall_ms_per_step']):>12.2f}"
            f"{on.get('device_ms_per_step', on['wall_ms_per_step']):>13.2f}"
            f"{on['tokens_per_forward']:>9.2f}{on.get('acceptance_rate', 0.0):>8.2f}"
            f"{row['forward_cost_ratio']:>12.2f}"
        )
    engine.close()
    return {"method": speculative.method, "num_tokens": speculative.num_tokens, "rows": rows}


def engine_factory(
    *,
    args: argparse.Namespace,
    raw_config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    checkpoint_dir: Path,
    report: dict[str, Any],
) -> EngineFactory:
    """TP 1: engines on one in-memory model; TP > 1: engines on a checkpoint written once."""
    if args.tp == 1:
        model = build_model(raw_config=raw_config, device=device, dtype=dtype, backend=args.backend)

        def in_memory(
            *, max_num_seqs: int, num_kv_blocks: int, speculative: SpeculativeConfig | None = None
        ) -> tuple[LLMEngine, float]:
            return build_engine(
                model=model,
                dtype=dtype,
                device=device,
                max_num_seqs=max_num_seqs,
                num_kv_blocks=num_kv_blocks,
                speculative=speculative,
            )

        return in_memory
    t0 = time.perf_counter()
    checkpoint = write_checkpoint(raw_config=raw_config, out_dir=checkpoint_dir, dtype=dtype, device=device)
    report["checkpoint_write_seconds"] = time.perf_counter() - t0
    print(f"random checkpoint for --tp {args.tp} written in {report['checkpoint_write_seconds']:.1f} s")
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def tensor_parallel(
        *, max_num_seqs: int, num_kv_blocks: int, speculative: SpeculativeConfig | None = None
    ) -> tuple[LLMEngine, float]:
        return build_tp_engine(
            checkpoint=checkpoint,
            tp=args.tp,
            dtype=dtype,
            device=device,
            backend=args.backend,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            speculative=speculative,
        )

    return tensor_parallel


def run(*, args: argparse.Namespace, make_engine: EngineFactory, batches: list[int], report: dict[str, Any]) -> None:
    speculative = None
    num_kv_blocks = 256 if args.smoke else 0
    if args.speculative != "none":  # two engines on one set of weights: fixed, equal KV pools
        speculative = SpeculativeConfig(
            method=args.speculative, num_tokens=args.num_speculative_tokens, max_num_seqs=max(batches)
        )
        per_seq = PROMPT_TOKENS + max(args.new_tokens, 4) + args.num_speculative_tokens + 32
        num_kv_blocks = max(batches) * (per_seq // 16 + 1) + 64
    engine, kv_setup_s = make_engine(max_num_seqs=max(batches), num_kv_blocks=num_kv_blocks)
    bm = engine.block_manager
    report["kv"] = {
        "num_blocks": bm.num_blocks,
        "block_size": bm.block_size,
        "gib": bm.num_blocks * engine.runner.spec.bytes_per_block(block_size=bm.block_size) / 2**30,
        "setup_seconds": kv_setup_s,
        "weight_gib": engine.bench_weight_bytes / 2**30,  # type: ignore[attr-defined]
        "per_rank": args.tp > 1,
    }
    rank = f" per rank (rank 0 of {args.tp})" if args.tp > 1 else ""
    setup = "workers started, shards loaded and KV measured" if args.tp > 1 else "measured"
    print(
        f"KV pool: {bm.num_blocks} blocks = {report['kv']['gib']:.1f} GiB "
        f"(weights {report['kv']['weight_gib']:.1f} GiB){rank}, {setup} in {kv_setup_s:.1f} s"
    )
    timer = StepTimer(engine)
    run_batch(engine=engine, timer=timer, batch=min(batches), new_tokens=4, tag="warmup")
    rows = [run_batch(engine=engine, timer=timer, batch=b, new_tokens=args.new_tokens, tag=f"b{b}") for b in batches]
    engine.overlap_output_processing = not engine.overlap_output_processing
    flipped = run_batch(engine=engine, timer=timer, batch=max(batches), new_tokens=args.new_tokens, tag="flip")
    flipped["overlap_output_processing"] = engine.overlap_output_processing
    engine.overlap_output_processing = not engine.overlap_output_processing  # back to the default
    report["decode"] = rows
    report["overlap_flipped"] = flipped
    print(
        f"{'batch':>6}{'tok/s':>10}{'wall ms':>9}{'device ms':>11}{'idle ms':>9}"
        f"{'idle %':>8}{'roofline ms':>13}{'wall/roof':>10}"
    )
    for row in [*rows, flipped]:
        print(
            f"{row['batch']:>6.0f}{row['tokens_per_s']:>10.0f}{row['wall_ms_per_step']:>9.2f}"
            f"{row.get('device_ms_per_step', float('nan')):>11.2f}"
            f"{row.get('idle_ms_between_steps', float('nan')):>9.2f}"
            f"{100 * row.get('idle_fraction', float('nan')):>8.1f}"
            f"{row['roofline_ms_per_step']:>13.2f}{row['wall_vs_roofline']:>10.2f}"
        )
    print(f"(last row: output overlap {'on' if flipped['overlap_output_processing'] else 'off'})")
    if speculative is not None:
        report["speculative"] = compare_speculative(
            plain=(engine, timer),
            make_engine=make_engine,
            batches=batches,
            new_tokens=args.new_tokens,
            speculative=speculative,
            num_kv_blocks=num_kv_blocks,
        )
    engine.close()
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gpu_engine.json").write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--backend", default="auto", help="auto | triton | torch")
    parser.add_argument(
        "--speculative",
        choices=("none", "ngram"),
        default="none",
        help="also run every batch with this speculative method (same weights and requests)",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: serve the model on this many GPUs (gloo ranks on CPU with --smoke)",
    )
    args = parser.parse_args()
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp > 1 and not args.smoke and torch.cuda.device_count() < args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "tp": args.tp}
    raw_config = TINY if args.smoke else LLAMA_8B
    with tempfile.TemporaryDirectory(prefix="gpu-engine-") as tmp:
        make_engine = engine_factory(
            args=args, raw_config=raw_config, device=device, dtype=dtype, checkpoint_dir=Path(tmp), report=report
        )
        run(args=args, make_engine=make_engine, batches=batches, report=report)


if __name__ == "__main__":
    main()
