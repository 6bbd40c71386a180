"""Speculative decoding through the OpenAI API: a server started with
``speculative_method="ngram"`` answers greedy requests with exactly the text of a server
without it, /metrics counts proposals and acceptances (in total and by position), and the
per-request opt-out ``"speculative": false`` reaches the engine (a bad type is a 400)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, InProcessServer, serve_args, start_server

from splitserve_contract import Metric

NUM_TOKENS = 4
REPETITIVE = "one two three four, one two three four, one two three four, one two"
MAX_TOKENS = 32

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir)) as srv:
        yield srv


@pytest.fixture(scope="module")
def speculative(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    args = serve_args(model_dir=tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=NUM_TOKENS)
    with start_server(args=args) as srv:
        yield srv


def _post(server: InProcessServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)


def _complete(server: InProcessServer, **extra: Any) -> str:
    response = _post(
        server, "/v1/completions", prompt=REPETITIVE, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **extra
    )
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


def _chat(server: InProcessServer, **extra: Any) -> str:
    response = _post(
        server,
        "/v1/chat/completions",
        max_tokens=MAX_TOKENS,
        temperature=0,
        ignore_eos=True,
        messages=[{"role": "user", "content": REPETITIVE}],
        **extra,
    )
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


def _scrape(server: InProcessServer) -> Samples:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"role": "aggregated", "model": MODEL_NAME, **labels}.items())))]


def _by_position(samples: Samples) -> list[float]:
    return [
        _value(samples, Metric.SPEC_DECODE_ACCEPTED_TOKENS_BY_POSITION_TOTAL, position=str(i))
        for i in range(NUM_TOKENS)
    ]


def test_greedy_text_is_unchanged_and_metrics_count_proposals(
    plain: InProcessServer, speculative: InProcessServer
) -> None:
    # counts since the scrape before (the module's servers are shared: another test may have
    # run on them first in a shuffled order)
    before = _scrape(speculative)
    assert _complete(speculative) == _complete(plain)
    assert _chat(speculative) == _chat(plain)

    after = _scrape(speculative)
    proposed = _value(after, Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL) - _value(
        before, Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL
    )
    accepted = _value(after, Metric.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL) - _value(
        before, Metric.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL
    )
    assert proposed > 0 and 0 < accepted <= proposed
    by_position = [a - b for a, b in zip(_by_position(after), _by_position(before), strict=True)]
    # a proposal is accepted only after every one before it: counts never grow with position
    assert sum(by_position) == accepted and by_position == sorted(by_position, reverse=True)
    assert (
        Metric.SPEC_DECODE_ACCEPTED_TOKENS_BY_POSITION_TOTAL,
        (("model", MODEL_NAME), ("position", str(NUM_TOKENS)), ("role", "aggregated")),
    ) not in after
    # the server without speculation exports the counters too, at zero
    idle = _scrape(plain)
    assert _value(idle, Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL) == 0
    assert _value(idle, Metric.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL) == 0


def test_opted_out_requests_are_served_without_proposals(plain: InProcessServer, speculative: InProcessServer) -> None:
    before = _value(_scrape(speculative), Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL)
    assert _complete(speculative, speculative=False) == _complete(plain)
    assert _chat(speculative, speculative=False) == _chat(plain)
    assert _value(_scrape(speculative), Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL) == before
    # true and null are the default: speculation on
    _complete(speculative, speculative=None)
    middle = _value(_scrape(speculative), Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL)
    assert middle > before
    _complete(speculative, speculative=True)
    assert _value(_scrape(speculative), Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL) > middle


def test_opt_out_is_accepted_by_a_server_without_speculation(plain: InProcessServer) -> None:
    assert _complete(plain, speculative=False) == _complete(plain)


@pytest.mark.parametrize("value", ["false", 0, 1, [], {"enabled": False}])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_type_is_a_400_in_the_openai_error_shape(speculative: InProcessServer, path: str, value: object) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "speculative": value}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = _post(speculative, path, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "speculative"
