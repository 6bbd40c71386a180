"""The router driving vLLM's prefill → decode handoff (NixlConnector's ``kv_transfer_params``).

The prefill pod's answer below is the shape vLLM 0.32's ``NixlConnector`` writes
(``kv_connector/v1/nixl/pull_scheduler.py``, ``request_finished``); the pods are small HTTP
servers answering as vLLM's do (a real prefill/decode pair runs in
``e2e/test_vllm_disaggregated.py``), the router is the real app with ``--engine vllm``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.testclient import TestClient
from threaded_server import ThreadedServer

from splitserve_contract import RouterArgs
from splitserve_e2e.net import free_port
from splitserve_runtime.disagg.vllm_handoff import VllmHandoffError, vllm_handoff
from splitserve_runtime.router.app import build_app, byte_chunk_tokens

PROMPT = "A lighthouse keeper writes in his log every evening. " * 12  # well over 64 router tokens


def _params(host: str, **changes: Any) -> dict[str, Any]:
    """A vLLM 0.32 prefill pod's handoff parameters."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1, 2, 3, 4]],
        "remote_engine_id": "4f8c2d7e-0b6a-4c55-9f0e-2a1d3c4b5e6f",
        "remote_request_id": "cmpl-7d0c6a9e3f0b4c1e-0",
        "remote_host": host,
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 150,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }
    params.update(changes)
    return params


# ------------------------------------------------------------------------------ the parser
def test_vllm_params_are_kept_whole() -> None:
    params = _params("10.0.0.7")
    handoff = vllm_handoff({"id": "cmpl-1", "kv_transfer_params": params}, prefill_host="10.0.0.7")
    assert handoff is not None and handoff.to_json() == params and handoff.remote_host == "10.0.0.7"


def test_an_answer_without_params_has_no_handoff() -> None:
    assert vllm_handoff({"id": "cmpl-1", "choices": []}, prefill_host="10.0.0.7") is None
    assert vllm_handoff(["not", "an", "object"], prefill_host="10.0.0.7") is None


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (_params("10.0.0.9"), "is not the prefill pod"),
        (_params("10.0.0.7", do_remote_prefill=False), "was not kept"),
        (_params("10.0.0.7", remote_port="5600"), "remote_port must be a int"),
        (_params("10.0.0.7", remote_port=True), "remote_port must be a int"),
        ({k: v for k, v in _params("10.0.0.7").items() if k != "remote_block_ids"}, "remote_block_ids"),
        ("a string", "must be an object"),
    ],
)
def test_params_the_router_will_not_pass_on(params: object, words: str) -> None:
    with pytest.raises(VllmHandoffError, match=re.escape(words)):
        vllm_handoff({"kv_transfer_params": params}, prefill_host="10.0.0.7")


# ------------------------------------------------------------------------------ the flow
def _vllm_pod(seen: list[dict[str, Any]], answer: Callable[[], dict[str, Any]]) -> FastAPI:
    """A vLLM pod on the paths the router uses: it records each completion request's body and
    answers ``answer()``."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse(answer())

    return app


def _prefill_answer(host: str) -> dict[str, Any]:
    """A vLLM prefill pod's answer to the one-token prefill request, naming ``host``."""
    return {
        "id": "cmpl-p",
        "object": "text_completion",
        "choices": [{"index": 0, "text": " The", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 150, "completion_tokens": 1, "total_tokens": 151},
        "kv_transfer_params": _params(host),
    }


DECODE_ANSWER: dict[str, Any] = {
    "id": "cmpl-d",
    "object": "text_completion",
    "choices": [{"index": 0, "text": " The new keeper", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 150, "completion_tokens": 3, "total_tokens": 153},
}


@pytest.fixture
def pair() -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], TestClient]]:
    """A vLLM prefill pod and decode pod behind the real router (``--engine vllm``); the third
    item sets the host the prefill pod names in its answer (its own by default)."""
    prefilled: list[dict[str, Any]] = []
    decoded: list[dict[str, Any]] = []
    host = ["127.0.0.1"]
    prefill_port, decode_port = free_port(), free_port()
    with (
        ThreadedServer(_vllm_pod(prefilled, lambda: _prefill_answer(host[0])), prefill_port),
        ThreadedServer(_vllm_pod(decoded, lambda: DECODE_ANSWER), decode_port),
    ):
        args = RouterArgs(
            discovery="static",
            engine="vllm",
            prefill_endpoints=f"127.0.0.1:{prefill_port}",
            decode_endpoints=f"127.0.0.1:{decode_port}",
            health_interval_seconds=30,
        )
        app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
        with TestClient(app) as client:
            yield prefilled, decoded, host, client


def _routes(client: TestClient, before: dict[str, float] | None = None) -> dict[str, float]:
    """The router's routes counter by route (minus ``before``: the registry is the process's)."""
    text = client.get("/metrics").text
    now = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'splitserve_router_routes_total\{[^}]*route="(\w+)"[^}]*\} ([0-9.]+)', text)
    }
    return {route: value - (before or {}).get(route, 0.0) for route, value in now.items()}


def test_router_sends_the_prompt_to_prefill_then_vllms_params_to_decode(
    pair: tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], TestClient],
) -> None:
    prefilled, decoded, _, client = pair
    before = _routes(client)
    answer = client.post(
        "/v1/completions",
        json={"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "kv_transfer_params": {"x": 1}},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == " The new keeper"
    (to_prefill,) = prefilled
    assert to_prefill["max_tokens"] == 1 and to_prefill["stream"] is False
    assert to_prefill["kv_transfer_params"] == {"do_remote_decode": True}  # the client's own are dropped
    (to_decode,) = decoded
    assert to_decode["kv_transfer_params"] == _params("127.0.0.1")  # as the prefill pod wrote them
    assert to_decode["max_tokens"] == 24 and to_decode["prompt"] == PROMPT
    assert _routes(client, before).get("disaggregated") == 1.0


def test_params_naming_another_host_make_the_decode_pod_compute_the_prompt(
    pair: tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], TestClient],
) -> None:
    prefilled, decoded, host, client = pair
    host[0] = "10.9.9.9"  # not the prefill pod the router asked
    before = _routes(client)
    answer = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 24})
    assert answer.status_code == 200, answer.text
    assert len(prefilled) == 1
    (to_decode,) = decoded
    assert "kv_transfer_params" not in to_decode
    routes = _routes(client, before)
    assert routes.get("fallback") == 1.0 and not routes.get("disaggregated")


def test_short_prompts_go_straight_to_decode(
    pair: tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], TestClient],
) -> None:
    prefilled, decoded, _, client = pair
    before = _routes(client)
    answer = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert prefilled == [] and len(decoded) == 1 and "kv_transfer_params" not in decoded[0]
    assert _routes(client, before).get("direct") == 1.0
