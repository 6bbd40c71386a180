"""Decode with CUDA graphs vs eager on one GPU: are the graphs correct, and how much faster?

``--cuda-graphs`` stays off by default until this shows both on a GPU. One engine on the
Llama-3.1-8B-shaped random bf16 model of ``bench/gpu_engine.py`` (its builders, timer and
batch runner are reused) captures the decode graphs of every bucket up to the largest batch
(capture seconds and graph-pool memory are recorded), then for each batch size runs the same
requests twice, graphs detached and attached (``ModelRunner.decode_graphs``), side by side:

- decode tokens/s, wall ms per step and device ms per step (CUDA events), eager vs graphs;
- correctness: the logits of one pure-decode step computed eagerly and from the graph on the
  same KV state (max abs difference relative to the largest logit, and the fraction of rows
  whose greedy token agrees; bf16 with a different decode split count is not bit-equal).

Writes ``$OUT/gpu_cuda_graphs.json`` and prints a table. ``bench/gpu_all.py`` runs it on a GPU.

    python bench/gpu_cuda_graphs.py                    # on the GPU (about a minute)
    python bench/gpu_cuda_graphs.py --smoke            # CPU, tiny shape, eager-replay backend:
                                                       # checks the script, not the figures
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_engine, also when imported by a test
from gpu_engine import (  # noqa: E402
    LLAMA_8B,
    PROMPT_TOKENS,
    TINY,
    StepTimer,
    build_engine,
    build_model,
    run_batch,
)

from splitserve_runtime.engine.cuda_graphs import DecodeGraphs, EagerReplay, decode_buckets
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.step_inputs import StepRows


def capture(engine: LLMEngine, *, max_batch: int, smoke: bool) -> tuple[DecodeGraphs, dict[str, Any]]:
    """Capture the engine's decode graphs; seconds, graph memory and buckets."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_reserved() if cuda else 0
    t0 = time.perf_counter()
    engine.runner.capture_decode_graphs(
        max_model_len=engine.max_model_len,
        buckets=decode_buckets(max_batch),
        backend=EagerReplay() if smoke else None,
    )
    seconds = time.perf_counter() - t0
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    memory = (torch.cuda.memory_reserved() - before) / 2**20 if cuda else 0.0
    return graphs, {
        "capture_seconds": seconds,
        "graph_memory_mib": memory,
        "buckets": list(graphs.buckets),
        "backend": type(graphs.backend).__name__,
    }


def logits_check(engine: LLMEngine, graphs: DecodeGraphs, *, batch: int) -> dict[str, float]:
    """One pure-decode step of ``batch`` fresh requests computed eagerly, then from its graph,
    on the same KV state (the second run rewrites the same slots with the same K/V)."""
    runner = engine.runner
    gen = torch.Generator().manual_seed(1000 + batch)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, engine.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()
        engine.add_request(request_id=f"check{batch}-{i}", prompt_token_ids=prompt, params=params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # prefill: every request then has its first token and one decode to do
    rows = StepRows(prefills=[], decodes=runner.decode_rows(list(engine.scheduler.running)), sample_prefill=[])
    with torch.inference_mode():
        runner.decode_graphs = None
        eager = runner.forward_logits(rows)
        runner.decode_graphs = graphs
        graphed = runner.forward_logits(rows)
    while engine.has_unfinished():
        engine.step()
    assert eager is not None and graphed is not None
    scale = float(eager.abs().max()) or 1.0
    return {
        "logits_max_abs_diff_rel": float((graphed - eager).abs().max()) / scale,
        "argmax_agreement": float((graphed.argmax(-1) == eager.argmax(-1)).float().mean()),
    }


def compare(engine: LLMEngine, graphs: DecodeGraphs, *, batches: list[int], new_tokens: int) -> list[dict[str, Any]]:
    timer = StepTimer(engine)
    runner = engine.runner
    rows = []
    for batch in batches:
        runner.decode_graphs = None
        eager = run_batch(engine=engine, timer=timer, batch=batch, new_tokens=new_tokens, tag=f"eager{batch}")
        runner.decode_graphs = graphs
        graphed = run_batch(engine=engine, timer=timer, batch=batch, new_tokens=new_tokens, tag=f"graphs{batch}")
        row: dict[str, Any] = {
            "batch": batch,
            "eager_tokens_per_s": eager["tokens_per_s"],
            "graphs_tokens_per_s": graphed["tokens_per_s"],
            "speedup": graphed["tokens_per_s"] / eager["tokens_per_s"],
            "eager_wall_ms_per_step": eager["wall_ms_per_step"],
            "graphs_wall_ms_per_step": graphed["wall_ms_per_step"],
            "eager_device_ms_per_step": eager.get("device_ms_per_step"),
            "graphs_device_ms_per_step": graphed.get("device_ms_per_step"),
            "roofline_ms_per_step": eager["roofline_ms_per_step"],
        }
        row.update(logits_check(engine, graphs, batch=batch))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, eager-replay backend")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device visible; use --smoke to check the script on a CPU")
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build_model(raw_config=TINY if args.smoke else LLAMA_8B, device=device, dtype=dtype, backend="auto")
    per_seq_blocks = (PROMPT_TOKENS + args.new_tokens + 32) // 16 + 1
    engine, _ = build_engine(
        model=model,
        dtype=dtype,
        device=device,
        max_num_seqs=max(batches),
        num_kv_blocks=max(batches) * per_seq_blocks + 64,
    )
    run_batch(engine=engine, timer=StepTimer(engine), batch=min(batches), new_tokens=4, tag="warmup")
    graphs, report = capture(engine, max_batch=max(batches), smoke=args.smoke)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "smoke": args.smoke,
        **report,
        "decode": compare(engine, graphs, batches=batches, new_tokens=args.new_tokens),
    }
    engine.close()
    print(
        f"decode graphs for {len(report['buckets'])} buckets captured in {report['capture_seconds']:.1f} s, "
        f"{report['graph_memory_mib']:.0f} MiB"
    )
    print(
        f"{'batch':>6}{'eager tok/s':>13}{'graphs tok/s':>14}{'speedup':>9}{'eager dev ms':>14}"
        f"{'graphs dev ms':>15}{'logit diff':>12}{'argmax eq':>11}"
    )
    for row in report["decode"]:
        print(
            f"{row['batch']:>6}{row['eager_tokens_per_s']:>13.0f}{row['graphs_tokens_per_s']:>14.0f}"
            f"{row['speedup']:>9.2f}{row['eager_device_ms_per_step'] or float('nan'):>14.2f}"
            f"{row['graphs_device_ms_per_step'] or float('nan'):>15.2f}"
            f"{row['logits_max_abs_diff_rel']:>12.1e}{row['argmax_agreement']:>11.3f}"
        )
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gpu_cuda_graphs.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
