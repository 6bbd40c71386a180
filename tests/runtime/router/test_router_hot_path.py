"""The proxied routes' own ASGI path (router/hot_path.py, router/relay.py): the client's body is
forwarded byte for byte unless the router must change it, a client that hangs up mid-stream
closes the pod's stream (the pod stops generating for nobody), chunks pass through as the pod
sends them, and the layers FastAPI's stack had (body limit, API key, JSON errors) still apply.

A FastAPI pod on a real uvicorn server records each request body and how its streams end;
the router is the real app on a real uvicorn server.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from threaded_server import ThreadedServer, aggregated_pod_app, gauges

from splitserve_contract import RouterArgs
from splitserve_e2e.net import free_port

KEY = "sk-hot-path"
EVENT_INTERVAL_S = 0.05


@dataclass
class PodLog:
    bodies: list[bytes] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    stream_closed: threading.Event = field(default_factory=threading.Event)
    events_sent: int = 0


def _pod(log: PodLog) -> FastAPI:
    app: FastAPI = aggregated_pod_app()  # typed: mypy does not resolve the helper

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        raw = await request.body()
        log.bodies.append(raw)
        log.content_types.append(request.headers.get("content-type", ""))
        if not json.loads(raw).get("stream"):
            return JSONResponse({"id": "c", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]})

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(200):  # 10 s unless the router hangs up
                    log.events_sent += 1
                    yield f"data: {json.dumps({'i': i})}\n\n".encode()
                    await asyncio.sleep(EVENT_INTERVAL_S)
                yield b"data: [DONE]\n\n"
            finally:
                log.stream_closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@dataclass
class Deployment:
    log: PodLog
    url: str
    api_key: str | None


@pytest.fixture(params=[None, KEY], ids=["open", "with-key"])
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    log = PodLog()
    pod_port, router_port = free_port(), free_port()
    args = RouterArgs(
        discovery="static",
        policy="RoundRobin",
        health_interval_seconds=30,
        aggregated_endpoints=f"127.0.0.1:{pod_port}",
        max_request_body_bytes=4096,
    )
    router = build_app(
        args=args,
        api_key=request.param,
        tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))),
    )
    with ThreadedServer(_pod(log), pod_port), ThreadedServer(router, router_port):
        yield Deployment(log=log, url=f"http://127.0.0.1:{router_port}", api_key=request.param)


def _headers(key: str | None = KEY) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {key}"}


def test_an_unchanged_body_is_forwarded_byte_for_byte(deployment: Deployment) -> None:
    raw = b'{ "prompt":"hi \\u00e9",  "model" : "m", "max_tokens": 3 }'
    answer = httpx.post(f"{deployment.url}/v1/completions", content=raw, headers=_headers())
    assert answer.status_code == 200, answer.text
    assert deployment.log.bodies == [raw]
    assert deployment.log.content_types == ["application/json"]


@pytest.mark.parametrize("extra", [b"", b', "kv_transfer_params": {}'], ids=["unchanged", "changed"])
def test_a_non_finite_number_goes_to_the_pod_to_judge(deployment: Deployment, extra: bytes) -> None:
    raw = b'{"model": "m", "prompt": "hi", "temperature": NaN' + extra + b"}"
    answer = httpx.post(f"{deployment.url}/v1/completions", content=raw, headers=_headers())
    assert answer.status_code == 200, answer.text  # was a 500 when the router re-encoded it
    assert b"NaN" in deployment.log.bodies[0]


def test_a_client_kv_transfer_params_is_dropped_from_the_forwarded_body(
    deployment: Deployment,
) -> None:
    body = {"model": "m", "prompt": "hi", "kv_transfer_params": {"remote_endpoint": "evil:1"}}
    answer = httpx.post(f"{deployment.url}/v1/completions", json=body, headers=_headers())
    assert answer.status_code == 200, answer.text
    assert [json.loads(b) for b in deployment.log.bodies] == [{"model": "m", "prompt": "hi"}]


def test_a_client_that_hangs_up_mid_stream_closes_the_pods_stream(deployment: Deployment) -> None:
    body = {"model": "m", "prompt": "hi", "stream": True}
    arrivals: list[float] = []
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{deployment.url}/v1/completions", json=body, headers=_headers()) as answer,
    ):
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
            if len(arrivals) == 4:
                break  # leave mid-stream: the with block closes the connection
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert min(gaps) > EVENT_INTERVAL_S / 2, gaps  # event by event, as the pod sent them
    assert deployment.log.stream_closed.wait(5), "the pod's stream was not closed"
    sent = deployment.log.events_sent
    time.sleep(4 * EVENT_INTERVAL_S)
    assert deployment.log.events_sent == sent < 200  # the pod stopped generating
    deadline = time.monotonic() + 5
    while (
        gauges(
            deployment.url,
            "splitserve_router_requests_in_flight",
            "splitserve_router_upstream_requests_in_flight",
        )
        != 0
    ):
        assert time.monotonic() < deadline, "the router still counts the stream in flight"
        time.sleep(0.05)


def test_the_layers_still_apply_to_the_proxied_routes(deployment: Deployment) -> None:
    url = f"{deployment.url}/v1/completions"
    too_large = httpx.post(url, content=b'{"prompt": "' + b"x" * 5000 + b'"}', headers=_headers())
    assert too_large.status_code == 413
    assert too_large.json()["error"]["code"] == "request_too_large"
    not_json = httpx.post(url, content=b"{not json", headers=_headers())
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    # another method: FastAPI's routes answer, behind the same key check
    assert httpx.get(url).status_code == (401 if deployment.api_key else 405)
    wrong_key = httpx.post(url, json={"model": "m", "prompt": "hi"}, headers=_headers("wrong"))
    assert wrong_key.status_code == (401 if deployment.api_key else 200)
    assert len(deployment.log.bodies) == (0 if deployment.api_key else 1)
