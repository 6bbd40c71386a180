"""Measure our runtime's engine step times and write a planner profile (schemaVersion 1).

Runs ``splitserve_runtime.engine.llm_engine.LLMEngine`` in-process on the tiny random Llama
(written to a temporary directory unless ``--model-dir`` is given) and times single
``engine.step()`` calls: prefill steps of ``numSeqs`` × ``numTokens`` (optionally after a cached
prefix), decode steps of batches of running sequences, and mixed steps (a decode batch plus a
new prompt, as continuous batching runs them). Each figure is the median of
``--repeats`` runs. The output feeds ``splitserve plan --profile FILE`` and the simulator's
validation test. Torch threads default to 1 so that other load on a shared machine skews less.

    python -m splitserve_planner.runtime_profile --out planner/splitserve_planner/profiles/cpu-tiny-llama.json
    python -m splitserve_planner.runtime_profile --device cuda --model-dir /models/llama-3.1-8b --out h200.json

This is the one module of the planner that imports the runtime (it runs the engine); the rest
of the planner is torch-free (import-linter, ``.importlinter``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitserve_contract import ServeArgs, defaults
from splitserve_contract.model_config import load_model_config
from splitserve_planner.perf_model import prefill_attention_pairs
from splitserve_planner.profile import (
    DecodeSample,
    EngineInfo,
    ModelInfo,
    PrefillSample,
    Profile,
    StepSample,
    save_profile,
)
from splitserve_planner.workload import Request
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.scheduler import SchedulerOutput

MAX_MODEL_LEN = 2048


@dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    num_kv_blocks: int = 2048
    block_size: int = defaults.BLOCK_SIZE
    device: str = "cpu"
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024)
    prefill_seqs: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    decode_prompt_tokens: tuple[int, ...] = (32, 256)
    mixed_batches: tuple[int, ...] = (4, 16, 48)
    mixed_new_tokens: tuple[int, ...] = (64, 512)
    repeats: int = 3
    clock: str = "wall"
    """wall: elapsed time; cpu: this thread's CPU time (other tenants' load excluded)."""


def build_engine(*, model_dir: Path, settings: ProfileSettings) -> LLMEngine:
    args = ServeArgs(
        model=str(model_dir),
        device=settings.device,
        num_kv_blocks=settings.num_kv_blocks,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        prefix_caching=True,
        chunked_prefill=True,
    )
    return LLMEngine.from_args(args)


class _Ids:
    """Fresh random prompts, so no two samples share a cached prefix by accident."""

    def __init__(self, *, vocab_size: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.count = 0

    def prompt(self, num_tokens: int) -> list[int]:
        return [int(t) for t in self.rng.integers(3, self.vocab_size - 1, size=num_tokens)]

    def request_id(self) -> str:
        self.count += 1
        return f"profile-{self.count}"


_CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _timed_step(engine: LLMEngine, clock: str = "wall") -> float:
    now = _CLOCKS[clock]
    start = now()
    engine.step()
    return now() - start


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def measure_prefill(
    *, engine: LLMEngine, ids: _Ids, num_seqs: int, num_tokens: int, num_cached_tokens: int, clock: str = "wall"
) -> float:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefix = ids.prompt(num_cached_tokens) if num_cached_tokens else []
    if prefix:
        engine.add_request(request_id=ids.request_id(), prompt_token_ids=prefix + ids.prompt(1), params=one)
        _drain(engine)
    for _ in range(num_seqs):
        engine.add_request(request_id=ids.request_id(), prompt_token_ids=prefix + ids.prompt(num_tokens), params=one)
    seconds = _timed_step(engine, clock)
    if engine.has_unfinished():
        raise RuntimeError(f"prefill of {num_seqs}x{num_tokens} did not fit one step; raise max_batched_tokens")
    return seconds


def measure_decode(
    *, engine: LLMEngine, ids: _Ids, batch_size: int, prompt_tokens: int, num_steps: int, clock: str = "wall"
) -> list[tuple[int, float]]:
    """``(context tokens held before the step, seconds)`` for ``num_steps`` decode steps."""
    params = SamplingParams(temperature=0, max_tokens=num_steps + 8, ignore_eos=True)
    rids = [ids.request_id() for _ in range(batch_size)]
    for rid in rids:
        engine.add_request(request_id=rid, prompt_token_ids=ids.prompt(prompt_tokens), params=params)
    sched = engine.scheduler
    while sched.num_waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        engine.step()
    out: list[tuple[int, float]] = []
    for _ in range(num_steps):
        context = sum(s.num_computed_tokens for s in sched.running)
        out.append((context, _timed_step(engine, clock)))
    for rid in rids:
        engine.abort_request(rid)
    return out


def measure_mixed(
    *, engine: LLMEngine, ids: _Ids, batch_size: int, prompt_tokens: int, new_tokens: int, clock: str = "wall"
) -> StepSample:
    """One step holding ``batch_size`` decodes and a new ``new_tokens`` prompt, as in serving."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rids = [ids.request_id() for _ in range(batch_size)]
    for rid in rids:
        engine.add_request(request_id=rid, prompt_token_ids=ids.prompt(prompt_tokens), params=params)
    sched = engine.scheduler
    while sched.num_waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        engine.step()
    newcomer = ids.request_id()
    engine.add_request(
        request_id=newcomer,
        prompt_token_ids=ids.prompt(new_tokens),
        params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    )
    with _recording_schedules(sched) as scheduled:
        seconds = _timed_step(engine, clock)
    for rid in [*rids, newcomer]:
        engine.abort_request(rid)
    tokens, seqs, pairs, kv = _step_shape(scheduled[-1])
    return StepSample(
        num_tokens=tokens, num_seqs=seqs, num_attention_pairs=pairs, num_kv_tokens=kv, seconds=max(seconds, 1e-9)
    )


def measure_profile(*, engine: LLMEngine, model_dir: Path, settings: ProfileSettings, seed: int = 0) -> Profile:
    config = load_model_config(model_dir=model_dir)
    ids = _Ids(vocab_size=config.vocab_size, seed=seed)
    for tokens in (16, 256, 1024):  # warm-up
        measure_prefill(engine=engine, ids=ids, num_seqs=1, num_tokens=tokens, num_cached_tokens=0)
    measure_decode(engine=engine, ids=ids, batch_size=16, prompt_tokens=64, num_steps=4)
    prefill: list[PrefillSample] = []
    for num_seqs in settings.prefill_seqs:
        for num_tokens in settings.prefill_tokens:
            if num_seqs * num_tokens > settings.max_batched_tokens:
                continue
            for cached in (0, num_tokens):
                if cached and (
                    num_seqs * num_tokens > settings.max_batched_tokens // 2 or 2 * num_tokens + 2 > MAX_MODEL_LEN
                ):
                    continue
                times = [
                    measure_prefill(
                        engine=engine,
                        ids=ids,
                        num_seqs=num_seqs,
                        num_tokens=num_tokens,
                        num_cached_tokens=cached,
                        clock=settings.clock,
                    )
                    for _ in range(settings.repeats)
                ]
                prefill.append(
                    PrefillSample(
                        num_seqs=num_seqs,
                        num_tokens=num_tokens,
                        num_cached_tokens=cached,
                        seconds=statistics.median(times),
                    )
                )
    decode: list[DecodeSample] = []
    for batch in settings.decode_batches:
        for prompt in settings.decode_prompt_tokens:
            steps = measure_decode(
                engine=engine,
                ids=ids,
                batch_size=batch,
                prompt_tokens=prompt,
                num_steps=max(settings.repeats, 3),
                clock=settings.clock,
            )
            context = steps[0][0]
            decode.append(
                DecodeSample(
                    batch_size=batch, num_context_tokens=context, seconds=statistics.median(s for _, s in steps)
                )
            )
    mixed: list[StepSample] = []
    for batch in settings.mixed_batches:
        for new_tokens in settings.mixed_new_tokens:
            runs = [
                measure_mixed(
                    engine=engine,
                    ids=ids,
                    batch_size=batch,
                    prompt_tokens=128,
                    new_tokens=new_tokens,
                    clock=settings.clock,
                )
                for _ in range(settings.repeats)
            ]
            mixed.append(sorted(runs, key=lambda r: r.seconds)[len(runs) // 2])
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    return Profile(
        schema_version=1,
        model=ModelInfo(
            name=model_dir.name if model_dir.name else "model",
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
        ),
        device=f"{settings.device} ({torch.get_num_threads()} torch threads, {settings.clock} clock)",
        dtype="float32",
        kv_bytes_per_token=kv_bytes,
        kv_capacity_tokens=engine.block_manager.num_blocks * engine.block_manager.block_size,
        engine=EngineInfo(
            max_num_seqs=settings.max_num_seqs,
            max_batched_tokens=settings.max_batched_tokens,
            block_size=settings.block_size,
        ),
        measured_at=datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        tool="splitserve_planner.runtime_profile",
        notes=f"torch {torch.__version__}; median of {settings.repeats}",
        prefill=prefill,
        decode=decode,
        steps=mixed,
    )


@dataclass(kw_only=True)
class ReplayResult:
    """What a real run of a workload through the engine measured."""

    ttft_seconds: list[float]
    itl_seconds: list[float]
    steps: list[StepSample]


def _step_shape(out: SchedulerOutput) -> tuple[int, int, int, int]:
    """(tokens, sampled sequences, attention pairs, KV tokens held) of a scheduled step."""
    tokens = sum(c.num_tokens for c in out.prefills) + len(out.decodes)
    seqs = sum(1 for c in out.prefills if c.samples) + len(out.decodes)
    pairs = sum(
        prefill_attention_pairs(num_new_tokens=c.num_tokens, num_computed_tokens=c.start_position) for c in out.prefills
    ) + sum(s.num_computed_tokens + 1 for s in out.decodes)
    kv = sum(c.start_position for c in out.prefills) + sum(s.num_computed_tokens for s in out.decodes)
    return tokens, seqs, pairs, kv


def replay_workload(
    *, engine: LLMEngine, requests: list[Request], vocab_size: int, seed: int = 0, clock: str = "wall"
) -> ReplayResult:
    """Feed ``requests`` to the engine at their arrival times, step it as the server's loop
    does, and collect TTFT/ITL per token, plus every step's shape and duration.

    ``clock="wall"``: real time, latencies as the engine measures them. ``clock="cpu"``: a
    virtual clock advanced by this thread's CPU time per step (and jumped to the next arrival
    when idle), i.e. the same engine on a CPU of its own: scheduling, batching and compute are
    real, other tenants' load is not.
    """
    ids = _Ids(vocab_size=vocab_size, seed=seed)
    prompts = {r.request_id: _replay_prompt(ids, r) for r in requests}
    ttft: list[float] = []
    itl: list[float] = []
    steps: list[StepSample] = []
    arrival: dict[str, float] = {}
    last_token: dict[str, float] = {}
    wall_start = time.monotonic()
    virtual = 0.0
    step_clock = _CLOCKS[clock]
    index = 0
    with _recording_schedules(engine.scheduler) as scheduled:
        while index < len(requests) or engine.has_unfinished():
            now = virtual if clock == "cpu" else time.monotonic() - wall_start
            while index < len(requests) and requests[index].arrival_seconds <= now:
                r = requests[index]
                rid = f"replay-{r.request_id}"
                arrival[rid] = r.arrival_seconds
                engine.add_request(
                    request_id=rid,
                    prompt_token_ids=prompts[r.request_id],
                    params=SamplingParams(temperature=0, max_tokens=r.num_output_tokens, ignore_eos=True),
                    arrival_time_s=wall_start + r.arrival_seconds,
                )
                index += 1
            if not engine.has_unfinished():
                if clock == "cpu":
                    virtual = requests[index].arrival_seconds
                else:
                    time.sleep(max(0.0, requests[index].arrival_seconds - (time.monotonic() - wall_start)))
                continue
            t0 = step_clock()
            outputs = engine.step()
            seconds = step_clock() - t0
            virtual += seconds
            if scheduled and not scheduled[-1].is_empty:
                tokens, seqs, pairs, kv = _step_shape(scheduled[-1])
                steps.append(
                    StepSample(
                        num_tokens=tokens,
                        num_seqs=max(seqs, 1),
                        num_attention_pairs=max(pairs, 1),
                        num_kv_tokens=kv,
                        seconds=max(seconds, 1e-9),
                    )
                )
            scheduled.clear()
            emitted = virtual if clock == "cpu" else time.monotonic() - wall_start
            for out in outputs:
                if not out.new_token_ids:
                    continue
                rid = out.request_id
                if rid not in last_token:
                    ttft.append(emitted - arrival[rid] if clock == "cpu" else float(out.ttft_seconds or 0.0))
                elif clock == "cpu":
                    itl.extend([emitted - last_token[rid]] * len(out.new_token_ids))
                if clock != "cpu":
                    itl.extend(out.itl_seconds)
                last_token[rid] = emitted
    return ReplayResult(ttft_seconds=ttft, itl_seconds=itl, steps=steps)


@contextlib.contextmanager
def _recording_schedules(scheduler: Any) -> Iterator[list[SchedulerOutput]]:
    """Record every ``SchedulerOutput`` the engine's scheduler hands out while in the block
    (the step's shape is read from it), then restore the scheduler."""
    original = scheduler.schedule
    scheduled: list[SchedulerOutput] = []

    def spy() -> SchedulerOutput:
        out: SchedulerOutput = original()
        scheduled.append(out)
        return out

    scheduler.schedule = spy
    try:
        yield scheduled
    finally:
        scheduler.schedule = original


def _replay_prompt(ids: _Ids, r: Request) -> list[int]:
    """A prompt of ``r``'s length; requests of one prefix group share their first tokens."""
    if r.prefix_group < 0:
        return ids.prompt(r.num_prompt_tokens)
    shared = np.random.default_rng([r.prefix_group, 99]).integers(3, ids.vocab_size - 1, size=r.num_prefix_tokens)
    return [int(t) for t in shared] + ids.prompt(r.num_prompt_tokens - r.num_prefix_tokens)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a fresh tiny Llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--clock",
        choices=sorted(_CLOCKS),
        default="cpu",
        help="cpu: per-thread CPU time, robust to other load on a shared machine",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = ProfileSettings(device=args.device, repeats=args.repeats, clock=args.clock)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from splitserve_runtime.model.tiny import write_tiny_model

            model_dir = write_tiny_model(out_dir=Path(tmp) / "tiny-llama", arch="llama", seed=0)
        engine = build_engine(model_dir=model_dir, settings=settings)
        started = time.perf_counter()
        profile = measure_profile(engine=engine, model_dir=model_dir, settings=settings)
    save_profile(profile=profile, path=args.out)
    from splitserve_planner.profile import ProfileModel

    fit = ProfileModel(profile=profile).fit_errors()
    print(
        f"wrote {args.out}: {len(profile.prefill)} prefill + {len(profile.decode)} decode + "
        f"{len(profile.steps)} mixed samples in "
        f"{time.perf_counter() - started:.1f} s; fit median error {fit['median_relative_error']:.1%}, "
        f"max {fit['max_relative_error']:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
