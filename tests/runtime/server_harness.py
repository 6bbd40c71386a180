"""Run the real server (real AsyncEngine, tiny checkpoint, CPU, torch backend) for tests.

:class:`InProcessServer` runs uvicorn on its own thread with a pre-bound loopback socket, so
tests can reach the engine object (``engine.stats()``) as well as HTTP; :func:`spawn_server`
runs ``splitserve serve`` as a subprocess for signal tests.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from splitserve_contract import ServeArgs, serve_argv
from splitserve_runtime.engine.async_engine import AsyncEngine
from splitserve_runtime.engine.stats import EngineStats
from splitserve_runtime.server.app import build_app
from splitserve_runtime.server.prompt_workers import PromptWorkers
from splitserve_runtime.server.state import ServerState

MODEL_NAME = "tiny-llama"


def serve_args(*, model_dir: Path, **overrides: object) -> ServeArgs:
    base = ServeArgs(
        model=str(model_dir),
        served_model_name=MODEL_NAME,
        host="127.0.0.1",
        device="cpu",
        attention_backend="torch",
        dtype="float32",
        max_model_len=512,
        num_kv_blocks=16,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class InProcessServer:
    """uvicorn on a thread around `app`; `engine` is the AsyncEngine inside it, if known."""

    def __init__(self, *, app: FastAPI, engine: AsyncEngine | None = None, wait_ready: bool = True) -> None:
        self.app = app
        self.engine = engine
        self._wait_ready = wait_ready
        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted connections only
        # when the listening socket says so, and without it every answer waited ~40 ms for a
        # delayed ACK (Nagle)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        if self._wait_ready:
            wait_until(self.is_ready, timeout_s=60, what="the server to become ready")
        else:
            wait_until(lambda: self._server.started, timeout_s=60, what="the listener")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def state(self) -> ServerState:
        state: ServerState = self.app.state.server
        return state

    def stats(self) -> EngineStats:
        if self.engine is None:
            raise RuntimeError("no engine")
        return self.engine.stats()


def start_server(
    *, args: ServeArgs, api_key: str | None = None, prompt_workers: PromptWorkers | None = None
) -> InProcessServer:
    """A ready-to-enter server with a real engine built from `args`."""
    engine = AsyncEngine.from_args(args)
    app = build_app(
        engine=engine,
        served_model_name=args.served_model_name,
        role=args.role,
        api_key=api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        prompt_workers=prompt_workers,
    )
    return InProcessServer(app=app, engine=engine)


def spawn_server(*, args: ServeArgs, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "splitserve_cli", "serve", *serve_argv(args)]
    return subprocess.Popen(
        argv, env={**os.environ, **(env or {})}, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def serve_until_exit(*, args: ServeArgs, termination_log: Path, timeout_s: float = 120) -> tuple[int, str, str]:
    """Run ``splitserve serve`` that is expected to stop by itself (a start-up failure):
    (exit code, its output, the termination message it wrote)."""
    termination_log.write_text("")
    from splitserve_runtime.termination import TERMINATION_LOG_ENV

    process = spawn_server(args=args, env={TERMINATION_LOG_ENV: str(termination_log)})
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return process.returncode, output, termination_log.read_text()
