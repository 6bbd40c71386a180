"""Failure behaviour of the real server: disconnects, overload, auth, loading, engine death.

Each scenario uses the real AsyncEngine with the tiny checkpoint; the numbers asserted (KV
usage, running requests, outcome counters) come from the engine and the /metrics endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    MODEL_NAME,
    InProcessServer,
    serve_args,
    start_server,
    wait_until,
)
from starlette.routing import Route

from splitserve_contract import Metric
from splitserve_runtime.engine.async_engine import AsyncEngine
from splitserve_runtime.server.app import DrainingServer, build_app
from splitserve_runtime.server.auth import OPEN_PATHS

LONG = 480  # tokens (max_model_len 512): far longer than any wait below


def _outcomes(server: InProcessServer) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == Metric.REQUESTS_TOTAL:
                out[sample.labels["outcome"]] = sample.value
    return out


def _idle(server: InProcessServer) -> bool:
    stats = server.stats()
    return bool(
        stats.requests_running == 0
        and stats.requests_waiting == 0
        and stats.kv_cache_usage_ratio == 0.0
        and server.state.num_in_flight == 0
    )


def _long_request(*, stream: bool) -> dict[str, object]:
    return {
        "model": MODEL_NAME,
        "prompt": "tell me a long story",
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir, num_kv_blocks=64)) as srv:
        yield srv


# ----------------------------------------------------------------------------- disconnects


def test_disconnect_mid_stream_aborts_and_frees_kv(server: InProcessServer) -> None:
    before_tokens = server.stats().generation_tokens_total
    before = _outcomes(server)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}/v1/completions", json=_long_request(stream=True)) as resp,
    ):
        assert resp.status_code == 200
        received = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 3:
                break
        assert server.stats().kv_cache_usage_ratio > 0  # the request holds blocks now
    wait_until(lambda: _idle(server), timeout_s=5, what="the aborted request to free its KV")
    generated = server.stats().generation_tokens_total - before_tokens
    assert generated < LONG / 2, f"the request kept decoding after the disconnect ({generated})"
    after = _outcomes(server)
    assert after["aborted"] - before["aborted"] == 1
    assert after["success"] == before["success"]


def test_disconnect_during_non_streaming_request_aborts(server: InProcessServer) -> None:
    before_tokens = server.stats().generation_tokens_total
    before = _outcomes(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base_url}/v1/completions", json=_long_request(stream=False), timeout=httpx.Timeout(30, read=0.1)
        )
    wait_until(lambda: _idle(server), timeout_s=5, what="the abandoned request to be aborted")
    assert server.stats().generation_tokens_total - before_tokens < LONG / 2
    assert _outcomes(server)["aborted"] - before["aborted"] == 1


def test_disconnect_of_a_chat_stream_aborts(server: InProcessServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "go on"}],
        stream=True,
        max_tokens=LONG,
        extra_body={"ignore_eos": True},
    )
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    stream.close()
    client.close()
    wait_until(lambda: _idle(server), timeout_s=5, what="the chat stream to be aborted")


# ----------------------------------------------------------------------------- overload


def test_full_queue_is_429_with_retry_after(tiny_llama_dir: Path) -> None:
    args = serve_args(
        model_dir=tiny_llama_dir, max_num_seqs=1, max_queue_len=1, num_kv_blocks=32
    )  # LONG tokens must fit the whole KV cache
    with start_server(args=args) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        release = threading.Event()
        first_token = threading.Event()

        def hold_the_only_slot() -> None:
            with (
                httpx.Client(timeout=30) as http,
                http.stream("POST", f"{srv.base_url}/v1/completions", json=_long_request(stream=True)) as resp,
            ):
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        first_token.set()
                        release.wait(30)
                        return

        queued: list[openai.types.Completion] = []

        def wait_in_queue() -> None:
            queued.append(
                client.completions.create(
                    model=MODEL_NAME, prompt="queued", max_tokens=3, extra_body={"ignore_eos": True}
                )
            )

        holder = threading.Thread(target=hold_the_only_slot)
        holder.start()
        assert first_token.wait(30)
        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        wait_until(lambda: srv.stats().requests_waiting == 1, timeout_s=10, what="the second request to queue")
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL_NAME, prompt="rejected", max_tokens=3)
        retry_after = info.value.response.headers["retry-after"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        assert info.value.code == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model=MODEL_NAME, max_tokens=3, messages=[{"role": "user", "content": "also"}]
            )
        assert _outcomes(srv)["rejected"] == 2
        release.set()
        holder.join(30)
        waiter.join(30)
        assert len(queued) == 1 and queued[0].usage is not None
        assert queued[0].usage.completion_tokens == 3
        wait_until(lambda: _idle(srv), timeout_s=5, what="an idle engine")


# ----------------------------------------------------------------------------- auth


def test_api_key_guards_every_route_but_probes(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = "sk-test-7f3a9c"
    caplog.set_level(logging.DEBUG)
    with start_server(args=serve_args(model_dir=tiny_llama_dir), api_key=key) as srv:
        good = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0)
        bad = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key + "x", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()

        checked = 0
        for route in srv.app.routes:
            if not isinstance(route, Route) or route.path in OPEN_PATHS:
                continue
            for method in sorted(route.methods or {"GET"}):
                response = httpx.request(method, f"{srv.base_url}{route.path}", timeout=10, json={})
                assert response.status_code == 401, (method, route.path)
                if method != "HEAD":
                    assert response.json()["error"]["code"] == "invalid_api_key"
                checked += 1
        assert checked >= 4  # models, completions, chat, openapi.json at least
        unknown = httpx.get(f"{srv.base_url}/v1/not-a-route", timeout=10)
        assert unknown.status_code == 401  # deny by default, even for unknown paths
        wrong_scheme = httpx.get(f"{srv.base_url}/v1/models", timeout=10, headers={"Authorization": f"Basic {key}"})
        assert wrong_scheme.status_code == 401
        for path in OPEN_PATHS:
            assert httpx.get(f"{srv.base_url}{path}", timeout=10).status_code == 200, path
    server_logs = [
        r.getMessage()
        for r in caplog.records
        if r.name.split(".")[0] in ("splitserve", "splitserve_runtime", "uvicorn")
    ]
    assert server_logs is not None and all(key not in line for line in server_logs)


# ----------------------------------------------------------------------------- lifecycle


def test_health_but_not_ready_while_the_model_loads(tiny_llama_dir: Path) -> None:
    args = serve_args(model_dir=tiny_llama_dir)
    gate = threading.Event()

    async def slow_loader() -> AsyncEngine:
        await asyncio.to_thread(gate.wait, 30)
        return AsyncEngine.from_args(args)

    app = build_app(engine=None, engine_loader=slow_loader, served_model_name=MODEL_NAME, role=args.role, api_key=None)
    with InProcessServer(app=app, wait_ready=False) as srv:
        assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
        ready = httpx.get(f"{srv.base_url}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "loading"
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL_NAME, prompt="too early", max_tokens=2)
        assert info.value.status_code == 503
        assert "retry-after" in info.value.response.headers
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
        assert Metric.REQUESTS_TOTAL in metrics and Metric.KV_CACHE_USAGE_RATIO not in metrics
        gate.set()
        wait_until(srv.is_ready, timeout_s=60, what="ready after loading")
        assert client.completions.create(model=MODEL_NAME, prompt="now", max_tokens=2).choices


def test_engine_failure_fails_health_and_ends_streams_with_an_error(tiny_llama_dir: Path) -> None:
    # LONG tokens must fit the whole KV cache
    with start_server(args=serve_args(model_dir=tiny_llama_dir, num_kv_blocks=32)) as srv:
        assert srv.engine is not None
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        stream = client.completions.create(
            model=MODEL_NAME, prompt="doomed", max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)

        def broken_step() -> list[object]:
            raise RuntimeError("simulated device fault")

        srv.engine.engine.step = broken_step
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                pass
        assert "engine" in info.value.message
        health = httpx.get(f"{srv.base_url}/health", timeout=10)
        assert health.status_code == 503
        assert httpx.get(f"{srv.base_url}/ready", timeout=10).status_code == 503
        with pytest.raises(openai.APIStatusError) as after:
            client.completions.create(model=MODEL_NAME, prompt="after", max_tokens=2)
        assert after.value.status_code == 503
        assert _outcomes(srv)["error"] >= 1


def test_process_exits_1_when_the_engine_dies(tiny_llama_dir: Path) -> None:
    """The launcher's watchdog: a dead engine stops the server so Kubernetes restarts it."""
    args = serve_args(model_dir=tiny_llama_dir)
    engine = AsyncEngine.from_args(args)
    app = build_app(engine=engine, served_model_name=MODEL_NAME, role=args.role, api_key=None)
    server = DrainingServer(
        uvicorn.Config(app, log_level="warning", lifespan="on"), state=app.state.server, drain_timeout_seconds=5
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        wait_until(lambda: server.started and app.state.server.is_ready, timeout_s=60, what="ready")

        def broken_step() -> list[object]:
            raise RuntimeError("simulated device fault")

        engine.engine.step = broken_step  # type: ignore[method-assign, assignment]
        httpx.post(f"{base}/v1/completions", timeout=10, json={"model": MODEL_NAME, "prompt": "boom", "max_tokens": 2})
        thread.join(10)
        assert not thread.is_alive(), "the server kept running on a dead engine"
        assert server.exit_code == 1
