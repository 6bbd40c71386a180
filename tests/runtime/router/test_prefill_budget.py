"""The router's prefill stage has a total budget, and skips prefill for a request the decode
pods would refuse.

Defects pinned: a prefill pod that accepted the prefill request and never answered (or dripped
one byte a second, which no read-gap timeout catches) held every disaggregated request for the
router's upstream bound of 600 s; and a request whose prompt fits but whose prompt plus
max_tokens does not fit the decode pods' max_model_len was prefilled (KV computed and pinned on
the prefill pod) before the decode pod refused it.

The pods are small real HTTP servers on loopback (the router is the real app): a prefill pod
that passes the health poll and then stalls or drips on the prefill request, and a decode pod
that answers what it is sent (or refuses over-long requests with the runtime's 400).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from threaded_server import ThreadedServer

from splitserve_contract import INFO_PATH, RouterArgs
from splitserve_e2e.net import free_port

BUDGET_SECONDS = 2.0
MAX_MODEL_LEN = 100


def _base(role: str, *, max_model_len: int | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get(INFO_PATH)
    async def info() -> dict[str, Any]:
        return {"role": role, "compat_hash": "", "kv_endpoint": "", "block_size": 16, "max_model_len": max_model_len}

    return app


def _prefill_pod(mode: str, hits: list[str]) -> FastAPI:
    app = _base("prefill", max_model_len=MAX_MODEL_LEN)

    @app.post("/v1/completions", response_model=None)
    async def completions() -> StreamingResponse | JSONResponse:
        hits.append(mode)
        if mode == "stall":
            await asyncio.sleep(3600)

        async def drip() -> AsyncIterator[bytes]:
            for _ in range(3600):
                yield b" "
                await asyncio.sleep(1.0)

        return StreamingResponse(drip(), media_type="application/json")

    return app


def _decode_pod(seen: list[dict[str, Any]]) -> FastAPI:
    app = _base("decode", max_model_len=MAX_MODEL_LEN)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        prompt_tokens = len(body["prompt"].encode()) // 4  # the router's byte-chunk count
        if prompt_tokens + body.get("max_tokens", 1) > MAX_MODEL_LEN:
            return JSONResponse(
                status_code=400,
                content={
                    "error": {
                        "message": "this model's maximum context length is 100 tokens",
                        "type": "invalid_request_error",
                        "param": "prompt",
                        "code": "context_length_exceeded",
                    }
                },
            )
        return JSONResponse(
            content={"id": "c", "object": "text_completion", "choices": [{"text": "decoded", "index": 0}]}
        )

    return app


def _run(mode: str, request: dict[str, Any]) -> tuple[Any, float, list[str], list[dict[str, Any]], dict[str, float]]:
    from fastapi.testclient import TestClient

    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    hits: list[str] = []
    seen: list[dict[str, Any]] = []
    prefill_port, decode_port = free_port(), free_port()
    prefill_server = ThreadedServer(_prefill_pod(mode, hits), prefill_port)
    prefill_server.server.config.timeout_graceful_shutdown = 1  # its stalled request ends with the test
    with prefill_server, ThreadedServer(_decode_pod(seen), decode_port):
        args = RouterArgs(
            discovery="static",
            prefill_endpoints=f"127.0.0.1:{prefill_port}",
            decode_endpoints=f"127.0.0.1:{decode_port}",
            health_interval_seconds=30,
            short_prompt_threshold=4,
            prefill_timeout_seconds=BUDGET_SECONDS,
        )
        app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
        with TestClient(app) as client:
            deadline = time.monotonic() + 10
            while client.get("/ready").status_code != 200:  # the first health poll
                assert time.monotonic() < deadline, "the router never saw its pods"
                time.sleep(0.05)
            before = client.get("/metrics").text
            started = time.monotonic()
            answer = client.post("/v1/completions", json=request)
            elapsed = time.monotonic() - started
            after = client.get("/metrics").text
    routes = {route: _route_count(after, route) - _route_count(before, route) for route in ("fallback", "direct")}
    return answer, elapsed, hits, seen, routes


def _route_count(metrics: str, route: str) -> float:
    """The router's counter of requests sent by ``route`` (counters are process-wide)."""
    for line in metrics.splitlines():
        if line.startswith("splitserve_router_routes_total{") and f'route="{route}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_stalled_prefill_pod_costs_the_budget_then_decode_computes() -> None:
    answer, elapsed, hits, seen, routes = _run("stall", {"model": "m", "prompt": "x" * 200, "max_tokens": 5})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "decoded"
    assert hits == ["stall"]
    assert BUDGET_SECONDS - 0.2 <= elapsed < BUDGET_SECONDS + 5, elapsed
    assert len(seen) == 1 and "kv_transfer_params" not in seen[0]  # computed on the decode pod
    assert routes["fallback"] == 1


def test_a_dripping_prefill_pod_does_not_extend_the_budget() -> None:
    answer, elapsed, hits, seen, routes = _run("drip", {"model": "m", "prompt": "x" * 200, "max_tokens": 5})
    assert answer.status_code == 200, answer.text
    assert hits == ["drip"]
    assert BUDGET_SECONDS - 0.2 <= elapsed < BUDGET_SECONDS + 5, elapsed
    assert len(seen) == 1 and "kv_transfer_params" not in seen[0]
    assert routes["fallback"] == 1


def test_a_request_the_decode_pods_cannot_fit_never_reaches_the_prefill_pod() -> None:
    # 50 prompt "tokens" fit a 100-token window; 50 + 80 for the completion do not.
    answer, elapsed, hits, seen, routes = _run("stall", {"model": "m", "prompt": "x" * 200, "max_tokens": 80})
    assert hits == []  # the prefill pod computed and pinned nothing
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert len(seen) == 1 and "kv_transfer_params" not in seen[0]
    assert elapsed < BUDGET_SECONDS  # not via the stalled prefill pod
    assert routes == {"fallback": 0, "direct": 1}
