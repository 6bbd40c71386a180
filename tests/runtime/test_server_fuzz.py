"""Odd request bodies never make the real server answer 5xx (docs/architecture.md, "Reliability").

A seeded generator sets random fields, each to a valid value or (sometimes) an odd JSON value
(wrong types, NaN, huge numbers, nesting), and some invalid-but-plausible values are among
the "valid" ones; every answer must be 2xx or a 4xx in the OpenAI error shape.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MODEL_NAME, InProcessServer, serve_args, start_server

ODD: list[Any] = [None, True, False, 0, -1, 1, 2, 2**64, -(2**70), 1.5, -1e300, "", "x",
                  "0.5", [], [1], ["a"], [[1, 2]], {}, {"a": 1}, [None], [-5], [2**40]]
NON_JSON_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999"]

COMPLETION_FIELDS: dict[str, list[Any]] = {
    "prompt": ["hi", [1, 2, 3], ["hi"], [[4, 5]]],
    "max_tokens": [1, 2, None],
    "temperature": [0, 0.7, None],
    "top_p": [1, 0.5], "top_k": [0, 5], "min_p": [0, 0.1],
    "seed": [1], "stop": ["\n", ["a", "b"]], "stream": [False, True],
    "stream_options": [{"include_usage": True}], "logprobs": [0, 2],
    "n": [1], "echo": [False], "user": ["u"],
    "stop_token_ids": [[1]], "min_tokens": [0, 1], "ignore_eos": [True],
    "logit_bias": [{}, {"1": 2}], "presence_penalty": [0, 1],
}
CHAT_FIELDS: dict[str, list[Any]] = {
    "messages": [[{"role": "user", "content": "hi"}],
                 [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 [{"role": "assistant", "content": None}],
                 [{"role": "user"}], [{"role": "user", "content": {"a": 1}}]],
    "max_tokens": [1, 2], "max_completion_tokens": [1],
    "temperature": [0], "logprobs": [True, False], "top_logprobs": [0, 3],
    "stream": [False, True], "stream_options": [{"include_usage": True}],
    "stop": ["x"], "seed": [3], "tools": [[]], "tool_choice": ["none"],
    "response_format": [{"type": "text"}, {"type": "json_object"}], "n": [1],
}


def _bodies(*, fields: dict[str, list[Any]], rng: random.Random, count: int) -> Iterator[str]:
    for _ in range(count):
        body: dict[str, Any] = {"model": MODEL_NAME if rng.random() < 0.9 else
                                rng.choice(["other", 5, None])}
        for name, valid in fields.items():
            if rng.random() < 0.4:
                body[name] = rng.choice(ODD) if rng.random() < 0.15 else rng.choice(valid)
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = min(body["max_tokens"], 4)  # keep generation short
        text = json.dumps(body)
        if rng.random() < 0.1:  # Python's json accepts these; they are not JSON
            field = rng.choice(["temperature", "top_p", "max_tokens"])
            text = text[:-1] + f', "{field}": {rng.choice(NON_JSON_NUMBERS)}}}'
        yield text


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir, max_model_len=64,
                                      num_kv_blocks=8)) as srv:
        yield srv


@pytest.mark.parametrize(("path", "fields"), [("/v1/completions", COMPLETION_FIELDS),
                                              ("/v1/chat/completions", CHAT_FIELDS)])
def test_no_body_gives_a_5xx(server: InProcessServer, path: str,
                             fields: dict[str, list[Any]]) -> None:
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for text in _bodies(fields=fields, rng=rng, count=200):
            response = http.post(path, content=text,
                                 headers={"content-type": "application/json"})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (text, response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, text
                assert isinstance(error["message"], str) and error["message"], text
    print(path, dict(sorted(statuses.items())))
    assert statuses.get(200, 0) >= 3, statuses  # the generator does reach the engine
    assert statuses.get(400, 0) >= 50, statuses
