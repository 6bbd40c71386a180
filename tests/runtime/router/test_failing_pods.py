"""How the router tells a failing pod from a slow one or from a request it cannot serve.

* A pod that answers a request with a server error is polled again at once: when it fails that
  poll (a vLLM pod whose engine died answers its in-flight requests 500 while it shuts down),
  the request goes to another pod; when it passes, the error is the request's own and comes
  back as is, on one pod only.
* A pod out of rotation only because its health polls timed out (a pod starved of CPU) is
  still sent requests when no decode or aggregated pod of its role is healthy, instead of a
  certain 503; a pod that refuses connections or says it is not ready is not, and neither is a
  slow prefill pod (the decode pod computes the prompt instead).

The upstreams are small HTTP servers answering as the pods do (fault injection: an engine that
dies under a request cannot be produced on demand by a real vLLM pod); the router is the real app.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.testclient import TestClient
from threaded_server import ThreadedServer

from splitserve_contract import Role, RouterArgs
from splitserve_contract.engines import Engine
from splitserve_e2e.net import free_port
from splitserve_runtime.router.app import build_app, byte_chunk_tokens
from splitserve_runtime.router.discovery import parse_static
from splitserve_runtime.router.pods import HealthPoller, PodSet

ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def _vllm_pod(*, name: str, hits: list[str], dies: bool = False, errors: bool = False) -> FastAPI:
    """A vLLM pod on the paths the router uses. ``dies``: its engine dies under the first
    request, which it answers 500, and its health check fails from then on. ``errors``: it
    answers every request 500 and stays healthy."""
    app = FastAPI()

    @app.get("/health", response_model=None)
    async def health() -> PlainTextResponse:
        return PlainTextResponse("", status_code=503 if dies and name in hits else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 2048}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        hits.append(name)
        if dies or errors:
            return JSONResponse(status_code=500, content=ENGINE_DEAD)
        return JSONResponse(content={"id": "c", "object": "text_completion", "choices": [{"text": name, "index": 0}]})

    return app


@pytest.fixture
def two_pods() -> Iterator[Callable[..., tuple[list[str], TestClient]]]:
    """Starts a ``failing`` pod (``dies=`` or ``errors=``) beside a ``healthy`` one behind the
    real router (round robin, polls 30 s apart: only the router's own recheck can notice)."""
    servers: list[ThreadedServer] = []
    clients: list[TestClient] = []

    def start(**failing: bool) -> tuple[list[str], TestClient]:
        hits: list[str] = []
        ports = free_port(), free_port()
        for name, port, faults in (("failing", ports[0], failing), ("healthy", ports[1], {})):
            server = ThreadedServer(_vllm_pod(name=name, hits=hits, **faults), port)
            server.__enter__()
            servers.append(server)
        args = RouterArgs(
            discovery="static",
            policy="RoundRobin",
            engine=Engine.VLLM.value,
            aggregated_endpoints=",".join(f"127.0.0.1:{port}" for port in ports),
            health_interval_seconds=30,
        )
        app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return hits, client

    yield start
    for client in clients:
        client.__exit__(None, None, None)
    for server in servers:
        server.__exit__(None, None, None)


def test_request_on_a_pod_whose_engine_died_goes_to_another_pod(
    two_pods: Callable[..., tuple[list[str], TestClient]],
) -> None:
    hits, client = two_pods(dies=True)
    answers = [client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"}) for i in range(4)]
    metrics = client.get("/metrics").text
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.json()["choices"][0]["text"] for a in answers} == {"healthy"}
    assert hits.count("failing") == 1  # answered 500 once, failed its recheck, out of rotation
    assert re.search(r'splitserve_router_forward_retries_total\{[^}]*status="500"\} 1\.0', metrics)


def test_server_error_from_a_healthy_pod_comes_back_as_is_from_one_pod(
    two_pods: Callable[..., tuple[list[str], TestClient]],
) -> None:
    hits, client = two_pods(errors=True)
    answers = [client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"}) for i in range(4)]
    statuses = [a.status_code for a in answers]
    assert sorted(statuses) == [200, 200, 500, 500]  # round robin: each pod got two
    assert len(hits) == 4  # no request was sent twice
    failed = next(a for a in answers if a.status_code == 500)
    assert failed.json()["error"]["message"].startswith("EngineCore encountered an issue")


def _pods(*names: str) -> PodSet:
    pods = PodSet()
    endpoints = ",".join(f"10.0.0.{i + 7}:8000" for i in range(len(names)))
    pods.set_targets(role=Role.AGGREGATED, targets=parse_static(role=Role.AGGREGATED, endpoints=endpoints))
    return pods


async def _poll(pods: PodSet, answer: Callable[[httpx.Request], httpx.Response]) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await HealthPoller(pods=pods, client=client, interval_seconds=30, engine=Engine.VLLM).poll_once()


def _answer(by_host: dict[str, str]) -> Callable[[httpx.Request], httpx.Response]:
    """Each pod (by host) is ``up``, ``slow`` (the poll times out), ``refusing`` or ``not-ready``."""

    def answer(request: httpx.Request) -> httpx.Response:
        state = by_host[request.url.host]
        if state == "slow":
            raise httpx.ReadTimeout("timed out", request=request)
        if state == "refusing":
            raise httpx.ConnectError("connection refused", request=request)
        if state == "not-ready":
            return httpx.Response(503)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": []})
        return httpx.Response(200, text="")

    return answer


async def test_a_slow_pod_is_tried_when_no_pod_of_its_role_is_healthy() -> None:
    pods = _pods("a")
    await _poll(pods, _answer({"10.0.0.7": "up"}))
    await _poll(pods, _answer({"10.0.0.7": "slow"}))
    (pod,) = pods.all()
    assert not pod.healthy and pod.slow
    assert pods.serving(Role.AGGREGATED) == [pod]
    assert pods.healthy(Role.AGGREGATED) == []  # what prefill picks and the healthy-pods gauge use
    await _poll(pods, _answer({"10.0.0.7": "up"}))
    assert pod.healthy and not pod.slow


async def test_a_slow_pod_is_left_out_while_another_is_healthy() -> None:
    pods = _pods("a", "b")
    await _poll(pods, _answer({"10.0.0.7": "up", "10.0.0.8": "up"}))
    await _poll(pods, _answer({"10.0.0.7": "slow", "10.0.0.8": "up"}))
    assert [p.url for p in pods.serving(Role.AGGREGATED)] == ["http://10.0.0.8:8000"]


@pytest.mark.parametrize("state", ["refusing", "not-ready"])
async def test_a_pod_that_refuses_or_is_not_ready_is_never_tried(state: str) -> None:
    pods = _pods("a")
    await _poll(pods, _answer({"10.0.0.7": "up"}))
    await _poll(pods, _answer({"10.0.0.7": state}))
    assert pods.serving(Role.AGGREGATED) == []


async def test_a_pod_that_never_was_healthy_is_not_slow() -> None:
    """A starting pod whose first polls time out is not served: it has not said it is ready."""
    pods = _pods("a")
    await _poll(pods, _answer({"10.0.0.7": "slow"}))
    assert pods.serving(Role.AGGREGATED) == []


async def test_a_failed_request_ends_the_benefit_of_the_doubt() -> None:
    pods = _pods("a")
    await _poll(pods, _answer({"10.0.0.7": "up"}))
    await _poll(pods, _answer({"10.0.0.7": "slow"}))
    (pod,) = pods.all()
    pods.mark_failed(pod.name)
    assert pods.serving(Role.AGGREGATED) == []
