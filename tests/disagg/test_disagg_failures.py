"""Killing real pods of a disaggregated deployment: a dead prefill pod costs one retry, a decode
pod killed mid-stream ends the client's stream with a clean error in bounded time, and the
deployment keeps serving afterwards.

The router polls health only every 30 s here, so the request path (not the poller) has to
notice the dead pods.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from disagg_harness import MODEL_NAME, Cluster, Reference, wait_for

from splitserve_runtime.contract import Metric

STORY = ("Once upon a time in a land far away there lived a king who had three daughters, "
         "and the youngest of them was the cleverest of all")
CLEAN_ERROR_SECONDS = 10.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve_runtime.model.tiny import write_tiny_model

    return write_tiny_model(out_dir=tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(model_dir=model_dir, log_dir=tmp_path_factory.mktemp("logs"), num_prefill=2,
                 num_decode=2, health_interval_seconds=30.0) as running:
        yield running


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router_url, api_key="unused", max_retries=0, timeout=30)


def test_killed_prefill_pod_is_retried_on_the_other(cluster: Cluster, client: openai.OpenAI,
                                                    model_dir: Path) -> None:
    router = cluster.router
    assert router is not None
    prompt = f"{STORY}, said the prefill probe"
    before = [p.metric(Metric.REQUESTS_TOTAL, outcome="success") for p in cluster.prefill]
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    served = [p.metric(Metric.REQUESTS_TOTAL, outcome="success") - b
              for p, b in zip(cluster.prefill, before, strict=True)]
    victim = cluster.prefill[served.index(1)]
    victim.kill()  # affinity will pick it again for the same prompt
    retries = router.metric("splitserve_router_prefill_retries_total")
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == first.choices[0].text
    assert router.metric("splitserve_router_prefill_retries_total") == retries + 1
    # and the dead pod is skipped from now on: no further retries
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert router.metric("splitserve_router_prefill_retries_total") == retries + 1
    reference = Reference(model_dir=model_dir)
    want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=12, ignore_eos=True)
    assert again.choices[0].text == want


def test_decode_pod_killed_mid_stream_gives_a_clean_error(cluster: Cluster,
                                                          client: openai.OpenAI) -> None:
    busy_before = [p.metric(Metric.GENERATION_TOKENS_TOTAL) for p in cluster.decode]
    stream = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    busy: list[float] = []

    def one_is_busy() -> bool:
        busy[:] = [p.metric(Metric.GENERATION_TOKENS_TOTAL) - b
                   for p, b in zip(cluster.decode, busy_before, strict=True)]
        return max(busy) > 0
    wait_for(one_is_busy, timeout_seconds=2, what="the decode pod's first tokens")
    assert min(busy) == 0
    victim = cluster.decode[busy.index(max(busy))]
    killed_at = time.monotonic()
    victim.kill()
    received = 2
    with pytest.raises(openai.APIError) as caught:
        for _ in chunks:
            received += 1
    elapsed = time.monotonic() - killed_at
    assert elapsed < CLEAN_ERROR_SECONDS
    assert received < 400  # it really ended early
    assert "died mid-stream" in str(caught.value)
    # the survivor serves the next requests, streamed and not
    survivor = next(p for p in cluster.decode if p is not victim)
    served = survivor.metric(Metric.REQUESTS_TOTAL, outcome="success")
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=STORY, max_tokens=8, temperature=0, stream=True) if c.choices)
    whole = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=8, temperature=0)
    assert whole.choices[0].text == text
    assert survivor.metric(Metric.REQUESTS_TOTAL, outcome="success") == served + 2
