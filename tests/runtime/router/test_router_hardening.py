"""Router hardening: the pods' own API-key check, quiet health polling, and a JSON 500.

- auth: the router used to compare the whole header with ``"Bearer <key>"``, so
  ``Authorization: bearer <key>`` was 401 at the router but 200 at the pod, and its 401 had
  no ``WWW-Authenticate``. Both now use ``splitserve_runtime.auth``.
- logging: every poll used to log httpx's INFO request line (4 lines/s with two pods); poll
  results are DEBUG now, state changes INFO/WARNING.
- errors: an unexpected exception gave Starlette's plain-text 500 and uvicorn closed the
  keep-alive connection; now the answer is an OpenAI-shaped JSON 500 on a kept connection.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse as StarlettePlainText
from starlette.routing import Route
from threaded_server import ThreadedServer, aggregated_pod_app

from splitserve_contract import INFO_PATH, Metric, Role, RouterArgs
from splitserve_e2e.net import free_port

KEY = "sk-router-test-key"


def _pod() -> FastAPI:
    app: FastAPI = aggregated_pod_app()  # typed: mypy does not resolve the helper

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse(content={"id": "c", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]})

    return app


@pytest.fixture
def pod_port() -> Iterator[int]:
    port = free_port()
    with ThreadedServer(_pod(), port):
        yield port


def _router(pod_port: int, *, api_key: str | None = None) -> FastAPI:
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    args = RouterArgs(
        discovery="static",
        policy="RoundRobin",
        aggregated_endpoints=f"127.0.0.1:{pod_port}",
        health_interval_seconds=30,
    )
    return build_app(
        args=args, api_key=api_key, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", "")))
    )


# ----------------------------------------------------------------------------- auth (8)

AUTH_CASES = [
    None,
    f"Bearer {KEY}",
    f"bearer {KEY}",
    f"BEARER {KEY}",
    f"Bearer  {KEY}",
    "Bearer wrong",
    f"Basic {KEY}",
    KEY,
    "Bearer",
    "",
]


def test_router_accepts_a_lower_case_scheme(pod_port: int) -> None:
    with TestClient(_router(pod_port, api_key=KEY)) as client:
        answer = client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"Authorization": f"bearer {KEY}"}
        )
    assert answer.status_code == 200, answer.text


def test_router_401_has_www_authenticate_and_the_openai_shape(pod_port: int) -> None:
    with TestClient(_router(pod_port, api_key=KEY)) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=headers)
            assert answer.status_code == 401
            assert answer.headers["www-authenticate"] == "Bearer"
            error = answer.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert KEY not in answer.text
        assert client.get("/v1/models").status_code == 401
        for path in ("/health", "/ready", "/metrics"):
            assert client.get(path).status_code == 200, path


def test_router_and_pod_agree_on_every_header(pod_port: int) -> None:
    """The router and a pod's middleware give the same status for the same header."""
    from splitserve_runtime import auth
    from splitserve_runtime.router import app as router_app
    from splitserve_runtime.server import auth as server_auth

    assert server_auth.APIKeyMiddleware is auth.APIKeyMiddleware is router_app.APIKeyMiddleware  # type: ignore[attr-defined]  # the name the router app uses

    async def ok(_request: object) -> StarlettePlainText:
        return StarlettePlainText("ok")

    pod_like = Starlette(routes=[Route("/v1/completions", ok, methods=["POST"])])
    pod_like.add_middleware(server_auth.APIKeyMiddleware, api_key=KEY)
    with TestClient(_router(pod_port, api_key=KEY)) as router, TestClient(pod_like) as pod:
        for value in AUTH_CASES:
            headers = {} if value is None else {"Authorization": value}
            at_router = router.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=headers)
            at_pod = pod.post("/v1/completions", json={}, headers=headers)
            assert at_router.status_code == at_pod.status_code, value
            assert at_router.status_code in (200, 401)


def test_the_key_is_never_logged(pod_port: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with TestClient(_router(pod_port, api_key=KEY)) as client:
        client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"Authorization": "Bearer x"})
        client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert KEY not in caplog.text


# ----------------------------------------------------------------------------- poll logging (10)


def _mock_client(state: dict[str, bool]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if not state["up"]:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/ready":
            return httpx.Response(200, json={"status": "ready"})
        if request.url.path == INFO_PATH:
            return httpx.Response(200, json={"compat_hash": "h", "kv_endpoint": "tcp://x:1"})
        return httpx.Response(200, text=f"# TYPE {Metric.REQUESTS_WAITING} gauge\n{Metric.REQUESTS_WAITING} 2\n")

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_poll_results_are_debug_and_state_changes_info(caplog: pytest.LogCaptureFixture) -> None:
    from splitserve_runtime.router.pods import HealthPoller, PodSet, Target

    caplog.set_level(logging.DEBUG)
    pods = PodSet()
    pods.set_targets(
        role=Role.AGGREGATED,
        targets=[
            Target(name="a", url="http://a:8000", role=Role.AGGREGATED),
            Target(name="b", url="http://b:8000", role=Role.AGGREGATED),
        ],
    )
    added = [r for r in caplog.records if r.levelno == logging.INFO and "added" in r.getMessage()]
    assert len(added) == 2

    state = {"up": True}
    async with _mock_client(state) as client:
        poller = HealthPoller(pods=pods, client=client, interval_seconds=1)
        caplog.clear()
        await poller.poll_once()  # both pods become healthy: one INFO line each
        became = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert len(became) == 2 and all("healthy" in r.getMessage() for r in became), caplog.text

        caplog.clear()
        for _ in range(3):  # steady state: nothing at INFO or above, from any logger
            await poller.poll_once()
        loud = [f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records if r.levelno >= logging.INFO]
        assert loud == []
        assert any(r.levelno == logging.DEBUG and r.name.endswith("router.pods") for r in caplog.records)

        caplog.clear()
        state["up"] = False
        await poller.poll_once()  # both go down: one WARNING each
        await poller.poll_once()  # still down: DEBUG only
        loud_records = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert [r.levelno for r in loud_records] == [logging.WARNING, logging.WARNING]

    caplog.clear()
    pods.set_targets(role=Role.AGGREGATED, targets=[Target(name="a", url="http://a:8000", role=Role.AGGREGATED)])
    pods.set_targets(role=Role.AGGREGATED, targets=[Target(name="a", url="http://a:8000", role=Role.AGGREGATED)])
    assert [(r.levelno, "removed" in r.getMessage()) for r in caplog.records] == [(logging.INFO, True)]


async def test_request_logging_outside_polls_is_untouched(caplog: pytest.LogCaptureFixture) -> None:
    from splitserve_runtime.router.pods import HealthPoller, PodSet

    caplog.set_level(logging.DEBUG)
    async with _mock_client({"up": True}) as client:
        HealthPoller(pods=PodSet(), client=client, interval_seconds=1)  # installs the filter
        await client.get("http://a:8000/ready")
    assert any(r.name == "httpx" and r.levelno == logging.INFO for r in caplog.records)


# ----------------------------------------------------------------------------- JSON 500 (5)


def _post(conn: http.client.HTTPConnection) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": "m", "prompt": "hi"})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def test_unexpected_error_is_a_json_500_on_a_kept_connection(
    pod_port: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from splitserve_runtime.router.proxy import Router

    async def broken(self: Router, **_kwargs: object) -> None:
        raise RuntimeError("boom: an encoding error nobody expected")

    monkeypatch.setattr(Router, "handle", broken)
    caplog.set_level(logging.INFO)
    port = free_port()
    with ThreadedServer(_router(pod_port), port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            status, headers, body = _post(conn)
            assert conn.sock is not None
            first_socket = conn.sock.getsockname()
            assert status == 500
            assert headers["content-type"].startswith("application/json")
            error = json.loads(body)["error"]
            assert error["type"] == "server_error" and error["message"]
            assert "boom" not in error["message"]  # internals stay in the log
            assert headers.get("connection", "").lower() != "close"
            status2, _, _ = _post(conn)  # same connection: uvicorn did not close it
            assert status2 == 500
            assert conn.sock is not None and conn.sock.getsockname() == first_socket
        finally:
            conn.close()
    logged = [r for r in caplog.records if r.name == "splitserve.router" and r.exc_info]
    assert logged and "boom" in caplog.text
