"""bench/router_overhead.py in its quickest mode: the report has every path, phase and figure,
no request failed, and a stream passes through the router event by event.

Figures are not asserted (this machine is shared; the bench prints them). The one timing-based
check has a wide margin: the stand-in pod sends 8 events 25 ms apart, and the first one must
reach the client before half the stream's time has passed, where a proxy that re-buffered the
stream would hand it over only with the last. Without nginx the nginx path must be reported as
not installed and left out of the phases.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "router_overhead.py"
OPEN_STREAMS = 5


def _bench_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("router_overhead", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", "--rates", "50", "--open-streams", str(OPEN_STREAMS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def _expected_paths(report: dict[str, Any]) -> list[str]:
    nginx = report["nginx"] != "not installed"
    return ["direct", *(["nginx"] if nginx else []), "router"]


def test_every_phase_measures_every_path_without_errors(report: dict[str, Any]) -> None:
    assert list(report["upstreams"]) == ["stand-in"]  # --quick: the stand-in pod only
    phases = report["upstreams"]["stand-in"]["phases"]
    assert [(p["rate"], p["stream"], p["open_streams"]) for p in phases] == [
        (50, False, 0),
        (50, True, 0),
        (50, False, OPEN_STREAMS),
    ]
    for phase in phases:
        paths = phase["paths"]
        assert list(paths) == _expected_paths(report)
        for name, row in paths.items():
            assert row["errors"] == 0, (name, phase, row["error_kinds"])
            assert row["requests"] == 50  # 1 s at 50 requests/s
            assert row["p50_ms"] <= row["p99_ms"]
            assert isinstance(row["added_p50_ms"], float)
            if phase["stream"]:
                assert row["first_event_p50_ms"] <= row["first_event_p99_ms"]
            if phase["open_streams"]:
                assert row["open_streams"] == OPEN_STREAMS  # none dropped during the phase
            if name == "direct":
                assert row["cpu_ms_per_request"] is None and row["added_p50_ms"] == 0
            else:  # a proxy process's CPU was read from /proc
                assert row["cpu_ms_per_request"] >= 0


def test_streams_pass_through_every_path_event_by_event(report: dict[str, Any]) -> None:
    checks = report["upstreams"]["stand-in"]["pass_through"]
    assert list(checks) == _expected_paths(report)
    for name, check in checks.items():
        assert check["events_per_stream"] == 9, name  # 8 events and [DONE]
        assert check["incremental"], (name, check)


def test_the_table_shows_each_path_and_the_nginx_state(report: dict[str, Any]) -> None:
    table: str = _bench_module().format_report(report)
    assert f"nginx: {report['nginx']}" in table
    for name in _expected_paths(report):
        assert f" {name} " in table
    assert "pass-through router" in table
