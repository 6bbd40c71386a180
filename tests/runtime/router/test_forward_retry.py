"""The router retries a draining (503) or full (429) pod on another one before answering.

Two small HTTP upstreams stand in for runtime pods (fault injection: a pod that has started
draining but that the health poller has not noticed yet: its /ready still says yes until its
first 503, and no afterwards, as a draining runtime's does); the router is the real app.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from threaded_server import ThreadedServer

from splitserve_contract import RouterArgs
from splitserve_e2e.net import free_port


def _pod(*, status: int, hits: list[str], name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/ready", response_model=None)
    async def ready() -> dict[str, str] | JSONResponse:
        if status != 200 and name in hits:  # it has refused a request: it is draining, and says so
            return JSONResponse(status_code=503, content={"status": "draining"})
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/v1/splitserve/info")
    async def info() -> dict[str, str]:
        return {"role": "aggregated", "compat_hash": "", "kv_endpoint": ""}

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        hits.append(name)
        if status != 200:
            return JSONResponse(
                status_code=status, content={"error": {"message": "draining", "type": "x", "param": None, "code": None}}
            )
        return JSONResponse(content={"id": "c", "object": "text_completion", "choices": [{"text": name, "index": 0}]})

    return app


@pytest.fixture
def pods() -> Iterator[tuple[list[str], int, int]]:
    hits: list[str] = []
    draining_port, healthy_port = free_port(), free_port()
    with (
        ThreadedServer(_pod(status=503, hits=hits, name="draining"), draining_port),
        ThreadedServer(_pod(status=200, hits=hits, name="healthy"), healthy_port),
    ):
        yield hits, draining_port, healthy_port


def test_draining_pod_is_skipped_and_the_request_succeeds(pods: tuple[list[str], int, int]) -> None:
    from fastapi.testclient import TestClient

    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    hits, draining_port, healthy_port = pods
    args = RouterArgs(
        discovery="static",
        policy="RoundRobin",
        aggregated_endpoints=f"127.0.0.1:{draining_port},127.0.0.1:{healthy_port}",
        health_interval_seconds=30,
    )
    app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
    with TestClient(app) as client:
        answers = [client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"}) for i in range(4)]
        metrics = client.get("/metrics").text
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.json()["choices"][0]["text"] for a in answers} == {"healthy"}
    assert hits.count("draining") == 1  # tried once, then out of rotation
    assert 'splitserve_router_forward_retries_total{model="unknown",role="router",status="503"} 1.0' in metrics
    assert httpx.get(f"http://127.0.0.1:{healthy_port}/ready").status_code == 200
    assert httpx.get(f"http://127.0.0.1:{draining_port}/ready").status_code == 503
