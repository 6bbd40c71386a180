"""`splitserve serve --tensor-parallel-size 2` (and `--pipeline-parallel-size 2`) as a process:
it serves the OpenAI API with the single-process model's greedy answers, and a killed worker
rank takes the server down at once with a non-zero status and a termination message (no hang
behind a collective that can never complete; the kubelet restarts the pod and the router
stops sending to it)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import MODEL_NAME, serve_args, spawn_server, start_server, wait_until

from splitserve_e2e.net import free_port
from splitserve_runtime.engine.parallel.launcher import WORKER_EXIT_STATUS
from splitserve_runtime.termination import TERMINATION_LOG_ENV

PROMPTS = ["Once upon a time", "The quick brown fox", "In a land far away there"]


LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


class _Server:
    def __init__(self, model_dir: Path, termination_log: Path, layout: dict[str, int]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        termination_log.write_text("")
        self.proc = spawn_server(
            args=serve_args(model_dir=model_dir, port=self.port, **layout),
            env={TERMINATION_LOG_ENV: str(termination_log)},
        )

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(self.proc.stdout.read() if self.proc.stdout else "server exited")
        try:
            return httpx.get(f"{self.base}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def workers(self) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]


@pytest.fixture(params=list(LAYOUTS))
def server(tiny_llama_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[_Server]:
    running = _Server(tiny_llama_dir, tmp_path / "termination-log", LAYOUTS[request.param])
    try:
        wait_until(running.ready, timeout_s=120, what="the tensor-parallel server to become ready")
        yield running
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
        running.proc.wait(10)
        if running.proc.stdout is not None:
            running.proc.stdout.close()


def _answers(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    return [
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for prompt in PROMPTS
    ]


def test_serves_the_single_process_answers(server: _Server, tiny_llama_dir: Path) -> None:
    assert len(server.workers()) == 1
    with start_server(args=serve_args(model_dir=tiny_llama_dir)) as single:
        expected = _answers(single.base_url)
    assert _answers(server.base) == expected
    assert len(set(expected)) > 1


def test_killed_worker_stops_the_server(server: _Server, tmp_path: Path) -> None:
    (worker,) = server.workers()
    subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(worker)], check=True)
    started = time.monotonic()
    code = server.proc.wait(timeout=15)
    assert code == WORKER_EXIT_STATUS
    assert time.monotonic() - started < 5
    message = (tmp_path / "termination-log").read_text()
    assert "parallel worker rank 1 exited" in message
