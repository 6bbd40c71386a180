"""Every GPU benchmark in one run, with one JSON summary: what to run when a GPU is lent.

A GPU machine is lent rarely and briefly (minutes), so the GPU figures must come from one
prepared command that cannot be half-remembered: this script runs, each in its own process
and output folder, with a time limit,

1. ``bench/gpu_kernels.py``: decode attention GB/s vs the measured copy bandwidth, prefill
   TFLOP/s vs peak and vs torch SDPA, the elementwise kernels, and the quantized GEMMs (fp8,
   int8 W8A8, int8 W8A16, int4 W4A16) vs the bf16 GEMM and vs peak;
2. ``bench/gpu_engine.py``: the 8B-shaped engine's decode tokens/s vs the memory roofline at
   batch 1 / 64 / 256 and the device's idle time between steps;
3. ``bench/gpu_engine.py --speculative ngram``: the cost of verifying 1 + k rows per sequence
   (break-even tokens per forward) at batch 1 / 16 / 64;
4. ``bench/gpu_engine.py --tp 2`` when two or more GPUs are visible;
5. ``bench/gpu_cuda_graphs.py``: decode tokens/s with CUDA graphs vs eager at batch 1 / 64 /
   256 on the same engine and requests, and the graphs' logits against eager ones (GPU only:
   the smoke run leaves it out; ``tests/runtime/bench/test_gpu_cuda_graphs_bench.py`` checks its
   ``--smoke``);

then writes ``$OUT/gpu_all.json``: each step's command, exit status, seconds and JSON, and a
``summary`` with the headline ratios, and prints that summary. The exit status is 1 when a
step failed (its error is in the JSON; the other steps still run).

``--smoke`` runs the same steps on the CPU at tiny shapes (the kernels under
``TRITON_INTERPRET=1``, TP 2 as two gloo ranks): it checks the script, not the figures, and
runs in CI (``tests/runtime/bench/test_gpu_all_smoke.py``).

    bench/gpu_all.sh                 # on the GPU machine: about 6-9 minutes on an H200
    bench/gpu_all.sh --smoke         # CPU: checks the script (about a minute)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    script: str
    args: tuple[str, ...]
    json_name: str
    timeout_seconds: float


SMOKE_TIME_FACTOR = 5.0
"""A smoke run on a shared CPU gets this many times a step's GPU time limit: the limits are
the GPU budget's, and a loaded 2-core CI machine runs even the tiny shapes slowly."""


def plan(*, smoke: bool, gpus: int) -> list[Step]:
    """The steps of one run, with time limits that keep a GPU run under 10 minutes."""
    steps = _steps(smoke=smoke, gpus=gpus)
    if smoke:
        steps = [dataclasses.replace(s, timeout_seconds=s.timeout_seconds * SMOKE_TIME_FACTOR) for s in steps]
    return steps


def _steps(*, smoke: bool, gpus: int) -> list[Step]:
    smoke_args = ("--smoke",) if smoke else ()
    steps = [
        Step("kernels", "gpu_kernels.py", smoke_args, "gpu_kernels.json", 240.0),
        Step("engine", "gpu_engine.py", (*smoke_args, "--batches", "1,64,256"), "gpu_engine.json", 150.0),
        Step(
            "engine_speculative",
            "gpu_engine.py",
            (*smoke_args, "--batches", "1,16,64", "--speculative", "ngram", "--num-speculative-tokens", "4"),
            "gpu_engine.json",
            120.0,
        ),
    ]
    if smoke or gpus >= 2:
        steps.append(
            Step(
                "engine_tp2", "gpu_engine.py", (*smoke_args, "--batches", "1,64", "--tp", "2"), "gpu_engine.json", 150.0
            )
        )
    if not smoke:
        steps.append(
            Step(
                "engine_cuda_graphs",
                "gpu_cuda_graphs.py",
                ("--batches", "1,64,256", "--new-tokens", "32"),
                "gpu_cuda_graphs.json",
                90.0,
            )
        )
    return steps


def run_step(step: Step, *, out: Path) -> dict[str, Any]:
    """Runs one step in ``out/<name>/`` (its ``$OUT``); its log goes to ``<name>.log``."""
    folder = out / step.name
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(BENCH / step.script), *step.args]
    record: dict[str, Any] = {
        "name": step.name,
        "command": " ".join(command[1:]),
        "timeout_seconds": step.timeout_seconds,
    }
    started = time.monotonic()
    with (folder / f"{step.name}.log").open("w") as log:
        try:
            proc = subprocess.run(
                command,
                env={**os.environ, "OUT": str(folder)},
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=step.timeout_seconds,
                check=False,
            )
            record["returncode"] = proc.returncode
        except subprocess.TimeoutExpired:
            record["returncode"] = None
            record["error"] = f"timed out after {step.timeout_seconds:.0f} s"
    record["seconds"] = round(time.monotonic() - started, 1)
    result_path = folder / step.json_name
    if result_path.is_file():
        record["result"] = json.loads(result_path.read_text())
    elif "error" not in record:
        record["error"] = f"no {step.json_name} written (see {folder / step.name}.log)"
    if record.get("returncode") not in (0, None) and "error" not in record:
        record["error"] = f"exit status {record['returncode']} (see {folder / step.name}.log)"
    return record


def _rows(result: Mapping[str, Any] | None, key: str) -> list[Mapping[str, Any]]:
    rows = (result or {}).get(key) or []
    return [r for r in rows if isinstance(r, Mapping)]


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The headline ratios of every step (None where a step did not measure them: smoke)."""
    by_name = {r["name"]: r.get("result") for r in records}
    kernels = by_name.get("kernels") or {}
    hbm = float(kernels.get("hbm_GBps_reference") or 0.0) or None
    summary: dict[str, Any] = {
        "decode_attention": [
            {
                "batch": r.get("batch"),
                "context": r.get("context"),
                "GBps": r.get("GBps"),
                "frac_of_copy_bandwidth": (r["GBps"] / hbm) if r.get("GBps") and hbm else None,
                "vs_torch_sdpa": (r["base_ms"] / r["ms"]) if r.get("ms") and r.get("base_ms") else None,
            }
            for r in _rows(kernels, "decode")
        ],
        "prefill_attention": [
            {
                "case": r.get("case"),
                "TFLOPs": r.get("TFLOPs"),
                "frac_of_peak": r.get("MFU"),
                "vs_torch_sdpa": r.get("vs_sdpa"),
            }
            for r in _rows(kernels, "prefill")
        ],
        "quantized_gemm": [
            {
                "case": r.get("case"),
                **{
                    f"{kind}_{what}": r.get(f"{kind}_{what}")
                    for kind in ("fp8", "int8", "w8a16", "w4a16")
                    for what in ("TFLOPs", "frac_peak", "vs_bf16")
                },
                "bf16_TFLOPs": r.get("bf16_TFLOPs"),
            }
            for r in _rows(kernels, "gemm")
        ],
        "correctness_failures": list(kernels.get("failures") or []),
    }
    for name in ("engine", "engine_tp2"):
        engine = by_name.get(name) or {}
        summary[f"{name}_decode"] = [
            {
                "batch": r.get("batch"),
                "tokens_per_s": r.get("tokens_per_s"),
                "wall_ms_per_step": r.get("wall_ms_per_step"),
                "wall_vs_roofline": r.get("wall_vs_roofline"),
            }
            for r in _rows(engine, "decode")
        ]
    speculative = by_name.get("engine_speculative") or {}
    summary["engine_speculative"] = speculative.get("speculative") or _rows(speculative, "decode")
    graphs = by_name.get("engine_cuda_graphs") or {}
    summary["engine_cuda_graphs_decode"] = [
        {
            key: r.get(key)
            for key in (
                "batch",
                "eager_tokens_per_s",
                "graphs_tokens_per_s",
                "speedup",
                "logits_max_abs_diff_rel",
                "argmax_agreement",
            )
        }
        for r in _rows(graphs, "decode")
    ]
    return summary


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "./out")))
    parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
    args = parser.parse_args(argv)
    gpus = _gpu_count()
    if not args.smoke and gpus == 0:
        print("gpu_all: no CUDA device visible; use --smoke to check the script on a CPU", file=sys.stderr)
        return 2
    steps = plan(smoke=args.smoke, gpus=gpus)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in steps}
        if unknown:
            print(f"gpu_all: unknown step(s) {sorted(unknown)}; steps: {[s.name for s in steps]}", file=sys.stderr)
            return 2
        steps = [s for s in steps if s.name in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    records = []
    for step in steps:
        print(
            f"[gpu_all] {step.name}: {step.script} {' '.join(step.args)} (limit {step.timeout_seconds:.0f} s)",
            flush=True,
        )
        record = run_step(step, out=args.out)
        records.append(record)
        print(f"[gpu_all] {step.name}: {record.get('error') or 'ok'} in {record['seconds']} s", flush=True)
    report = {
        "smoke": args.smoke,
        "gpus": gpus,
        "seconds": round(time.monotonic() - started, 1),
        "failed": [r["name"] for r in records if "error" in r],
        "summary": summarize(records),
        "steps": records,
    }
    path = args.out / "gpu_all.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(
        json.dumps(
            {"summary": report["summary"], "failed": report["failed"], "seconds": report["seconds"]},
            indent=1,
            default=str,
        )
    )
    print(f"[gpu_all] wrote {path}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
