"""Engine overhead and end-to-end CPU throughput, measured side by side in one run.

(a) Python cost of one engine step with N running decode sequences on the null model (no model
    compute), for N = 64, 256 and 1024: the scheduler + block manager, input building (runner
    bookkeeping), the null forward (writes [seqs, vocab] logits), the sampler, and output
    processing (tokens, stop checks, RequestOutput) — µs per step and per sequence.
    "bookkeeping" = schedule + prepare + postprocess: what the engine itself adds per step
    (the sampler is measured apart; its kernels are the device's work on a GPU). Between the
    parts the CPU null forward and sampler write and read [seqs, 32000] fp32 logits (32 MB at
    256), which evicts the host's caches every step; "back to back" is the same bookkeeping
    with fake tokens and nothing in between, as on a host whose logits live on a GPU.
(b) Tokens/s of our engine on the tiny random Llama (CPU, fp32, a batch of prompts, greedy)
    vs Hugging Face ``generate`` on the same checkpoint in the same process. Both use
    ``--threads`` torch threads (default 1, so that a shared machine's load skews both alike).
(c) Overlap: 256 decodes on a null model whose forward takes a fixed time F (a sleep, as a
    device would), with synchronous steps (expected F + O, O the host's work per step) and with
    asynchronous scheduling (expected max(F, O)), for an F above and an F below O. O splits
    into D (the null logits and the sampler, which must follow a forward before the next one
    starts) and H (bookkeeping); max(F + D, H) is what any step loop can reach.

    python bench/cpu_engine.py [--seqs 64,256,1024] [--steps 200] [--batch 16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import build_null_engine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams


def _decoding_engine(
    *,
    num_seqs: int,
    num_steps: int,
    prompt_len: int,
    vocab_size: int,
    async_scheduling: bool,
    forward_seconds: float = 0.0,
) -> LLMEngine:
    """A null engine with ``num_seqs`` requests past their prefill, all decoding."""
    max_len = prompt_len + 2 * num_steps + 64
    config = EngineConfig(
        max_model_len=max_len,
        block_size=16,
        num_kv_blocks=num_seqs * (max_len // 16 + 2),
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(8192, 2 * num_seqs),
        async_scheduling=async_scheduling,
    )
    engine = build_null_engine(config=config, vocab_size=vocab_size, forward_seconds=forward_seconds)
    params = SamplingParams(temperature=0, max_tokens=2 * num_steps + 32, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % vocab_size for j in range(prompt_len)]
        engine.add_request(request_id=f"r{i}", prompt_token_ids=prompt, params=params)
    while engine.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()
    return engine


def bench_overhead(
    *, num_seqs: int, num_steps: int, prompt_len: int, vocab_size: int = 32000
) -> dict[str, tuple[float, float]]:
    """Median µs per step of each part in CPU time of this thread (what the work costs,
    whatever else the machine runs) and minimum in wall time (synchronous steps)."""
    engine = _decoding_engine(
        num_seqs=num_seqs, num_steps=num_steps, prompt_len=prompt_len, vocab_size=vocab_size, async_scheduling=False
    )
    names = ("schedule", "prepare", "null forward", "sample", "postprocess", "step", "back to back")
    cpu: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    sched, runner = engine.scheduler, engine.runner
    clocks = (time.thread_time, time.perf_counter)
    for _ in range(num_steps // 2):  # component timing: the same calls step() makes
        t0 = [clock() for clock in clocks]
        out = sched.schedule()
        t1 = [clock() for clock in clocks]
        inputs, seqs = runner.prepare(out)
        t2 = [clock() for clock in clocks]
        with torch.inference_mode():
            hidden = runner.model.forward(
                input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=runner.kv_caches, md=inputs.md
            )
            logits = runner.model.compute_logits(hidden[inputs.logits_indices])
        t25 = [clock() for clock in clocks]
        result = runner.sample(logits, seqs).resolve()
        t3 = [clock() for clock in clocks]
        sched.on_step_done(out)
        outputs: list[RequestOutput] = []
        engine._outputs.append(seqs, result.token_ids, result.logprobs, now=time.monotonic(), outputs=outputs)
        t4 = [clock() for clock in clocks]
        if len(out.decodes) != num_seqs or len(outputs) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} decodes and outputs, got {len(out.decodes)}, {len(outputs)}")
        for name, a, b in (
            ("schedule", t0, t1),
            ("prepare", t1, t2),
            ("null forward", t2, t25),
            ("sample", t25, t3),
            ("postprocess", t3, t4),
        ):
            cpu[name].append(b[0] - a[0])
            wall[name].append(b[1] - a[1])
    for _ in range(num_steps // 2):  # whole step() as the engine runs it
        t0 = [clock() for clock in clocks]
        step_outputs = engine.step()
        cpu["step"].append(time.thread_time() - t0[0])
        wall["step"].append(time.perf_counter() - t0[1])
        if len(step_outputs) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} outputs, got {len(step_outputs)}")
    for _ in range(num_steps // 2):  # the bookkeeping alone: fake tokens, no forward or sampler
        t0 = [clock() for clock in clocks]
        out = sched.schedule()
        inputs, seqs = runner.prepare(out)
        sched.on_step_done(out)
        outputs = []
        engine._outputs.append(
            seqs,
            [(seq.token_ids[-1] * 31 + 7) % vocab_size for seq in seqs],
            [None] * len(seqs),
            now=time.monotonic(),
            outputs=outputs,
        )
        cpu["back to back"].append(time.thread_time() - t0[0])
        wall["back to back"].append(time.perf_counter() - t0[1])
        if len(outputs) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} outputs, got {len(outputs)}")
    engine.close()
    return {name: (statistics.median(cpu[name]) * 1e6, min(wall[name]) * 1e6) for name in names}


def _median_step_us(engine: LLMEngine, *, num_steps: int, num_seqs: int) -> float:
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        if len(outputs) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} outputs, got {len(outputs)}")
    engine.close()
    return statistics.median(times) * 1e6


def _async_sides(engine: LLMEngine, *, num_steps: int, num_seqs: int) -> tuple[float, float, float]:
    """Asynchronous steps: median µs per step, the forward thread's mean busy µs per step (the
    forward side: sleep, sampler, its GIL waits) and the engine thread's median CPU µs per step
    (the host side: scheduling, inputs, output processing)."""
    times, host = [], []
    busy_started = engine.forward_busy_seconds
    for _ in range(num_steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        host.append(time.thread_time() - c0)
        if len(outputs) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} outputs, got {len(outputs)}")
    busy_ended = engine.forward_busy_seconds
    engine.close()
    if busy_started is None or busy_ended is None:
        raise RuntimeError("asynchronous scheduling did not start a forward thread")
    forward_side = (busy_ended - busy_started) / num_steps
    return statistics.median(times) * 1e6, forward_side * 1e6, statistics.median(host) * 1e6


_OVERLAP_VOCAB = 1024


def bench_overlap(*, num_seqs: int, num_steps: int, prompt_len: int, forward_ms: float) -> dict[str, float]:
    """Median µs per step: host work alone (O), a forward alone (F), and both, synchronous
    and asynchronous; for the asynchronous steps also the two sides they overlap (see
    :func:`_async_sides`). Small vocabulary: the logits and the sampler stay small.

    O splits into D, the work that must follow the forward before the next one can start (the
    null model's logits and the sampler: a device's work on a GPU), and H, the engine's
    bookkeeping (schedule, inputs, output processing). No step loop can beat max(F + D, H):
    step n+1's forward needs step n's sampled ids."""

    def engine(*, async_scheduling: bool, forward_seconds: float) -> LLMEngine:
        return _decoding_engine(
            num_seqs=num_seqs,
            num_steps=num_steps,
            prompt_len=prompt_len,
            vocab_size=_OVERLAP_VOCAB,
            async_scheduling=async_scheduling,
            forward_seconds=forward_seconds,
        )

    parts = bench_overhead(num_seqs=num_seqs, num_steps=num_steps, prompt_len=prompt_len, vocab_size=_OVERLAP_VOCAB)
    device = parts["null forward"][0] + parts["sample"][0]
    bookkeeping = sum(parts[k][0] for k in ("schedule", "prepare", "postprocess"))

    sleeps = []
    for _ in range(50):
        t0 = time.perf_counter()
        time.sleep(forward_ms / 1000)
        sleeps.append(time.perf_counter() - t0)
    host = _median_step_us(engine(async_scheduling=False, forward_seconds=0.0), num_steps=num_steps, num_seqs=num_seqs)
    sync = _median_step_us(
        engine(async_scheduling=False, forward_seconds=forward_ms / 1000), num_steps=num_steps, num_seqs=num_seqs
    )
    overlapped, forward_side, host_side = _async_sides(
        engine(async_scheduling=True, forward_seconds=forward_ms / 1000), num_steps=num_steps, num_seqs=num_seqs
    )
    forward = statistics.median(sleeps) * 1e6
    return {
        "O": host,
        "F": forward,
        "sync": sync,
        "async": overlapped,
        "bound": max(host, forward),
        "forward side": forward_side,
        "host side": host_side,
        "D": device,
        "H": bookkeeping,
        "attainable": max(forward + device, bookkeeping),
    }


def _prompts(tokenizer: object, *, batch: int) -> list[list[int]]:
    base = "In a small village by the sea, the people"
    texts = [f"{base} number {i} liked to" for i in range(batch)]
    return [tokenizer.encode(t) for t in texts]  # type: ignore[attr-defined]


def bench_tiny_e2e(*, batch: int, new_tokens: int, model_dir: Path, repeats: int) -> dict[str, float]:
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

    hf: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run_hf() -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
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
    return {
        "ours_tok_s": total / ours_s,
        "hf_tok_s": total / hf_s,
        "ratio": hf_s / ours_s,
        "same_greedy": same,
        "batch": batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", default="64,256,1024", help="comma-separated decode batch sizes for (a)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--overlap-seqs", type=int, default=256)
    parser.add_argument("--forward-ms", default="5,0.5", help="comma-separated fixed forward times for (c)")
    parser.add_argument("--skip-e2e", action="store_true", help="skip (b)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for both engines (1: stable on shared CPUs)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("(a) engine overhead, null model, running decode sequences (synchronous steps)")
    print("    median: of this thread's CPU time (immune to other load on a shared machine); min: wall time")
    print(f"    {'seqs':>5} {'part':<13}{'median µs/step':>16}{'µs/seq':>9}{'min µs/step':>14}{'µs/seq':>9}")
    for num_seqs in (int(n) for n in args.seqs.split(",")):
        over = bench_overhead(num_seqs=num_seqs, num_steps=args.steps, prompt_len=args.prompt_len)
        for name, (med, low) in over.items():
            if name == "back to back":
                continue
            print(f"    {num_seqs:>5} {name:<13}{med:>16.0f}{med / num_seqs:>9.2f}{low:>14.0f}{low / num_seqs:>9.2f}")
        book_med = sum(over[k][0] for k in ("schedule", "prepare", "postprocess"))
        book_min = sum(over[k][1] for k in ("schedule", "prepare", "postprocess"))
        print(
            f"    {num_seqs:>5} {'bookkeeping':<13}{book_med:>16.0f}{book_med / num_seqs:>9.2f}"
            f"{book_min:>14.0f}{book_min / num_seqs:>9.2f}   (schedule + prepare + postprocess)"
        )
        med, low = over["back to back"]
        print(
            f"    {num_seqs:>5} {'back to back':<13}{med:>16.0f}{med / num_seqs:>9.2f}{low:>14.0f}"
            f"{low / num_seqs:>9.2f}   (the same bookkeeping, no CPU forward/sampler between steps)"
        )

    if not args.skip_e2e:
        from splitserve_runtime.model.tiny import write_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_tiny_model(out_dir=Path(tmp), arch="llama", seed=0)
            e2e = bench_tiny_e2e(
                batch=args.batch, new_tokens=args.new_tokens, model_dir=model_dir, repeats=args.repeats
            )
        print(f"(b) tiny Llama, CPU fp32, batch {args.batch}, {args.new_tokens} new tokens, greedy")
        print(f"    ours           {e2e['ours_tok_s']:>10.0f} tok/s")
        print(f"    HF generate    {e2e['hf_tok_s']:>10.0f} tok/s")
        print(
            f"    ratio ours/HF  {e2e['ratio']:>10.2f}x   identical greedy outputs: "
            f"{e2e['same_greedy']:.0f}/{args.batch}"
        )

    print(
        f"(c) overlap, {args.overlap_seqs} decodes, null model with a fixed-time forward F "
        "(median µs/step; O = host work per step)"
    )
    print(
        f"    {'F':>7}{'O':>7}{'sync':>8}{'async':>8}{'max(F,O)':>10}{'async/max':>11}{'sync/(F+O)':>12}"
        f"{'D':>6}{'H':>6}{'max(F+D,H)':>12}{'async/that':>12}{'fwd side':>10}{'host side':>11}"
    )
    for forward_ms in (float(f) for f in args.forward_ms.split(",")):
        row = bench_overlap(
            num_seqs=args.overlap_seqs, num_steps=args.steps, prompt_len=args.prompt_len, forward_ms=forward_ms
        )
        print(
            f"    {row['F']:>7.0f}{row['O']:>7.0f}{row['sync']:>8.0f}{row['async']:>8.0f}{row['bound']:>10.0f}"
            f"{row['async'] / row['bound']:>11.2f}{row['sync'] / (row['F'] + row['O']):>12.2f}"
            f"{row['D']:>6.0f}{row['H']:>6.0f}{row['attainable']:>12.0f}{row['async'] / row['attainable']:>12.2f}"
            f"{row['forward side']:>10.0f}{row['host side']:>11.0f}"
        )
    print(
        "    D = the null logits + the sampler (they must follow a forward before the next starts; a GPU's"
        " work), H = bookkeeping (O ≈ D + H): max(F+D, H) is the best any step loop can do;\n"
        "    fwd side = the forward thread's busy time per step (F, D, its waits for the GIL);"
        " host side = the engine thread's CPU per step"
    )


if __name__ == "__main__":
    main()
