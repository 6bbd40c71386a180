"""`splitserve serve --tensor-parallel-size 2` with a wedged worker rank: within
``--engine-step-timeout-seconds`` ``/health`` stops answering 200 (503, and the server then
exits non-zero on its own, as on any engine failure, so the kubelet restarts the pod either
way), the request in flight ends with an ``engine_dead`` error instead of hanging, and the log
says which step stalled for how long.

The defect this pins: a worker rank stopped with SIGSTOP (as a stuck driver call would leave
it) kept ``/health`` and ``/ready`` at 200 while every request stalled for gloo's 10-minute
collective timeout. A real process on CPU (gloo), the tiny checkpoint, a 3-second bound.
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

import httpx
import pytest
from server_harness import MODEL_NAME, serve_args, wait_until

from splitserve_contract import serve_argv
from splitserve_e2e.net import free_port

STEP_TIMEOUT_S = 3.0
SLACK_S = 10.0


class _Server:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = serve_args(
            model_dir=model_dir,
            port=self.port,
            tensor_parallel_size=2,
            num_kv_blocks=32,
            engine_step_timeout_seconds=STEP_TIMEOUT_S,
        )
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve_cli", "serve", *serve_argv(args)],
                env=dict(os.environ),
                text=True,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log_path.read_text()

    def status(self, path: str) -> int:
        try:
            return httpx.get(f"{self.base}{path}", timeout=1).status_code
        except httpx.HTTPError:
            return 0

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(self.output() or "server exited")
        return self.status("/ready") == 200

    def workers(self) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]


@pytest.fixture
def server(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[_Server]:
    running = _Server(tiny_llama_dir, tmp_path / "server.log")
    workers: list[int] = []
    try:
        wait_until(running.ready, timeout_s=120, what="the tensor-parallel server to become ready")
        workers = running.workers()
        yield running
    finally:
        for pid in workers:  # a stopped worker must not outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        running.proc.kill()
        running.proc.wait(10)


def test_stopped_worker_rank_fails_health_and_the_request(server: _Server) -> None:
    (worker,) = server.workers()
    assert server.status("/health") == 200
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    health_503_after: float | None = None
    with (
        httpx.Client(timeout=httpx.Timeout(STEP_TIMEOUT_S + SLACK_S)) as client,
        client.stream("POST", f"{server.base}/v1/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        lines = answer.iter_lines()
        for line in lines:  # the request is in flight: its first token has streamed
            if line.startswith("data: {"):
                events.append(line)
                break
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()
        deadline = stopped_at + STEP_TIMEOUT_S + SLACK_S
        while health_503_after is None and time.monotonic() < deadline:
            # 503, or nothing once the server has exited (it does so at its next tick)
            if server.status("/health") in (503, 0):
                health_503_after = time.monotonic() - stopped_at
            else:
                time.sleep(0.05)
        assert health_503_after is not None, (
            "/health stayed 200 with a stopped rank",
            events[-2:],
            server.output()[-3000:],
        )
        for line in lines:  # the rest of the stream: an error event, not a hang
            if line.startswith("data: "):
                events.append(line)
        ended_after = time.monotonic() - stopped_at
    print(f"/health 503 after {health_503_after:.1f} s, stream ended after {ended_after:.1f} s")
    assert health_503_after <= STEP_TIMEOUT_S + SLACK_S
    assert ended_after <= STEP_TIMEOUT_S + SLACK_S
    payloads = [json.loads(e[len("data: ") :]) for e in events if e != "data: [DONE]"]
    errors = [p["error"] for p in payloads if "error" in p]
    assert errors and errors[-1]["code"] == "engine_dead", events[-3:]
    assert server.status("/health") != 200 and server.status("/ready") != 200
    assert server.proc.wait(30) != 0  # the unhealthy engine takes the process down
    wedged = [line for line in server.output().splitlines() if " ERROR " in line and "wedged" in line]
    assert len(wedged) == 1, server.output()[-3000:]
    assert "ranks 0-1" in wedged[0] and "--engine-step-timeout-seconds" in wedged[0]
