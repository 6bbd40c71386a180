"""The real server answers a request whose logits are NaN or infinite with a clear 500.

Found by a hostile review: with ``logprobs`` such a request was an unhandled 500 (NaN is not
JSON) with a traceback; without, a 200 of empty or garbage text. Now (the fault is put into the
real sampler's input for requests marked by their seed, ``logit_faults.poison``: no CPU model
overflows on demand): a fault at the first token is a 500 ``non_finite_logits`` in the OpenAI
error shape, stream or not; a later one ends a stream with an error event of that code and
``[DONE]``. A normal request served beside it gets its usual answer, and no traceback is logged.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from logit_faults import poison
from server_harness import MODEL_NAME, InProcessServer, serve_args, start_server

POISONED_SEED = 4242
"""Requests with this seed get non-finite logits from ``AT_OUTPUT`` on."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir, max_model_len=128, num_kv_blocks=32)) as srv:
        yield srv


def _poison(server: InProcessServer, *, at_output: int) -> None:
    assert server.engine is not None
    poison(
        server.engine.engine.runner.sampler,
        at_output=at_output,
        marked=lambda _rid, params: params.seed == POISONED_SEED,
        fault=lambda row: row.__setitem__(3, float("nan")),
    )


@pytest.fixture
def first_token_poisoned(server: InProcessServer) -> Iterator[None]:
    assert server.engine is not None
    sampler = server.engine.engine.runner.sampler
    _poison(server, at_output=0)
    yield
    del sampler.launch  # the instance attribute: back to the class's method


@pytest.fixture
def third_token_poisoned(server: InProcessServer) -> Iterator[None]:
    assert server.engine is not None
    sampler = server.engine.engine.runner.sampler
    _poison(server, at_output=2)
    yield
    del sampler.launch


def _body(path: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if path == "/v1/completions":
        return {**base, "prompt": "Once upon a time", **extra}
    return {**base, "messages": [{"role": "user", "content": "Once upon a time"}], **extra}


def _assert_non_finite_error(error: dict[str, Any]) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == "non_finite_logits", error
    assert error["type"] == "server_error"
    assert "non-finite logits" in error["message"]


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records
    ]


LOGPROBS = {"/v1/completions": {"logprobs": 2}, "/v1/chat/completions": {"logprobs": True, "top_logprobs": 2}}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("with_logprobs", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.usefixtures("first_token_poisoned")
def test_non_finite_logits_at_the_first_token_are_a_500(
    server: InProcessServer, caplog: pytest.LogCaptureFixture, path: str, with_logprobs: bool, stream: bool
) -> None:
    extra = {**(LOGPROBS[path] if with_logprobs else {}), "stream": stream}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        normal = http.post(path, json=_body(path, **extra, seed=1))
        assert normal.status_code == 200, normal.text
        answer = http.post(path, json=_body(path, **extra, seed=POISONED_SEED))
        assert answer.status_code == 500, answer.text
        _assert_non_finite_error(answer.json()["error"])
        again = http.post(path, json=_body(path, **extra, seed=1))
        assert again.status_code == 200, again.text  # the server is none the worse
    assert server.state.num_in_flight == 0
    _no_traceback(caplog)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.usefixtures("third_token_poisoned")
def test_non_finite_logits_mid_stream_end_it_with_an_error_event(
    server: InProcessServer, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """The poisoned stream and a normal one run side by side; the normal one is as it is alone."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        alone = http.post(path, json=_body(path, **LOGPROBS[path], seed=1)).json()
        answers: dict[str, httpx.Response] = {}

        def send(name: str, seed: int) -> None:
            answers[name] = http.post(path, json=_body(path, **LOGPROBS[path], stream=True, seed=seed))

        threads = [
            threading.Thread(target=send, args=("poisoned", POISONED_SEED)),
            threading.Thread(target=send, args=("normal", 1)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    poisoned = answers["poisoned"]
    assert poisoned.status_code == 200  # two tokens were streamed before the fault
    events = [line[len("data: ") :] for line in poisoned.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    _assert_non_finite_error(json.loads(events[-2])["error"])
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all("error" not in c for c in chunks)
    normal_events = [line[len("data: ") :] for line in answers["normal"].text.splitlines() if line.startswith("data: ")]
    assert normal_events[-1] == "[DONE]"
    normal_chunks = [json.loads(e) for e in normal_events[:-1]]
    assert all("error" not in c for c in normal_chunks)
    if path == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in normal_chunks if c["choices"])
        assert text == alone["choices"][0]["text"]
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in normal_chunks if c["choices"])
        assert text == alone["choices"][0]["message"]["content"]
    assert server.state.num_in_flight == 0
    _no_traceback(caplog)
