"""``bench/gpu_cuda_graphs.py`` (decode with CUDA graphs vs eager) keeps working: its
``--smoke`` runs the whole comparison on the CPU through the eager-replay backend, and
``bench/gpu_all.py`` runs it on a GPU only and puts its rows in the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import BENCH_DIR, load_bench


def test_the_graphs_bench_smoke_compares_eager_and_replayed_decode(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "gpu_cuda_graphs.py"),
            "--smoke",
            "--batches",
            "1,3",
            "--new-tokens",
            "4",
        ],
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_cuda_graphs.json").read_text())
    assert report["smoke"] is True and report["backend"] == "EagerReplay"
    assert report["buckets"] == [1, 2, 4]
    rows = report["decode"]
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        assert row["eager_tokens_per_s"] > 0 and row["graphs_tokens_per_s"] > 0
        assert row["argmax_agreement"] == 1.0 and row["logits_max_abs_diff_rel"] < 1e-5


def test_gpu_all_runs_the_graphs_comparison_on_a_gpu_only_and_summarizes_it() -> None:
    gpu_all = load_bench("gpu_all")
    assert "engine_cuda_graphs" in [s.name for s in gpu_all.plan(smoke=False, gpus=1)]
    assert "engine_cuda_graphs" not in [s.name for s in gpu_all.plan(smoke=True, gpus=0)]
    row = {
        "batch": 64,
        "eager_tokens_per_s": 1000.0,
        "graphs_tokens_per_s": 1500.0,
        "speedup": 1.5,
        "logits_max_abs_diff_rel": 1e-3,
        "argmax_agreement": 1.0,
        "eager_wall_ms_per_step": 64.0,
    }
    summary = gpu_all.summarize([{"name": "engine_cuda_graphs", "result": {"decode": [row]}}])
    assert summary["engine_cuda_graphs_decode"] == [
        {
            k: row[k]
            for k in (
                "batch",
                "eager_tokens_per_s",
                "graphs_tokens_per_s",
                "speedup",
                "logits_max_abs_diff_rel",
                "argmax_agreement",
            )
        }
    ]
    assert gpu_all.summarize([])["engine_cuda_graphs_decode"] == []
