"""Engine overhead and end-to-end CPU throughput, measured side by side in one run.

(a) Python cost of one engine step with 256 running decode sequences on the null model
    (no model compute): scheduler + block manager, input building (runner bookkeeping),
    the null forward (writes [seqs, vocab] logits), the sampler, and output processing
    (tokens, stop checks, RequestOutput) — µs per step and per sequence.
(b) Tokens/s of our engine on the tiny random Llama (CPU, fp32, a batch of prompts, greedy)
    vs Hugging Face ``generate`` on the same checkpoint in the same process. Both use
    ``--threads`` torch threads (default 1, so that a shared machine's load skews both alike).

    python bench/cpu_engine.py [--seqs 256] [--steps 200] [--batch 16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import build_null_engine
from splitserve_runtime.engine.sampling_params import SamplingParams


def bench_overhead(*, num_seqs: int, num_steps: int,
                   prompt_len: int) -> dict[str, tuple[float, float]]:
    """Median and minimum µs per step of each part."""
    config = EngineConfig(max_model_len=prompt_len + num_steps + 64, block_size=16,
                          num_kv_blocks=num_seqs * ((prompt_len + num_steps + 64) // 16 + 2),
                          max_num_seqs=num_seqs, max_num_batched_tokens=8192)
    engine = build_null_engine(config=config, vocab_size=32000)
    params = SamplingParams(temperature=0, max_tokens=num_steps + 32, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        engine.add_request(request_id=f"r{i}", prompt_token_ids=prompt, params=params)
    while engine.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    parts: dict[str, list[float]] = {"schedule": [], "prepare": [], "null forward": [],
                                     "sample": [], "postprocess": [], "step": []}
    sched, runner = engine.scheduler, engine.runner
    for _ in range(num_steps // 2):  # component timing: the same calls step() makes
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        inputs, seqs = runner.prepare(out)
        t2 = time.perf_counter()
        hidden = runner.model.forward(input_ids=inputs.input_ids, positions=inputs.positions,
                                      kv_caches=runner.kv_caches, md=inputs.md)
        logits = runner.model.compute_logits(hidden[inputs.logits_indices])
        t25 = time.perf_counter()
        result = runner.sampler.sample(logits=logits, request_ids=[s.request_id for s in seqs],
                                       params=[s.params for s in seqs])
        t3 = time.perf_counter()
        sched.on_step_done(out)
        now = time.monotonic()
        for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs, strict=True):
            engine._append_token(seq=seq, token_id=tok, logprob=lp, now=now)
        engine._process_pending()
        t4 = time.perf_counter()
        if len(out.decodes) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} decodes, got {len(out.decodes)}")
        for name, dt in (("schedule", t1 - t0), ("prepare", t2 - t1), ("null forward", t25 - t2),
                         ("sample", t3 - t25), ("postprocess", t4 - t3)):
            parts[name].append(dt)
    for _ in range(num_steps // 2):  # whole step() as the engine runs it
        t0 = time.perf_counter()
        outputs = engine.step()
        parts["step"].append(time.perf_counter() - t0)
        if len(outputs) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} outputs, got {len(outputs)}")
    return {name: (statistics.median(v) * 1e6, min(v) * 1e6) for name, v in parts.items()}


def _prompts(tokenizer: object, *, batch: int) -> list[list[int]]:
    base = "In a small village by the sea, the people"
    texts = [f"{base} number {i} liked to" for i in range(batch)]
    return [tokenizer.encode(t) for t in texts]  # type: ignore[attr-defined]


def bench_tiny_e2e(*, batch: int, new_tokens: int, model_dir: Path,
                   repeats: int) -> dict[str, float]:
    args = ServeArgs(model=str(model_dir), device="cpu", num_kv_blocks=4096, max_model_len=1024)
    engine = LLMEngine.from_args(args)
    prompts = _prompts(engine.tokenizer, batch=batch)
    # min_tokens = max_tokens bans eos throughout, as HF's min_new_tokens does
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)

    def run_ours(tag: str) -> tuple[float, dict[str, list[int]]]:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(request_id=f"{tag}{i}", prompt_token_ids=p, params=params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return time.perf_counter() - t0, tokens

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run_hf() -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t0, out[:, width:]

    # Interleaved repeats, best of each: load from other processes hits both alike.
    ours_times, hf_times = [], []
    ours_tokens: dict[str, list[int]] = {}
    hf_out = torch.empty(0)
    for rep in range(repeats + 1):
        engine.block_manager.reset_prefix_cache()
        ours_s, ours_tokens = run_ours(f"r{rep}-")
        hf_s, hf_out = run_hf()
        if rep > 0:  # the first round is warm-up
            ours_times.append(ours_s)
            hf_times.append(hf_s)
    ours_s, hf_s = min(ours_times), min(hf_times)
    tag = f"r{repeats}-"
    same = sum(ours_tokens[f"{tag}{i}"] == hf_out[i].tolist() for i in range(batch))
    total = batch * new_tokens
    return {"ours_tok_s": total / ours_s, "hf_tok_s": total / hf_s,
            "ratio": hf_s / ours_s, "same_greedy": same, "batch": batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both engines (1: stable on shared CPUs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    over = bench_overhead(num_seqs=args.seqs, num_steps=args.steps, prompt_len=args.prompt_len)
    print(f"(a) engine overhead, null model, {args.seqs} running decode sequences")
    print(f"    {'part':<16}{'median µs/step':>16}{'µs/seq':>9}{'min µs/step':>14}{'µs/seq':>9}")
    for name, (med, low) in over.items():
        print(f"    {name:<16}{med:>16.0f}{med / args.seqs:>9.2f}{low:>14.0f}{low / args.seqs:>9.2f}")
    book_med = sum(over[k][0] for k in ("schedule", "prepare", "postprocess"))
    book_min = sum(over[k][1] for k in ("schedule", "prepare", "postprocess"))
    print(f"    {'bookkeeping':<16}{book_med:>16.0f}{book_med / args.seqs:>9.2f}"
          f"{book_min:>14.0f}{book_min / args.seqs:>9.2f}   (schedule + prepare + postprocess)")

    from splitserve_runtime.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(out_dir=Path(tmp), arch="llama", seed=0)
        e2e = bench_tiny_e2e(batch=args.batch, new_tokens=args.new_tokens, model_dir=model_dir,
                             repeats=args.repeats)
    print(f"(b) tiny Llama, CPU fp32, batch {args.batch}, {args.new_tokens} new tokens, greedy")
    print(f"    ours           {e2e['ours_tok_s']:>10.0f} tok/s")
    print(f"    HF generate    {e2e['hf_tok_s']:>10.0f} tok/s")
    print(f"    ratio ours/HF  {e2e['ratio']:>10.2f}x   identical greedy outputs: "
          f"{e2e['same_greedy']:.0f}/{args.batch}")


if __name__ == "__main__":
    main()
