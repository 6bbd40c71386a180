"""Client mistakes are 4xx in the OpenAI error shape, and a server bug is a JSON 500.

Regression tests: a lone surrogate in the prompt or a chat message (valid JSON, but text no
tokenizer can take), ``kv_transfer_params`` sent to an aggregated pod, and a ``seed`` outside
the range ``torch.Generator.manual_seed`` takes, were answered 500 / 501 / silently aliased.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MODEL_NAME, InProcessServer, serve_args, start_server

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD
from splitserve_runtime.server import serving_completions

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
LONE_SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir)) as srv:
        yield srv


def _post(server: InProcessServer, path: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps (ensure_ascii) writes a lone surrogate as the valid JSON escape "\ud800"
    return httpx.post(
        f"{server.base_url}{path}",
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )


def _assert_error(response: httpx.Response, *, status: int, type: str, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type
    assert error["param"] == param
    assert error["message"]
    return error


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


# ----------------------------------------------------------------------------- text


@pytest.mark.parametrize("prompt", [LONE_SURROGATE, f"ok {LONE_SURROGATE} ok", [f"a{LONE_SURROGATE}"], "\udfff"])
def test_unencodable_prompt_is_400(server: InProcessServer, prompt: object) -> None:
    for stream in (False, True):
        response = _post(server, COMPLETIONS, _completion(prompt=prompt, stream=stream))
        _assert_error(response, status=400, type="invalid_request_error", param="prompt")


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": LONE_SURROGATE},
        {"role": "user", "content": [{"type": "text", "text": f"x{LONE_SURROGATE}"}]},
        {"role": "system", "content": f"be {LONE_SURROGATE} nice"},
    ],
)
def test_unencodable_chat_message_is_400(server: InProcessServer, message: dict[str, Any]) -> None:
    for stream in (False, True):
        response = _post(server, CHAT, _chat(messages=[message], stream=stream))
        _assert_error(response, status=400, type="invalid_request_error", param="messages")


def test_unencodable_model_name_is_404_in_error_shape(server: InProcessServer) -> None:
    response = _post(server, COMPLETIONS, _completion(model=f"m{LONE_SURROGATE}"))
    _assert_error(response, status=404, type="invalid_request_error", param="model")


def test_server_keeps_serving_after_unencodable_text(server: InProcessServer) -> None:
    _post(server, COMPLETIONS, _completion(prompt=LONE_SURROGATE))
    assert _post(server, COMPLETIONS, _completion()).status_code == 200
    assert _post(server, CHAT, _chat()).status_code == 200


# ----------------------------------------------------------------------------- server bugs


def test_unexpected_exception_is_a_json_500_and_logged(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(**kwargs: object) -> object:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(serving_completions, "start_generation", boom)
    with caplog.at_level(logging.ERROR, logger="splitserve_runtime.server.errors"):
        response = _post(server, COMPLETIONS, _completion())
    error = _assert_error(response, status=500, type="server_error", param=None)
    assert "secret" not in error["message"]
    logged = [r for r in caplog.records if r.name == "splitserve_runtime.server.errors"]
    assert logged and logged[0].exc_info is not None
    assert "secret internal detail" in str(logged[0].exc_info[1])
    monkeypatch.undo()
    assert _post(server, COMPLETIONS, _completion()).status_code == 200


# ----------------------------------------------------------------------------- handoff


@pytest.mark.parametrize("params", [{"do_remote_decode": True}, {"remote_endpoint": "tcp://10.0.0.1:5555"}, {}])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_kv_transfer_params_to_aggregated_pod_is_400(
    server: InProcessServer, path: str, params: dict[str, Any]
) -> None:
    body = (_completion if path == COMPLETIONS else _chat)(**{KV_TRANSFER_PARAMS_FIELD: params})
    response = _post(server, path, body)
    _assert_error(response, status=400, type="invalid_request_error", param=KV_TRANSFER_PARAMS_FIELD)


def test_null_kv_transfer_params_is_a_plain_request(server: InProcessServer) -> None:
    response = _post(server, COMPLETIONS, _completion(**{KV_TRANSFER_PARAMS_FIELD: None}))
    assert response.status_code == 200, response.text


# ----------------------------------------------------------------------------- seed


@pytest.mark.parametrize("seed", [SEED_MAX + 1, 2**64 + 42, 2**100, SEED_MIN - 1, -(2**100)])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_seed_outside_generator_range_is_400(server: InProcessServer, path: str, seed: int) -> None:
    body = (_completion if path == COMPLETIONS else _chat)(seed=seed, temperature=1.0)
    _assert_error(_post(server, path, body), status=400, type="invalid_request_error", param="seed")


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 2**63, SEED_MAX])
def test_seed_at_range_edges_is_accepted(server: InProcessServer, seed: int) -> None:
    response = _post(server, COMPLETIONS, _completion(seed=seed, temperature=1.0))
    assert response.status_code == 200, response.text


# ----------------------------------------------------------------------------- repetition_penalty


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_neutral_repetition_penalty_is_accepted(server: InProcessServer, path: str) -> None:
    """vLLM's benchmark client (`vllm bench serve`) sends ``repetition_penalty: 1.0`` with every request."""
    for value in (1.0, 1, None):
        body = (_completion if path == COMPLETIONS else _chat)(repetition_penalty=value)
        response = _post(server, path, body)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("value", [1.2, 0.5])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_another_repetition_penalty_is_refused_naming_it(server: InProcessServer, path: str, value: float) -> None:
    body = (_completion if path == COMPLETIONS else _chat)(repetition_penalty=value)
    response = _post(server, path, body)
    _assert_error(response, status=400, type="invalid_request_error", param="repetition_penalty")
    assert "not supported" in response.json()["error"]["message"]
