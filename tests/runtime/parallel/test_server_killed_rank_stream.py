"""A tensor-parallel server whose worker rank is killed (SIGKILL) while requests are in flight
ends every one of them in the OpenAI error shape before the process exits: a stream with the
``engine_dead`` error event and then ``data: [DONE]`` (the body complete, not a cut
connection), a non-streamed request with a 5xx JSON error; the process still exits with the
worker-death status and its termination message.

The defect this pins: a dead rank ended the process with ``os._exit`` the moment the supervisor
(or a failed collective) noticed, so whether a stream got its error event depended on which
thread won the race: the engine thread's failed collective (the streams get their error) or
the supervisor's poll (``os._exit`` at once: cut connections). On an idle machine the engine
nearly always wins; on a loaded node, where the server is off the CPU when the rank dies and
all its threads then find the death at once, the supervisor does. The test makes that happen
(SIGSTOP the server, SIGKILL the rank, SIGCONT), since the defect is a race. A real
``splitserve serve --tensor-parallel-size 2`` process on CPU (gloo), the tiny checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL_NAME, serve_args, start_server, wait_until

from splitserve_contract import Metric, serve_argv
from splitserve_e2e.net import free_port
from splitserve_runtime.engine.parallel import exit_hooks
from splitserve_runtime.engine.parallel.launcher import WORKER_EXIT_STATUS
from splitserve_runtime.termination import TERMINATION_LOG_ENV

ROUNDS = 3
"""One plain kill, then kills while the server is descheduled (a real process per round is slow)."""
DESCHEDULED_SECONDS = 0.5
MAX_TOKENS = 400
"""Long enough that every request is still decoding when the worker dies."""
NUM_STREAMS = 3


@dataclass
class _Stream:
    events: list[str] = field(default_factory=list)
    error: str | None = None
    """How the stream failed to complete (an httpx exception: a cut connection)."""

    def problem(self) -> str | None:
        data = [e for e in self.events if e.startswith("data: ")]
        if self.error is not None:
            return f"stream cut: {self.error} after {data[-2:]}"
        if data[-1:] != ["data: [DONE]"] or len(data) < 2:
            return f"stream did not end with [DONE]: {data[-3:]}"
        last = json.loads(data[-2].removeprefix("data: "))
        if last.get("error", {}).get("code") != "engine_dead":
            return f"stream's last event is not the engine_dead error: {data[-2]}"
        return None


@dataclass
class _Round:
    streams: list[_Stream] = field(default_factory=list)
    whole_status: int | None = None
    whole_body: str = ""
    whole_error: str | None = None
    exit_code: int | None = None
    termination: str = ""
    log: str = ""

    def problems(self) -> list[str]:
        found = [problem for stream in self.streams if (problem := stream.problem()) is not None]
        if self.whole_error is not None:
            found.append(f"non-streamed request cut: {self.whole_error}")
        elif self.whole_status is None or not 500 <= self.whole_status < 600:
            found.append(f"non-streamed request answered {self.whole_status}: {self.whole_body[:300]}")
        else:
            code = json.loads(self.whole_body).get("error", {}).get("code")
            if code != "engine_dead":
                found.append(f"non-streamed error code {code!r}: {self.whole_body[:300]}")
        if self.exit_code != WORKER_EXIT_STATUS:
            found.append(f"exit status {self.exit_code}, not {WORKER_EXIT_STATUS}")
        if "parallel worker rank 1 exited" not in self.termination:
            found.append(f"termination message {self.termination!r}")
        return found


def _running(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(Metric.REQUESTS_RUNNING + " ") or line.startswith(Metric.REQUESTS_RUNNING + "{")
    )


def _one_round(model_dir: Path, tmp_path: Path, index: int, *, descheduled: bool) -> _Round:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    termination_log = tmp_path / f"termination-{index}"
    termination_log.write_text("")
    log_path = tmp_path / f"server-{index}.log"
    args = serve_args(model_dir=model_dir, port=port, tensor_parallel_size=2, num_kv_blocks=128, max_model_len=512)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve_cli", "serve", *serve_argv(args)],
            env={**os.environ, TERMINATION_LOG_ENV: str(termination_log)},
            text=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    result = _Round()
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(log_path.read_text()[-3000:])
            try:
                return httpx.get(f"{base}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s=120, what="the tensor-parallel server to become ready")
        found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        (worker,) = (int(pid) for pid in found.stdout.split())
        body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

        def whole() -> None:
            try:
                answer = httpx.post(
                    f"{base}/v1/completions",
                    timeout=60,
                    json={**body, "prompt": "The quick brown fox", "stream": False},
                )
                result.whole_status, result.whole_body = answer.status_code, answer.text
            except httpx.HTTPError as exc:
                result.whole_error = repr(exc)

        started = threading.Barrier(NUM_STREAMS + 1)
        killed = threading.Event()

        def stream(index: int) -> None:
            got = _Stream()
            result.streams.append(got)
            try:
                with (
                    httpx.Client(timeout=60) as client,
                    client.stream(
                        "POST",
                        f"{base}/v1/completions",
                        json={**body, "prompt": f"Once upon a time ({index})", "stream": True},
                    ) as answer,
                ):
                    for line in answer.iter_lines():
                        if not line:
                            continue
                        got.events.append(line)
                        if len(got.events) == 3:  # in flight: its first tokens have arrived
                            started.wait(60)
            except httpx.HTTPError as exc:
                got.error = repr(exc)
            finally:
                if len(got.events) < 3 and not killed.is_set():
                    started.abort()

        threads = [threading.Thread(target=whole, daemon=True)]
        threads += [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        started.wait(60)
        wait_until(lambda: _running(base) >= NUM_STREAMS + 1, timeout_s=30, what="every request running")
        if descheduled:  # the server is off the CPU when the rank dies, as on a loaded node:
            os.kill(proc.pid, signal.SIGSTOP)  # every thread of it finds the death at once
            os.kill(worker, signal.SIGKILL)
            time.sleep(DESCHEDULED_SECONDS)
            os.kill(proc.pid, signal.SIGCONT)
        else:
            os.kill(worker, signal.SIGKILL)
        killed.set()
        for thread in threads:
            thread.join(60)
        result.exit_code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    result.termination = termination_log.read_text()
    result.log = log_path.read_text()
    return result


def test_killed_worker_ends_every_request_in_the_error_shape(tiny_llama_dir: Path, tmp_path: Path) -> None:
    rounds = [_one_round(tiny_llama_dir, tmp_path, index, descheduled=index > 0) for index in range(ROUNDS)]
    failed = {index: r.problems() for index, r in enumerate(rounds) if r.problems()}
    for index, r in enumerate(rounds):  # which path ended the process, for the report
        print(index, [line[24:200] for line in r.log.splitlines() if " ERROR " in line or " CRITICAL " in line])
    print(f"{len(failed)} of {ROUNDS} rounds failed: {failed}")
    assert not failed, (failed, rounds[min(failed)].log[-3000:])


def test_exit_hooks_fail_the_streams_and_hold_the_exit_until_they_are_sent(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hooks a broken group runs before ``os._exit``, in one process with a real engine and
    server: they fail the engine (a group may break where the engine never sees an exception: a
    control message to a dead rank) and return only once the requests in flight have ended: the
    stream with the engine_dead error event then [DONE], the other with a 503 JSON error."""
    monkeypatch.setattr(exit_hooks, "_started", threading.Event())  # this process goes on
    with start_server(args=serve_args(model_dir=tiny_llama_dir, num_kv_blocks=64)) as server:
        events: list[str] = []
        in_flight = threading.Event()

        def stream() -> None:
            with (
                httpx.Client(timeout=60) as client,
                client.stream(
                    "POST",
                    f"{server.base_url}/v1/completions",
                    json={
                        "model": MODEL_NAME,
                        "prompt": "Once upon a time",
                        "max_tokens": 400,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ) as answer,
            ):
                for line in answer.iter_lines():
                    if line:
                        events.append(line)
                        in_flight.set()

        whole: list[httpx.Response] = []

        def post() -> None:
            whole.append(
                httpx.post(
                    f"{server.base_url}/v1/completions",
                    timeout=60,
                    json={
                        "model": MODEL_NAME,
                        "prompt": "The quick brown fox",
                        "max_tokens": 400,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
            )

        readers = [threading.Thread(target=stream, daemon=True), threading.Thread(target=post, daemon=True)]
        for reader in readers:
            reader.start()
        assert in_flight.wait(60)
        wait_until(lambda: server.state.num_in_flight == 2, timeout_s=30, what="both requests in flight")
        exit_hooks.run("parallel worker rank 1 exited with status -9")
        assert exit_hooks.started()
        assert server.state.num_in_flight == 0  # the hooks returned once both requests had ended
        for reader in readers:
            reader.join(10)
        assert server.engine is not None and not server.engine.is_healthy
    assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "engine_dead", whole[0].text
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_dead", events[-3:]
