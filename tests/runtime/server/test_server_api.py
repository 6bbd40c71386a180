"""The OpenAI API of `splitserve serve`, driven by the official `openai` client against the
real server (real AsyncEngine, tiny Llama checkpoint, CPU, torch attention backend)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, InProcessServer, serve_args, start_server

from splitserve_contract import (
    HEADER_REQUEST_ID,
    INFO_PATH,
    KV_TRANSFER_PARAMS_FIELD,
    OUTCOMES,
    Metric,
)

# the server fixture's limits: 512-token context, 16 KV blocks x 16 tokens = 256 tokens
MAX_MODEL_LEN = 512
KV_POOL_TOKENS = 256

GAUGES = (
    Metric.REQUESTS_WAITING,
    Metric.REQUESTS_RUNNING,
    Metric.PROMPT_TOKENS_WAITING,
    Metric.KV_CACHE_USAGE_RATIO,
    Metric.KV_CACHE_BLOCKS,
)
COUNTERS = (
    Metric.PROMPT_TOKENS_TOTAL,
    Metric.GENERATION_TOKENS_TOTAL,
    Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL,
    Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL,
    Metric.PREEMPTIONS_TOTAL,
    Metric.REQUESTS_TOTAL,
    Metric.KV_TRANSFER_BYTES_TOTAL,
    Metric.KV_TRANSFER_FAILURES_TOTAL,
    Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL,
    Metric.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL,
)
HISTOGRAMS = (
    Metric.TIME_TO_FIRST_TOKEN_SECONDS,
    Metric.INTER_TOKEN_LATENCY_SECONDS,
    Metric.E2E_REQUEST_LATENCY_SECONDS,
    Metric.KV_TRANSFER_SECONDS,
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    with start_server(
        args=serve_args(model_dir=tiny_llama_dir, max_model_len=MAX_MODEL_LEN, num_kv_blocks=KV_POOL_TOKENS // 16)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(client: openai.OpenAI, prompt: str, **kwargs: object) -> openai.types.Completion:
    completion: openai.types.Completion = client.completions.create(  # type: ignore[call-overload]
        model=MODEL_NAME, prompt=prompt, temperature=0, **kwargs
    )
    return completion


def _scrape(server: InProcessServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"role": "aggregated", "model": MODEL_NAME, **labels}.items())))
    return samples[key]


# ----------------------------------------------------------------------------- happy paths


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_probes_and_openapi(server: InProcessServer) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/ready", timeout=10).json() == {"status": "ready"}
    spec = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    info = httpx.get(f"{server.base_url}{INFO_PATH}", timeout=10).json()
    assert info == {
        "role": "aggregated",
        "model": MODEL_NAME,
        "compat_hash": "",
        "kv_endpoint": "",
        "block_size": 16,
        "max_model_len": MAX_MODEL_LEN,
        "identity_proof": None,
    }  # asked with ?nonce=, a keyed prefill pod's proof


def test_kv_handoff_to_an_aggregated_pod_is_a_client_mistake(server: InProcessServer) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=10,
        json={
            "model": MODEL_NAME,
            "prompt": "hi",
            "max_tokens": 1,
            KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True},
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == KV_TRANSFER_PARAMS_FIELD
    assert response.json()["error"]["code"] == "handoff_unavailable"


def test_completion_length_finish_and_usage(client: openai.OpenAI, server: InProcessServer) -> None:
    prompt = "The quick brown fox"
    result = _greedy(client, prompt, max_tokens=7, extra_body={"ignore_eos": True})
    num_prompt = len(server.engine.tokenizer.encode(prompt))
    assert result.object == "text_completion"
    assert result.model == MODEL_NAME
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens == num_prompt
    assert result.usage.completion_tokens == 7
    assert result.usage.total_tokens == num_prompt + 7
    assert result.choices[0].text != ""


def test_request_id_header_is_echoed(server: InProcessServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    given = httpx.post(
        f"{server.base_url}/v1/completions", json=body, timeout=10, headers={HEADER_REQUEST_ID: "rt-abc123"}
    )
    assert given.headers[HEADER_REQUEST_ID] == "rt-abc123"
    ours = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=10)
    assert ours.headers[HEADER_REQUEST_ID].startswith("cmpl-")


def test_token_id_prompt_matches_text_prompt(client: openai.OpenAI, server: InProcessServer) -> None:
    prompt = "def add(a, b):"
    ids = server.engine.tokenizer.encode(prompt)
    as_text = _greedy(client, prompt, max_tokens=6, extra_body={"ignore_eos": True})
    as_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage is not None and as_ids.usage.prompt_tokens == len(ids)


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = [(11 * i) % 300 + 5 for i in range(40)]  # 2.5 KV blocks of 16 tokens
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 16 <= cached < 40 and cached % 16 == 0


def test_streamed_completion_equals_whole_completion(client: openai.OpenAI) -> None:
    whole = _greedy(client, "Once upon a time", max_tokens=12, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_completion_tokens=10,
        extra_body={"ignore_eos": True},
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    stream = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL_NAME,
            messages=messages,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    assert stream[-1].usage is not None
    assert stream[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_developer_role_is_rendered_as_system(client: openai.OpenAI) -> None:
    def answer(role: str) -> str | None:
        return (
            client.chat.completions.create(
                model=MODEL_NAME,
                temperature=0,
                max_tokens=6,
                extra_body={"ignore_eos": True},
                messages=[
                    {"role": role, "content": "Be brief."},  # type: ignore[misc, list-item]
                    {"role": "user", "content": "hi"},
                ],
            )
            .choices[0]
            .message.content
        )

    assert answer("developer") == answer("system")


def test_chat_without_usage_option_sends_no_usage(client: openai.OpenAI) -> None:
    stream = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert all(c.usage is None for c in stream)
    assert all(c.choices for c in stream)


def test_stop_sequence_truncates_and_finishes_with_stop(client: openai.OpenAI) -> None:
    full = _greedy(client, "Hello there", max_tokens=40, extra_body={"ignore_eos": True}).choices[0].text
    start = next(i for i in range(4, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isalnum())
    stop = full[start : start + 2]
    stopped = _greedy(client, "Hello there", max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == full[: full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Hello there",
            temperature=0,
            max_tokens=40,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL_NAME,
                prompt="Random:",
                temperature=1.0,
                seed=seed,
                max_tokens=24,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    first, again, other = sample(42), sample(42), sample(43)
    assert first == again
    assert first != other


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = _greedy(client, "Numbers:", max_tokens=5, logprobs=3, extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 3
        assert chosen >= max(top.values()) - 1e-4  # greedy picks the most likely token


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert "".join(t.token for t in content) == result.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.logprob >= max(t.logprob for t in token.top_logprobs) - 1e-4
        assert token.bytes == list(token.token.encode())
    plain = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


# ----------------------------------------------------------------------------- client errors


def test_context_overflow_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[5] * 200, max_tokens=400)
    assert info.value.code == "context_length_exceeded"
    assert "512" in info.value.message


def test_prompt_larger_than_kv_pool_is_400_and_server_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[7] * (KV_POOL_TOKENS + 40), max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert "KV" in info.value.message
    after = client.completions.create(
        model=MODEL_NAME, prompt="still alive?", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert after.usage is not None and after.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 5.0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [-1, 3]}, "prompt"),
        ({"prompt": [10**7]}, "prompt"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
        ({"extra_body": {"speculative": "no"}}, "speculative"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_completion_requests_are_400(client: openai.OpenAI, kwargs: dict[str, object], param: str) -> None:
    request: dict[str, object] = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    assert param in (body["param"] or "") or param in body["message"]


def test_n_greater_than_one_says_why(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, n=3, messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "n"
    assert "n must be 1" in info.value.message


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user", "content": 42}],
        [{"content": "no role"}],
        "not a list",
    ],
)
def test_invalid_chat_messages_are_400(client: openai.OpenAI, messages: object) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=messages)  # type: ignore[call-overload]
    assert info.value.param == "messages"


def test_chat_unsupported_features_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert info.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, top_logprobs=2, messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "top_logprobs"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "raw", [b'{"model": "tiny-llama", "prompt": ', b"[]", b"42", b"null", b'"just a string"', b"", b"\xff\xfe"]
)
def test_malformed_bodies_are_400_in_error_shape(server: InProcessServer, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(
            f"{server.base_url}{path}", content=raw, timeout=10, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, (path, raw, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"


def test_unknown_route_and_wrong_method_use_error_shape(server: InProcessServer) -> None:
    missing = httpx.get(f"{server.base_url}/v1/nope", timeout=10)
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    wrong = httpx.get(f"{server.base_url}/v1/completions", timeout=10)
    assert wrong.status_code == 405 and "message" in wrong.json()["error"]


# ----------------------------------------------------------------------------- metrics


def test_metrics_expose_every_contract_name_and_counters_move(client: openai.OpenAI, server: InProcessServer) -> None:
    before = _scrape(server)
    for name in GAUGES:
        assert (name, (("model", MODEL_NAME), ("role", "aggregated"))) in before, name
    for name in COUNTERS:
        if name == Metric.REQUESTS_TOTAL:
            for outcome in OUTCOMES:
                _value(before, name, outcome=outcome)
        else:
            _value(before, name)
    for name in HISTOGRAMS:
        _value(before, f"{name}_count")
        _value(before, f"{name}_bucket", le="+Inf")
    assert _value(before, Metric.KV_CACHE_BLOCKS) == KV_POOL_TOKENS // 16

    client.completions.create(model=MODEL_NAME, prompt="count me", max_tokens=5, extra_body={"ignore_eos": True})
    after = _scrape(server)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta(Metric.REQUESTS_TOTAL, outcome="success") == 1
    assert delta(Metric.GENERATION_TOKENS_TOTAL) == 5
    assert delta(Metric.PROMPT_TOKENS_TOTAL) >= 1
    assert delta(Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL) >= 1
    assert delta(f"{Metric.TIME_TO_FIRST_TOKEN_SECONDS}_count") == 1
    assert delta(f"{Metric.E2E_REQUEST_LATENCY_SECONDS}_count") == 1
    assert delta(f"{Metric.INTER_TOKEN_LATENCY_SECONDS}_count") == 4
    assert _value(after, Metric.REQUESTS_RUNNING) == 0
    assert _value(after, Metric.KV_CACHE_USAGE_RATIO) == 0


def test_rejected_requests_are_counted(client: openai.OpenAI, server: InProcessServer) -> None:
    before = _value(_scrape(server), Metric.REQUESTS_TOTAL, outcome="rejected")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=[5] * 300, max_tokens=300)
    after = _value(_scrape(server), Metric.REQUESTS_TOTAL, outcome="rejected")
    assert after - before == 1
