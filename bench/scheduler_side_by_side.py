"""Our scheduler's per-step bookkeeping next to vLLM's, on the same synthetic workload, in one run.

N requests with distinct P-token prompts are admitted and prefilled (chunked by the token
budget), then every one decodes for D steps. No model runs on either side: each step's
"sampled" token is a fixed function of the last one. Measured per decode step, as CPU time of
the driving thread (a shared machine's load does not count) and as wall time:

- **ours**: ``Scheduler.schedule`` (block manager included), the runner's input building
  (block tables, slot mapping, positions, as tensors), ``on_step_done`` and the engine's token
  loop (append, stop checks, one ``RequestOutput`` per request);
- **vLLM**: ``vllm.v1.core.sched.scheduler.Scheduler.schedule`` (its ``KVCacheManager``
  included) and ``update_from_output`` with a ``ModelRunnerOutput`` of the fake tokens (append,
  stop checks, one ``EngineCoreOutput`` per request). vLLM builds its input tensors in the
  GPU model runner, which cannot run here, so the comparable row of ours is "schedule +
  update"; "inputs" is shown apart.

vLLM is not a project dependency: it runs in a throwaway virtual environment, in a subprocess
of that environment's Python (``--vllm-python``, default ``/tmp/vllm-venv/bin/python``; make
it with ``python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm``). Without a
GPU its platform is forced to the CPU (``VLLM_TARGET_DEVICE=cpu``); only its scheduler and KV
cache manager are used. Its ``ModelConfig`` reads a tiny local checkpoint written by this
script (nothing is downloaded). ``make bench`` runs this when the environment exists.

    python bench/scheduler_side_by_side.py [--seqs 64,256,1024] [--prompt-len 128] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

DEFAULT_VLLM_PYTHON = "/tmp/vllm-venv/bin/python"
VOCAB = 32000
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192


def _next_token(token: int) -> int:
    return (token * 31 + 7) % VOCAB


def _prompt(i: int, prompt_len: int) -> list[int]:
    return [(i * 7919 + j * 13) % VOCAB for j in range(prompt_len)]


def _summary(cpu: dict[str, list[float]], wall: list[float]) -> dict[str, float]:
    out = {name: statistics.median(values) * 1e6 for name, values in cpu.items()}
    out["wall"] = statistics.median(wall) * 1e6
    return out


# ---------------------------------------------------------------------------------- ours
def run_ours(*, num_seqs: int, prompt_len: int, num_steps: int) -> dict[str, float]:
    import torch

    from splitserve_runtime.engine.config import EngineConfig
    from splitserve_runtime.engine.null_model import build_null_engine
    from splitserve_runtime.engine.outputs import RequestOutput
    from splitserve_runtime.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    max_len = prompt_len + num_steps + 64
    config = EngineConfig(
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_seqs * (max_len // BLOCK_SIZE + 2),
        max_num_seqs=num_seqs,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        async_scheduling=False,
    )
    engine = build_null_engine(config=config, vocab_size=VOCAB)
    params = SamplingParams(temperature=0, max_tokens=num_steps + 32, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(request_id=f"r{i}", prompt_token_ids=_prompt(i, prompt_len), params=params)
    sched, runner = engine.scheduler, engine.runner
    cpu: dict[str, list[float]] = {"schedule": [], "inputs": [], "update": []}
    wall: list[float] = []
    decoding = 0
    while decoding < num_steps:
        w0, t0 = time.perf_counter(), time.thread_time()
        out = sched.schedule()
        t1 = time.thread_time()
        rows, seqs = runner.step_rows(out)
        rows.build(block_size=runner.block_size, device=runner.device)
        t2 = time.thread_time()
        sched.on_step_done(out)
        outputs: list[RequestOutput] = []
        tokens = [_next_token(seq.token_ids[-1]) for seq in seqs]
        engine._outputs.append(seqs, tokens, [None] * len(seqs), now=time.monotonic(), outputs=outputs)
        t3, w3 = time.thread_time(), time.perf_counter()
        if len(out.decodes) == num_seqs:  # a pure decode step
            decoding += 1
            cpu["schedule"].append(t1 - t0)
            cpu["inputs"].append(t2 - t1)
            cpu["update"].append(t3 - t2)
            wall.append(w3 - w0)
            if len(outputs) != num_seqs:
                raise RuntimeError(f"expected {num_seqs} outputs, got {len(outputs)}")
    engine.close()
    return _summary(cpu, wall)


# ---------------------------------------------------------------------------------- vLLM
def run_vllm(*, num_seqs: int, prompt_len: int, num_steps: int, model_dir: str) -> dict[str, float]:
    """Runs in the vLLM environment's Python (imports vLLM only)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    torch.set_num_threads(1)
    max_len = prompt_len + num_steps + 64
    num_blocks = num_seqs * (max_len // BLOCK_SIZE + 2)
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_model_len=max_len,
            is_encoder_decoder=False,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            enable_chunked_prefill=True,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
            )
        ],
    )
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(temperature=0, max_tokens=num_steps + 32, ignore_eos=True)
    for i in range(num_seqs):
        scheduler.add_request(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=_prompt(i, prompt_len),
                sampling_params=params,
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    cpu: dict[str, list[float]] = {"schedule": [], "update": []}
    wall: list[float] = []
    decoding = 0
    while decoding < num_steps:
        w0, t0 = time.perf_counter(), time.thread_time()
        out = scheduler.schedule()
        t1 = time.thread_time()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = scheduler.requests[rid]
            # schedule() already counted the scheduled tokens as computed: a request whose
            # every token is computed samples its next one (a prefill chunk before the end does not)
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([_next_token(request.all_token_ids[-1])] if done else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        t2 = time.thread_time()
        engine_outputs = scheduler.update_from_output(out, runner_output)
        t3, w3 = time.thread_time(), time.perf_counter()
        num_decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
        if num_decodes == num_seqs:
            decoding += 1
            cpu["schedule"].append(t1 - t0)
            cpu["update"].append(t3 - t2)
            wall.append((w3 - w0) - (t2 - t1))  # the fake runner output is not vLLM's work
            produced = sum(len(o.outputs) for o in engine_outputs.values())
            if produced != num_seqs:
                raise RuntimeError(f"expected {num_seqs} outputs from vLLM, got {produced}")
    return _summary(cpu, wall)


def _vllm_child(args: argparse.Namespace) -> None:
    results = {
        n: run_vllm(num_seqs=n, prompt_len=args.prompt_len, num_steps=args.steps, model_dir=args.model_dir)
        for n in _sizes(args.seqs)
    }
    print("RESULT " + json.dumps(results))


def _run_vllm_subprocess(args: argparse.Namespace, model_dir: Path) -> tuple[dict[int, dict[str, float]] | None, str]:
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_LEVEL="ERROR",
        TORCH_CPP_LOG_LEVEL="ERROR",
        HF_HUB_OFFLINE="1",
    )
    env.pop("PYTHONPATH", None)
    cmd = [
        args.vllm_python,
        str(Path(__file__).resolve()),
        "--vllm-child",
        "--seqs",
        args.seqs,
        "--prompt-len",
        str(args.prompt_len),
        "--steps",
        str(args.steps),
        "--model-dir",
        str(model_dir),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            raw: dict[str, dict[str, float]] = json.loads(line[len("RESULT ") :])
            return {int(k): v for k, v in raw.items()}, ""
    return None, (proc.stderr or proc.stdout).strip()[-2000:]


def _vllm_version(python: str) -> str:
    proc = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.stdout.strip() or "?"


def _sizes(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="64,256,1024")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100, help="decode steps measured per size")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_child:
        _vllm_child(args)
        return
    if not Path(args.vllm_python).exists():
        print(
            f"scheduler side by side: skipped, no vLLM environment at {args.vllm_python} "
            "(python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm)"
        )
        return

    from splitserve_runtime.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(out_dir=Path(tmp), arch="llama", seed=0)
        theirs, error = _run_vllm_subprocess(args, model_dir)
    ours = {n: run_ours(num_seqs=n, prompt_len=args.prompt_len, num_steps=args.steps) for n in _sizes(args.seqs)}
    print(
        f"scheduler side by side: {args.steps} decode steps after {args.prompt_len}-token prompts, no model, "
        f"block {BLOCK_SIZE}, prefix caching on; median µs per decode step (CPU time of the thread; wall in brackets)"
    )
    print(
        f"    {'seqs':>5}  {'ours schedule':>14}{'+ update':>10}{'= total':>9}{'inputs':>8}   "
        f"{'vLLM ' + _vllm_version(args.vllm_python) + ' schedule':>22}{'+ update':>10}{'= total':>9}{'vLLM/ours':>11}"
    )
    for n in _sizes(args.seqs):
        o = ours[n]
        total = o["schedule"] + o["update"]
        line = f"    {n:>5}  {o['schedule']:>14.0f}{o['update']:>10.0f}{total:>9.0f}{o['inputs']:>8.0f}   "
        if theirs is None:
            line += "vLLM: failed (below)"
        else:
            t = theirs[n]
            their_total = t["schedule"] + t["update"]
            line += f"{t['schedule']:>22.0f}{t['update']:>10.0f}{their_total:>9.0f}{their_total / total:>10.1f}x"
        print(
            line
            + f"   [wall ours {o['wall']:.0f} incl. inputs"
            + ("" if theirs is None else f", vLLM {theirs[n]['wall']:.0f}")
            + "]"
        )
    if theirs is None:
        print("    vLLM could not be driven:\n" + "\n".join("      " + line for line in error.splitlines()))


if __name__ == "__main__":
    main()
