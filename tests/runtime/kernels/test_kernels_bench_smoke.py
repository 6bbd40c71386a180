"""``bench/gpu_kernels.py --smoke`` keeps working (tiny shapes, correctness only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "gpu_kernels.py"


def test_gpu_bench_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke"], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert result["smoke"] is True and result["failures"] == []
    checks = {c["check"] for c in result["correctness"]}
    assert {"mixed_step.decode", "mixed_step.prefill", "elementwise.rms_norm"} <= checks
    assert len(result["decode"]) == 4 and len(result["prefill"]) == 3
    # quantized GEMMs: every kind checked against quant/reference.py at each smoke shape
    assert {f"gemm.{kind}.m{m}.n96" for kind in ("fp8", "fp8_gemm", "int8", "w8a16", "w4a16")
            for m in (1, 7, 80)} <= checks
    assert len(result["gemm"]) == 3 and all("error" not in r for r in result["gemm"])
    assert all(c["ok"] for c in result["correctness"])
