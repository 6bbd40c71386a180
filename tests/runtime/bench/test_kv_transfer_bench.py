"""bench/kv_transfer.py on tiny shapes: every shape gets a row with each leg's GB/s, both
sides' CPU time and the ratios to the raw copy (a tensor-parallel decode rank's half-block pull
and the checksum-free bound included), and the legs can be chosen (for before/after runs
against an older connector). Figures are not asserted (the machine is shared)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "kv_transfer.py"


def _run(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--repeat", "1", *args], capture_output=True, text=True, timeout=300, check=True
    )
    return done.stdout.splitlines()


def _rows(lines: list[str]) -> dict[tuple[str, str], list[float]]:
    """(shape, leg) -> GB/s, x raw, decode CPU ms, x raw, prefill CPU ms, x raw; a shape is
    named on its first leg's row."""
    rows: dict[tuple[str, str], list[float]] = {}
    shape = ""
    for line in lines[2:]:
        if line[:16].strip():
            shape = line[:16].strip()
        leg, *figures = line[16:].split()
        rows[shape, leg] = [float("nan") if value == "-" else float(value) for value in figures]
    return rows


def test_bench_reports_every_shape_and_leg_with_its_ratio() -> None:
    lines = _run("--shape", "4x65536", "--shape", "32x131072")
    assert lines[0].startswith("KV transfer on loopback, CRC-32 by zlib")
    rows = _rows(lines)
    assert set(rows) == {
        (shape, leg)
        for shape in ("4 x 64 KiB", "32 x 128 KiB")
        for leg in ("destination", "copy", "raw", "half", "no-crc")
    }
    for (_shape, leg), figures in rows.items():
        assert len(figures) == 6 and figures[2] > 0 and figures[4] >= 0, figures
        if leg == "raw":
            # the prefill side's CPU of a tiny pull may read 0 (then no ratio: "-")
            assert figures[1] == figures[3] == 1.0 and (figures[5] == 1.0 or math.isnan(figures[5])), figures


def test_bench_runs_only_the_legs_asked_for() -> None:
    rows = _rows(_run("--shape", "4x65536", "--legs", "copy"))
    assert list(rows) == [("4 x 64 KiB", "copy")]
    assert len(rows["4 x 64 KiB", "copy"]) == 6  # no raw leg: no ratios ("-")


def test_the_checksum_free_bound_moves_the_same_blocks() -> None:
    """The ``no-crc`` leg runs its own prefill process (and the decode side's checksum is
    replaced for that leg only), so the ``destination`` leg after it (the second round) still
    checks real CRCs: a decode side left without them would refuse every block and end the run."""
    rows = _rows(_run("--shape", "4x65536", "--legs", "no-crc,destination,raw"))
    assert set(rows) == {("4 x 64 KiB", leg) for leg in ("destination", "raw", "no-crc")}
    assert all(figures[0] > 0 for figures in rows.values())
