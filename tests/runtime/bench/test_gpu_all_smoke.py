"""``bench/gpu_all.sh --smoke`` keeps working: every GPU benchmark's script runs on the CPU
at tiny shapes (the kernels interpreted, TP 2 as gloo ranks) and lands in one summary."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_all.sh"


def test_gpu_all_smoke_runs_every_step_and_writes_one_summary(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([str(SCRIPT), "--smoke"], env=env, capture_output=True, text=True, timeout=3000, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_all.json").read_text())
    assert report["smoke"] is True and report["failed"] == []
    assert [s["name"] for s in report["steps"]] == ["kernels", "engine", "engine_speculative", "engine_tp2"]
    assert all(s["returncode"] == 0 for s in report["steps"])

    kernels = report["steps"][0]["result"]
    assert kernels["smoke"] is True and kernels["failures"] == []
    checks = {c["check"] for c in kernels["correctness"]}
    assert {"mixed_step.decode", "mixed_step.prefill", "elementwise.rms_norm"} <= checks
    # quantized GEMMs: every kind checked against quant/reference.py at each smoke shape
    assert {
        f"gemm.{kind}.m{m}.n96" for kind in ("fp8", "fp8_gemm", "int8", "w8a16", "w4a16") for m in (1, 7, 80)
    } <= checks
    assert all(c["ok"] for c in kernels["correctness"])

    summary = report["summary"]
    assert len(summary["decode_attention"]) == 4 and len(summary["prefill_attention"]) == 3
    assert len(summary["quantized_gemm"]) == 3
    assert [r["batch"] for r in summary["engine_decode"]] == [1, 64, 256]
    assert [r["batch"] for r in summary["engine_tp2_decode"]] == [1, 64]
    assert all(r["tokens_per_s"] > 0 for r in summary["engine_decode"] + summary["engine_tp2_decode"])
    assert report["steps"][3]["result"]["tp"] == 2
    assert summary["engine_speculative"], "the speculative step reported nothing"


def test_gpu_all_refuses_a_run_without_a_gpu_unless_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "--smoke" in proc.stderr
    assert not (tmp_path / "gpu_all.json").exists()
