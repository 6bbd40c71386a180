"""`python -m splitserve_e2e up|status|down` and the no-orphan guarantee.

A cluster in its own state directory is brought up detached, checked, and taken down; then
brought up again and its daemon SIGKILLed: every process it had started must be gone, because
the children die with their parent (parent-death signal), and ``down`` must clean the rest.
Without the kubelet node (``--no-kubelet-node``): only one may run per machine, and the
session's cluster holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve_e2e.process import is_alive, wait_until

pytestmark = pytest.mark.e2e


def _cli(state_dir: Path, *args: str, timeout_seconds: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "splitserve_e2e", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        env=env,
        check=False,
    )


def _recorded_pids(state_dir: Path) -> dict[str, int]:
    return {path.stem: int(json.loads(path.read_text())["pid"]) for path in (state_dir / "pids").glob("*.pid")}


def _wait_dead(pids: dict[str, int], *, timeout_seconds: float) -> list[str]:
    """Wait (bounded) until none of ``pids`` is alive; returns the names still alive."""

    def alive() -> list[str]:
        return [name for name, pid in pids.items() if is_alive(pid)]

    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not alive(), timeout_seconds=timeout_seconds, what="recorded processes gone")
    return alive()


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The cluster's state directory; ``down`` afterwards whatever the test did, so a failed
    assertion leaves no etcd or API server running (``down`` of a stopped cluster says so)."""
    path = tmp_path / "cluster"
    yield path
    _cli(path, "down")


def test_up_status_down_and_killed_daemon_leave_no_process(state_dir: Path) -> None:
    up = _cli(state_dir, "up", "--num-gpu-nodes=1", "--no-prometheus", "--no-kubelet-node")
    assert up.returncode == 0, up.stderr + up.stdout
    assert f"export KUBECONFIG={state_dir / 'admin.kubeconfig'}" in up.stdout
    status = _cli(state_dir, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "kwok-gpu-0" in status.stdout
    pids = _recorded_pids(state_dir)
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"} <= set(pids)

    down = _cli(state_dir, "down")
    assert down.returncode == 0, down.stderr
    assert _wait_dead(pids, timeout_seconds=10) == []
    assert _cli(state_dir, "status").returncode != 0

    started = time.monotonic()
    again = _cli(state_dir, "up", "--num-gpu-nodes=1", "--no-prometheus", "--no-kubelet-node")
    assert again.returncode == 0, again.stderr + again.stdout
    print(f"warm `up` took {time.monotonic() - started:.1f}s")
    pids = _recorded_pids(state_dir)
    daemon = int(json.loads((state_dir / "daemon" / "daemon.pid").read_text())["pid"])
    os.kill(daemon, signal.SIGKILL)  # no cleanup code runs in the daemon
    assert _wait_dead(pids, timeout_seconds=15) == []
    assert "nothing was running" in _cli(state_dir, "down").stdout
