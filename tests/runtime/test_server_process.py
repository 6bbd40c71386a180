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
from server_harness import MODEL_NAME, free_port, serve_args, spawn_server, wait_until
from splitserve_runtime import cli
from splitserve_runtime.contract import SERVE_FLAGS

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _NoTorch())
from splitserve_runtime.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run_cli_without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH, *argv], capture_output=True,
                          text=True, timeout=60)


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


def test_missing_subcommand_module_exits_2(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "plan",
                        cli.Subcommand("splitserve_operator.no_such_module", "x", "operator"))
    assert cli.main(["plan", "--help"]) == 2
    assert "not available in this install" in capsys.readouterr().err


def test_missing_dependency_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "splitserve_runtime.model.tiny", raising=False)
    assert cli.main(["make-tiny-model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "not available in this install" in err and "torch" in err


def test_serve_without_model_is_a_usage_error() -> None:
    result = _run_cli_without_torch("serve")
    assert result.returncode == 2 and "--model is required" in result.stderr


# ----------------------------------------------------------------------------- SIGTERM


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_llama_dir: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    grace_s = 20.0
    proc = spawn_server(args=serve_args(model_dir=tiny_llama_dir, port=port,
                                        drain_timeout_seconds=grace_s))
    try:
        alive_while_loading: list[bool] = []

        def ready() -> bool:
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    return True
                health = httpx.get(f"{base}/health", timeout=1).status_code
                alive_while_loading.append(health == 200)
            except httpx.ConnectError:  # not listening yet
                return proc.poll() is not None
            except httpx.TimeoutException:  # listening but not answering: a blocked loop
                alive_while_loading.append(False)
            return False
        wait_until(ready, timeout_s=90, what="the subprocess server to become ready")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        # the listener is up before the model: /health said yes while /ready said no
        assert alive_while_loading and all(alive_while_loading)

        first_chunk = threading.Event()
        events: list[str] = []

        def stream() -> None:
            body = {"model": MODEL_NAME, "prompt": "a long answer", "max_tokens": 300,
                    "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=60) as http, http.stream(
                    "POST", f"{base}/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first_chunk.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first_chunk.wait(30)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        def not_ready() -> bool:
            return httpx.get(f"{base}/ready", timeout=1).status_code == 503
        wait_until(not_ready, timeout_s=1.0, what="/ready to turn 503 after SIGTERM")
        not_ready_after_s = time.monotonic() - signalled
        refused = httpx.post(f"{base}/v1/completions", timeout=5,
                             json={"model": MODEL_NAME, "prompt": "new", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert "retry-after" in refused.headers
        assert streamer.is_alive(), "the in-flight stream should still be running"

        streamer.join(grace_s)
        assert not streamer.is_alive()
        assert events[-1] == "[DONE]"
        finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]
                    if json.loads(e)["choices"]]
        assert finishes[-1] == "length"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text

        rc = proc.wait(timeout=grace_s)
        exited_after_s = time.monotonic() - signalled
        assert rc == 0
        assert exited_after_s < grace_s
        print(f"SIGTERM: not ready after {not_ready_after_s:.3f} s, exit after "
              f"{exited_after_s:.2f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
