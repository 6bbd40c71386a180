"""bench/sampler.py on a small batch: every case runs and is reported next to the argmax line,
and each case's mix is what its name says. Figures are not asserted (the machine is shared)."""

from __future__ import annotations

import subprocess
import sys

from helpers import BENCH_DIR, load_bench

BENCH = BENCH_DIR / "sampler.py"


def test_bench_reports_every_case() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--seqs", "8", "--vocab", "600", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    names = ["torch.argmax", *load_bench("sampler").cases(8)]
    lines = done.stdout.splitlines()
    for name in names:
        row = next(line for line in lines if line.strip().startswith(name))
        assert len(row[len(name) + 4 :].split()) == 6, row  # median, min, x argmax for null and lm


def test_case_mixes() -> None:
    cases = load_bench("sampler").cases(8)
    assert all(p.is_greedy for p in cases["greedy"])
    assert [p.is_greedy for p in cases["mixed 50/50"]] == [True, False] * 4
    assert sum(p.seed is not None for p in cases["mixed, 1/4 seeded"]) == 2
    assert all(p.logprobs == 5 for p in cases["mixed 50/50 + logprobs 5"])
    assert all(p.top_k == 50 and p.top_p == 1.0 for p in cases["top-k 50"])
