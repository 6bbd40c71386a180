"""A uvicorn server on a thread for the router tests' fake pods, the routes a fake aggregated pod
needs to pass the router's health poll, a free loopback port, and a /metrics gauge reader."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contract import INFO_PATH


def aggregated_pod_app(*, role: str = "aggregated", metrics_text: Callable[[], str] = lambda: "") -> FastAPI:
    """A FastAPI app with what the router's health poller reads from a pod (ready, the load
    ``metrics_text()`` gives, none by default, no compat hash); the test adds its completion
    routes."""
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text())

    @app.get(INFO_PATH)
    async def info() -> dict[str, str]:
        return {"role": role, "compat_hash": "", "kv_endpoint": ""}

    return app


class ThreadedServer:
    """``with ThreadedServer(app, port):`` serves ``app`` on 127.0.0.1 until the block ends."""

    def __init__(self, app: Any, port: int) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:  # bounded poll of uvicorn's own "started" flag
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("the fake pod's server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def gauges(url: str, *names: str) -> float:
    """The sum of the named gauges' samples in ``url``'s /metrics (each must be exported)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = [f for f in text_string_to_metric_families(text) if f.name in names]
    assert {f.name for f in families} == set(names), f"{url}/metrics lacks one of {names}"
    return sum(sample.value for family in families for sample in family.samples)
