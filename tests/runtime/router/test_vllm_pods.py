"""The router in front of vLLM pods (``--engine vllm``): polled on vLLM's own paths and gauges,
proxied like the bundled runtime's, and refused with prefill/decode pools.

The fake vLLM pods answer with what a real vLLM 0.32 pod answered (recorded from
``vllm serve`` on SmolLM2-135M-Instruct, CPU, served name ``smollm2``): its ``/v1/models``
(``fixtures/vllm-0.32.0-models.json``), a ``/metrics`` page with six requests running
(``fixtures/vllm-0.32.0-metrics-busy.txt``), an idle one (the contract tests' fixture), a 400
(``fixtures/vllm-0.32.0-error-400.json``) and a streamed chat completion with usage
(``fixtures/vllm-0.32.0-chat-stream.txt``). Like the real pod they have no ``/ready`` and no
``/v1/splitserve/info`` (404), so a router polling them as bundled-runtime pods finds none healthy.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.testclient import TestClient
from threaded_server import ThreadedServer

from splitserve_contract import (
    INFO_PATH,
    ROUTER_FLAGS,
    Role,
    RouterArgs,
    add_router_arguments,
    router_args_from_namespace,
    router_argv,
)
from splitserve_contract.engine_metrics import ENGINE_METRICS, SPLITSERVE_METRICS
from splitserve_contract.engines import ENGINE_PODS, Engine
from splitserve_e2e.net import free_port
from splitserve_runtime.router.discovery import parse_static
from splitserve_runtime.router.pods import HealthPoller, PodSet, model_card_max_model_len, parse_load
from splitserve_runtime.router.policy import PodLoad

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS_JSON = (FIXTURES / "vllm-0.32.0-models.json").read_text()
BUSY_METRICS = (FIXTURES / "vllm-0.32.0-metrics-busy.txt").read_text()
IDLE_METRICS = (Path(__file__).resolve().parents[2] / "contract" / "fixtures" / "vllm-0.32.0-metrics.txt").read_text()
ERROR_400 = (FIXTURES / "vllm-0.32.0-error-400.json").read_bytes()
CHAT_STREAM = (FIXTURES / "vllm-0.32.0-chat-stream.txt").read_bytes()
VLLM = ENGINE_METRICS[Engine.VLLM]


# ----------------------------------------------------------------------------- load parsing


def test_vllm_busy_page_gives_its_load() -> None:
    load = parse_load(BUSY_METRICS, VLLM)
    assert load.requests_running == 6.0
    assert load.requests_waiting == 0.0
    assert load.kv_cache_usage_ratio == pytest.approx(0.016528925619834656)
    assert load.prompt_tokens_waiting is None  # vLLM has no such gauge: unknown, not 0


def test_vllm_idle_page_is_an_idle_pod() -> None:
    load = parse_load(IDLE_METRICS, VLLM)
    assert (load.requests_waiting, load.requests_running, load.kv_cache_usage_ratio) == (0.0, 0.0, 0.0)


def _with_second_engine_core(page: str) -> str:
    """The busy page as a pod with two engine cores (data parallel 2) reports it: each gauge
    once more with ``engine="1"``."""
    out = []
    for line in page.splitlines():
        out.append(line)
        for name, value in (
            ("vllm:num_requests_running", "2.0"),
            ("vllm:num_requests_waiting", "3.0"),
            ("vllm:kv_cache_usage_perc", "0.5"),
        ):
            if line.startswith(name + "{"):
                out.append(f'{name}{{engine="1",model_name="smollm2"}} {value}')
    return "\n".join(out) + "\n"


def test_vllm_label_sets_sum_queues_and_average_kv_usage() -> None:
    load = parse_load(_with_second_engine_core(BUSY_METRICS), VLLM)
    assert load.requests_running == 8.0  # 6 + 2
    assert load.requests_waiting == 3.0  # 0 + 3; the by-reason series are not counted again
    assert load.kv_cache_usage_ratio == pytest.approx((0.016528925619834656 + 0.5) / 2)


def test_splitserve_page_still_parses_by_default() -> None:
    names = SPLITSERVE_METRICS
    page = (
        f'# TYPE {names.requests_waiting} gauge\n{names.requests_waiting}{{model="m"}} 2\n'
        f'# TYPE {names.requests_running} gauge\n{names.requests_running}{{model="m"}} 5\n'
        f'# TYPE {names.kv_cache_usage_ratio} gauge\n{names.kv_cache_usage_ratio}{{model="m"}} 0.25\n'
        f'# TYPE {names.prompt_tokens_waiting} gauge\n{names.prompt_tokens_waiting}{{model="m"}} 640\n'
    )
    load = parse_load(page)
    assert (load.requests_waiting, load.requests_running, load.kv_cache_usage_ratio) == (2.0, 5.0, 0.25)
    assert load.prompt_tokens_waiting == 640.0
    assert parse_load(BUSY_METRICS).requests_running == 0.0  # vLLM's names are not the runtime's


def test_unknown_prompt_backlog_is_this_routers_in_flight_tokens() -> None:
    assert PodLoad(prompt_tokens_waiting=None, in_flight_prompt_tokens=300).queued_prompt_tokens == 300.0
    assert PodLoad(prompt_tokens_waiting=None).queued_prompt_tokens == 0.0
    assert PodLoad(prompt_tokens_waiting=900.0, in_flight_prompt_tokens=300).queued_prompt_tokens == 900.0


def test_context_window_from_vllm_model_cards() -> None:
    assert model_card_max_model_len(json.loads(MODELS_JSON)) == 8192
    assert model_card_max_model_len({"object": "list", "data": []}) is None
    assert model_card_max_model_len({"data": [{"id": "x", "max_model_len": True}, {"max_model_len": "8"}]}) is None
    assert model_card_max_model_len({"data": [{"max_model_len": 4096}, {"max_model_len": 2048}]}) == 2048
    assert model_card_max_model_len(["not", "a", "listing"]) is None


# ----------------------------------------------------------------------------- health poller

Handler = Callable[[httpx.Request], httpx.Response]


def _vllm_pod(
    asked: list[httpx.Request], *, health: int = 200, models: int = 200, metrics: str = BUSY_METRICS
) -> Handler:
    """A vLLM pod as httpx sees it: its real answers, 404 where vLLM has no route."""

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(health)
        if path == "/v1/models":
            if models != 200:
                return httpx.Response(models, json={"error": "Unauthorized"})
            return httpx.Response(200, content=MODELS_JSON, headers={"content-type": "application/json"})
        if path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(404, json={"detail": "Not Found"})

    return handle


def _pods(role: Role = Role.AGGREGATED) -> PodSet:
    pods = PodSet()
    pods.set_targets(role=role, targets=parse_static(role=role, endpoints="10.0.0.7:8000"))
    return pods


async def _poll(handler: Handler, *, engine: Engine, polls: int = 1, api_key: str | None = None) -> PodSet:
    pods = _pods()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        poller = HealthPoller(pods=pods, client=client, interval_seconds=30, engine=engine, api_key=api_key)
        for _ in range(polls):
            await poller.poll_once()
    return pods


async def test_vllm_pod_is_polled_on_its_own_paths() -> None:
    asked: list[httpx.Request] = []
    pods = await _poll(_vllm_pod(asked), engine=Engine.VLLM, polls=2)
    (pod,) = pods.all()
    assert pod.healthy
    assert pod.max_model_len == 8192
    assert pod.compat_hash == "" and pod.kv_endpoint == ""  # pairs with anything
    assert pod.load.requests_running == 6.0 and pod.load.prompt_tokens_waiting is None
    # The model cards are read once; /ready and the pod info are never asked (vLLM has neither).
    assert [r.url.path for r in asked] == ["/health", "/v1/models", "/metrics", "/health", "/metrics"]
    assert ENGINE_PODS[Engine.VLLM].ready_path == "/health"


async def test_vllm_pod_that_is_not_up_is_unhealthy() -> None:
    for handler in (
        _vllm_pod([], health=503),
        _raising(httpx.ConnectError("connection refused")),
    ):
        pods = await _poll(handler, engine=Engine.VLLM)
        assert pods.healthy(Role.AGGREGATED) == []


def _raising(exc: Exception) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        raise exc

    return handle


async def test_vllm_models_behind_a_key_leave_the_window_unknown_not_the_pod_unhealthy() -> None:
    asked: list[httpx.Request] = []
    pods = await _poll(_vllm_pod(asked, models=401), engine=Engine.VLLM, polls=3)
    (pod,) = pods.all()
    assert pod.healthy and pod.max_model_len is None
    assert [r.url.path for r in asked].count("/v1/models") == 1  # a refusal is not asked again


async def test_vllm_models_failing_on_the_server_side_are_asked_again() -> None:
    asked: list[httpx.Request] = []
    pods = await _poll(_vllm_pod(asked, models=500), engine=Engine.VLLM, polls=2)
    assert pods.healthy(Role.AGGREGATED)
    assert [r.url.path for r in asked].count("/v1/models") == 2


async def test_router_key_goes_with_the_model_card_request_only() -> None:
    asked: list[httpx.Request] = []
    pods = await _poll(_vllm_pod(asked), engine=Engine.VLLM, api_key="sk-pod-key")
    assert pods.all()[0].max_model_len == 8192
    keyed = {r.url.path: r.headers.get("authorization") for r in asked}
    assert keyed == {"/health": None, "/v1/models": "Bearer sk-pod-key", "/metrics": None}


async def test_default_engine_polls_the_bundled_runtime_as_before() -> None:
    asked: list[httpx.Request] = []

    def runtime_pod(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        if request.url.path == "/ready":
            return httpx.Response(200, json={"status": "ready"})
        if request.url.path == INFO_PATH:
            return httpx.Response(
                200, json={"compat_hash": "abc", "kv_endpoint": "10.0.0.7:8100", "max_model_len": 512}
            )
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(404)

    pods = PodSet()
    pods.set_targets(role=Role.DECODE, targets=parse_static(role=Role.DECODE, endpoints="10.0.0.7:8000"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(runtime_pod)) as client:
        await HealthPoller(pods=pods, client=client, interval_seconds=30).poll_once()
    (pod,) = pods.all()
    assert pod.healthy and pod.compat_hash == "abc" and pod.max_model_len == 512
    assert pod.load.prompt_tokens_waiting == 0.0
    assert [r.url.path for r in asked] == ["/ready", INFO_PATH, "/metrics"]


async def test_vllm_pod_is_unhealthy_to_a_router_that_polls_it_as_the_runtime() -> None:
    """What ``--engine`` is for: vLLM has no /ready, so the default engine never routes there."""
    pods = await _poll(_vllm_pod([]), engine=Engine.SPLITSERVE)
    assert pods.healthy(Role.AGGREGATED) == []


# ----------------------------------------------------------------------------- flags


def _parse(argv: list[str]) -> RouterArgs:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return router_args_from_namespace(parser.parse_args(argv))


def test_engine_flag_defaults_to_the_bundled_runtime() -> None:
    assert RouterArgs().engine == Engine.SPLITSERVE.value
    assert "--engine" not in router_argv(RouterArgs())  # pods rendered before the flag are unchanged
    assert _parse([]).engine == "splitserve"
    engine_flag = next(f for f in ROUTER_FLAGS if f.dest == "engine")
    assert engine_flag.choices == tuple(e.value for e in Engine)


def test_engine_flag_renders_and_parses_back() -> None:
    args = RouterArgs(engine="vllm", aggregated_endpoints="10.0.0.7:8000")
    argv = router_argv(args)
    assert argv[argv.index("--engine") + 1] == "vllm"
    assert _parse(argv) == args


def test_engine_flag_refuses_an_unknown_engine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--engine", "tgi"])
    assert "invalid choice: 'tgi'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- aggregated only


@pytest.mark.parametrize("engine", ["splitserve", "vllm"])
def test_router_takes_prefill_and_decode_pools_of_either_engine(engine: str) -> None:
    from splitserve_runtime.router.app import build_app

    app = build_app(args=RouterArgs(engine=engine, prefill_endpoints="10.0.0.1:8000", decode_endpoints="10.0.0.2:8000"))
    assert {p.role for p in app.state.pods.all()} == {Role.PREFILL, Role.DECODE}


@pytest.mark.parametrize("engine", ["splitserve", "vllm"])
def test_kubernetes_discovery_watches_every_pool_of_either_engine(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    roles = (Role.PREFILL, Role.DECODE, Role.AGGREGATED)
    from splitserve_runtime.router import app as router_app
    from splitserve_runtime.router.discovery import KubernetesDiscovery

    made: list[KubernetesDiscovery] = []

    class Recorded(KubernetesDiscovery):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            made.append(self)

        def start(self) -> None:  # no cluster here
            pass

    monkeypatch.setattr(router_app, "KubernetesDiscovery", Recorded)
    args = RouterArgs(engine=engine, discovery="kubernetes", namespace="team-a", inference_service="llama")
    with TestClient(router_app.build_app(args=args)):
        pass
    (discovery,) = made
    assert sorted(discovery._service_roles.values()) == sorted(roles)


# ----------------------------------------------------------------------------- proxying


def _fake_vllm_app(seen: list[dict[str, Any]]) -> FastAPI:
    """A vLLM pod over HTTP: recorded answers, vLLM's routes only."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(IDLE_METRICS)

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(MODELS_JSON, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        seen.append({"path": "/v1/completions", "body": body, "headers": dict(request.headers)})
        if body.get("max_tokens", 1) < 1:
            return Response(ERROR_400, status_code=400, media_type="application/json")
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "smollm2",
                "choices": [{"index": 0, "text": " there", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        seen.append({"path": "/v1/chat/completions", "body": body, "headers": dict(request.headers)})

        async def events() -> Any:
            for event in CHAT_STREAM.split(b"\n\n"):
                if event:
                    yield event + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream; charset=utf-8")

    return app


@pytest.fixture
def vllm_router() -> Iterator[tuple[TestClient, list[dict[str, Any]]]]:
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    seen: list[dict[str, Any]] = []
    port = free_port()
    with ThreadedServer(_fake_vllm_app(seen), port):
        args = RouterArgs(engine="vllm", aggregated_endpoints=f"127.0.0.1:{port}", health_interval_seconds=30)
        app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(json.dumps(body)))
        with TestClient(app) as client:
            yield client, seen


def test_router_serves_a_vllm_pod(vllm_router: tuple[TestClient, list[dict[str, Any]]]) -> None:
    client, seen = vllm_router
    assert client.get("/ready").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 8192  # the pod's own list

    answer = client.post(
        "/v1/completions",
        json={"model": "smollm2", "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_prefill": True}},
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " there"
    assert "kv_transfer_params" not in seen[-1]["body"]  # a client's handoff never reaches a pod
    assert seen[-1]["headers"]["x-request-id"]


def test_vllm_client_error_comes_back_as_the_pod_said(
    vllm_router: tuple[TestClient, list[dict[str, Any]]],
) -> None:
    client, _ = vllm_router
    answer = client.post("/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": -3})
    assert answer.status_code == 400
    assert answer.content == ERROR_400
    assert answer.json()["error"]["type"] == "BadRequestError"


def test_vllm_stream_with_usage_is_relayed_byte_for_byte(
    vllm_router: tuple[TestClient, list[dict[str, Any]]],
) -> None:
    client, seen = vllm_router
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        relayed = b"".join(answer.iter_raw())
    assert relayed == CHAT_STREAM
    assert seen[-1]["body"]["stream_options"] == {"include_usage": True}  # forwarded as sent
    events = [json.loads(e[len(b"data: ") :]) for e in relayed.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events[-1]["usage"] == {"prompt_tokens": 32, "total_tokens": 36, "completion_tokens": 4}
