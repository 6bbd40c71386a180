"""A uvicorn server on a thread for the router tests' fake pods, a free loopback port, and a
/metrics gauge reader."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
