"""`splitserve` as a process: the console command, and SIGTERM drain of `splitserve serve`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL_NAME, serve_args, spawn_server, wait_until

import splitserve_cli as cli
from splitserve_contract import SERVE_FLAGS
from splitserve_e2e.net import free_port

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _NoTorch())
from splitserve_cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run_cli_without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH, *argv], capture_output=True, text=True, timeout=60)


def test_help_works_without_torch() -> None:
    result = _run_cli_without_torch("--help")
    assert result.returncode == 0, result.stderr
    for name in ("serve", "router", "operator", "make-tiny-model", "plan", "version"):
        assert name in result.stdout


def test_serve_help_lists_every_contract_flag_without_torch() -> None:
    result = _run_cli_without_torch("serve", "--help")
    assert result.returncode == 0, result.stderr
    for flag in SERVE_FLAGS:
        assert f"--{flag.name}" in result.stdout, flag.name


def test_version_and_unknown_command() -> None:
    version = _run_cli_without_torch("version")
    assert version.returncode == 0 and version.stdout.startswith("splitserve ")
    unknown = _run_cli_without_torch("frobnicate")
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr


def test_missing_subcommand_module_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "plan", cli.Subcommand("splitserve_operator.no_such_module", "x", "operator"))
    assert cli.main(["plan", "--help"]) == 2
    assert "not available in this install" in capsys.readouterr().err


def test_missing_dependency_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "splitserve_runtime.model.tiny", raising=False)
    assert cli.main(["make-tiny-model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "not available in this install" in err and "torch" in err


def test_serve_without_model_is_a_usage_error() -> None:
    result = _run_cli_without_torch("serve")
    assert result.returncode == 2 and "--model is required" in result.stderr


# ----------------------------------------------------------------------------- SIGTERM


class _Serving:
    """`splitserve serve` in a subprocess, waited on until /ready says yes."""

    def __init__(self, *, model_dir: Path, drain_timeout_seconds: float, **overrides: object) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.proc = spawn_server(
            args=serve_args(model_dir=model_dir, port=port, drain_timeout_seconds=drain_timeout_seconds, **overrides)
        )
        self.alive_while_loading: list[bool] = []

    def _ready(self) -> bool:
        try:
            if httpx.get(f"{self.base}/ready", timeout=1).status_code == 200:
                return True
            health = httpx.get(f"{self.base}/health", timeout=1).status_code
            self.alive_while_loading.append(health == 200)
        except httpx.ConnectError:  # not listening yet
            return self.proc.poll() is not None
        except httpx.TimeoutException:  # listening but not answering: a blocked loop
            self.alive_while_loading.append(False)
        return False

    def __enter__(self) -> _Serving:
        wait_until(self._ready, timeout_s=90, what="the subprocess server to become ready")
        assert self.proc.poll() is None, self.proc.stdout.read() if self.proc.stdout else ""
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class _Stream(threading.Thread):
    """One streamed completion on its own thread; collects the SSE data payloads."""

    def __init__(self, *, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.max_tokens = max_tokens
        self.events: list[str] = []
        self.first_chunk = threading.Event()

    def run(self) -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": "a long answer",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with (
                httpx.Client(timeout=60) as http,
                http.stream("POST", f"{self.base}/v1/completions", json=body) as resp,
            ):
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.first_chunk.set()
        except httpx.HTTPError:
            pass  # the server cut the stream (drain timeout)

    def text(self) -> str:
        chunks = [json.loads(e) for e in self.events if e != "[DONE]"]
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_llama_dir: Path) -> None:
    grace_s = 20.0
    # num_kv_blocks: the 300-token stream must fit the whole KV cache
    with _Serving(model_dir=tiny_llama_dir, drain_timeout_seconds=grace_s, num_kv_blocks=32) as srv:
        # the listener is up before the model: /health said yes while /ready said no (one
        # probe may time out: importing torch's shared libraries holds the GIL for a moment)
        assert srv.alive_while_loading.count(True) >= 1
        assert srv.alive_while_loading.count(False) <= 2, srv.alive_while_loading

        stream = _Stream(base=srv.base, max_tokens=300)
        stream.start()
        assert stream.first_chunk.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(
            lambda: httpx.get(f"{srv.base}/ready", timeout=1).status_code == 503,
            timeout_s=1.0,
            what="/ready to turn 503 after SIGTERM",
        )
        not_ready_after_s = time.monotonic() - signalled
        assert httpx.get(f"{srv.base}/health", timeout=5).status_code == 200
        refused = httpx.post(
            f"{srv.base}/v1/completions", timeout=5, json={"model": MODEL_NAME, "prompt": "new", "max_tokens": 2}
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert "retry-after" in refused.headers
        assert stream.is_alive(), "the in-flight stream should still be running"

        stream.join(grace_s)
        assert not stream.is_alive()
        assert stream.events[-1] == "[DONE]"
        last = json.loads(stream.events[-2])
        assert last["choices"][0]["finish_reason"] == "length"
        assert stream.text()

        assert srv.proc.wait(timeout=grace_s) == 0
        exited_after_s = time.monotonic() - signalled
        assert exited_after_s < grace_s
        print(f"SIGTERM: not ready after {not_ready_after_s:.3f} s, exited 0 after {exited_after_s:.2f} s")


@pytest.mark.slow
def test_drain_timeout_aborts_long_requests_and_still_exits_0(tiny_llama_dir: Path) -> None:
    grace_s = 1.0
    with _Serving(
        model_dir=tiny_llama_dir, drain_timeout_seconds=grace_s, max_model_len=2048, num_kv_blocks=130
    ) as srv:
        stream = _Stream(base=srv.base, max_tokens=2000)  # far longer than the grace
        stream.start()
        assert stream.first_chunk.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert srv.proc.wait(timeout=15) == 0
        exited_after_s = time.monotonic() - signalled
        stream.join(10)
        payloads = [json.loads(e) for e in stream.events if e != "[DONE]"]
        finishes = [p["choices"][0]["finish_reason"] for p in payloads if p.get("choices")]
        assert "length" not in finishes  # the request did not run to completion ...
        errors = [p["error"] for p in payloads if "error" in p]
        # ... and the stream says so in an error event rather than being cut mid-body
        assert [e["code"] for e in errors] == ["aborted"]
        assert stream.events[-1] == "[DONE]"
        assert grace_s <= exited_after_s < grace_s + 5
        print(f"drain timeout {grace_s} s: exited 0 after {exited_after_s:.2f} s")
