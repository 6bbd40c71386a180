"""Every answer the router sends to a client counts once in ``splitserve_router_requests_total``.

Found by a hostile review: the router's own 500s (an exception inside it, answered by its
catch-all layer) were never counted, nor were its refusals (a body that is not JSON, too large,
a wrong API key), so an error rate read from the counter missed exactly the router's failures.
Now the Router counts the requests it takes and an outer layer counts every other answer by its
status: a 500 of the router's own is ``outcome="internal_error"``. The real router app is
served on loopback in front of a fake pod; the fault is injected into the Router (mocked).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families
from threaded_server import ThreadedServer, aggregated_pod_app

from splitserve_contract import RouterArgs
from splitserve_e2e.net import free_port

KEY = "sk-count-test-key"
MODEL = "count-model"


def _pod() -> FastAPI:
    app: FastAPI = aggregated_pod_app()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse(content={"id": "c", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(content={"object": "list", "data": [{"id": MODEL}]})

    return app


@pytest.fixture
def router_url() -> Iterator[str]:
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    pod_port, router_port = free_port(), free_port()
    args = RouterArgs(
        discovery="static",
        policy="RoundRobin",
        served_model_name=MODEL,
        aggregated_endpoints=f"127.0.0.1:{pod_port}",
        health_interval_seconds=30,
        max_request_body_bytes=4096,
    )
    app = build_app(args=args, api_key=KEY, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
    with ThreadedServer(_pod(), pod_port), ThreadedServer(app, router_port):
        yield f"http://127.0.0.1:{router_port}"


def counted(url: str) -> dict[str, float]:
    """``splitserve_router_requests_total`` of this test's model, by outcome (the registry is
    the process's: other tests' models are other series)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "splitserve_router_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == MODEL:
                out[sample.labels["outcome"]] = sample.value
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after) if after.get(k, 0) != before.get(k, 0)
    }


AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
GOOD = json.dumps({"model": MODEL, "prompt": "hi"})


def test_the_routers_own_500_is_counted(router_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve_runtime.router.proxy import Router

    async def broken(self: Router, **_kwargs: object) -> None:
        raise RuntimeError("an encoding error nobody expected")

    before = counted(router_url)
    with httpx.Client(base_url=router_url, timeout=10) as http:
        assert http.post("/v1/completions", content=GOOD, headers=AUTH).status_code == 200
        monkeypatch.setattr(Router, "handle", broken)
        for _ in range(3):
            answer = http.post("/v1/completions", content=GOOD, headers=AUTH)
            assert answer.status_code == 500, answer.text
            assert answer.json()["error"]["type"] == "server_error"
    assert _delta(before, counted(router_url)) == {"success": 1, "internal_error": 3}


def test_every_refusal_of_the_router_counts_once(router_url: str) -> None:
    """Each answer the router makes itself counts once, and an answer the Router counted (the
    pod's 200) is not counted again by the outer layer."""
    before = counted(router_url)
    with httpx.Client(base_url=router_url, timeout=10) as http:
        statuses = [
            http.post("/v1/completions", content=GOOD, headers=AUTH).status_code,  # proxied
            http.post(
                "/v1/completions", content=b"[" * 1000 + b"]" * 1000, headers=AUTH
            ).status_code,  # not JSON the router takes
            http.post("/v1/completions", content=b"{" * 5000, headers=AUTH).status_code,  # too large
            http.post(
                "/v1/completions", content=GOOD, headers={"Authorization": "Bearer wrong"}
            ).status_code,  # the key
            http.get("/v1/models", headers=AUTH).status_code,  # from a pod, not through the Router
            http.get("/health").status_code,  # not a client request: not counted
        ]
    assert statuses == [200, 400, 413, 401, 200, 200]
    assert _delta(before, counted(router_url)) == {"success": 2, "client_error": 3}
