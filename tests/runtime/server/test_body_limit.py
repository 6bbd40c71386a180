"""Request bodies over the limit are refused with a 413 before the app reads them (issue 12 #1).

Unit tests drive the middleware with httpx's ASGI transport (declared and chunked bodies);
the server test posts a 9 MiB prompt to a real runtime with the default 8 MiB limit and
checks the answer, and that a small request and /health are served right after.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL_NAME, InProcessServer, serve_args, start_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from splitserve_contract import ServeArgs, defaults
from splitserve_runtime.body_limit import BodySizeLimit

LIMIT = 1024


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"length": len(await request.body())})


def _client(max_bytes: int) -> httpx.AsyncClient:
    app = Starlette(routes=[Route("/echo", _echo, methods=["POST", "GET"])])
    limited = BodySizeLimit(app, max_bytes=max_bytes)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=limited), base_url="http://t")


def _assert_413(response: httpx.Response) -> None:
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(LIMIT) in error["message"]


async def test_declared_body_over_the_limit_is_413() -> None:
    async with _client(LIMIT) as client:
        _assert_413(await client.post("/echo", content=b"x" * (LIMIT + 1)))
        ok = await client.post("/echo", content=b"x" * LIMIT)
        assert ok.status_code == 200 and ok.json() == {"length": LIMIT}


async def test_chunked_body_over_the_limit_is_413() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"y" * 200

    async with _client(LIMIT) as client:
        response = await client.post("/echo", content=chunks())
        _assert_413(response)


async def test_small_chunked_body_reaches_the_app_whole() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"z" * 100

    async with _client(LIMIT) as client:
        response = await client.post("/echo", content=chunks())
        assert response.status_code == 200 and response.json() == {"length": 400}


async def test_zero_disables_the_limit() -> None:
    async with _client(0) as client:
        response = await client.post("/echo", content=b"x" * (LIMIT * 10))
        assert response.status_code == 200 and response.json() == {"length": LIMIT * 10}


def test_serve_and_router_share_the_default() -> None:
    from splitserve_contract import RouterArgs

    assert (
        ServeArgs().max_request_body_bytes == RouterArgs().max_request_body_bytes == defaults.MAX_REQUEST_BODY_BYTES > 0
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir)) as srv:
        yield srv


def test_real_server_refuses_a_huge_prompt_and_keeps_serving(server: InProcessServer) -> None:
    huge = "a " * (defaults.MAX_REQUEST_BODY_BYTES // 2 + 1024)  # > 8 MiB of JSON
    response = httpx.post(
        f"{server.base_url}/v1/completions", timeout=60, json={"model": MODEL_NAME, "prompt": huge, "max_tokens": 1}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    small = httpx.post(
        f"{server.base_url}/v1/completions", timeout=60, json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
    )
    assert small.status_code == 200
