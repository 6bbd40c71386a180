"""A decode pod whose KV pull fails computes the prompt itself instead of answering 502.

The prefill pod answers the handoff (so the decode pod holds the prompt and the prefill pod's
first token), then dies (kill -9) before the decode pod pulls: the pull fails with
``connect_failed``. The decode pod must free the reserved blocks, log the failure at WARNING
with the request id and the transfer error code, count it in the transfer-failure metric, and
serve the request locally: greedy (and seeded) text identical to the aggregated engine's, the
first token streamed exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from disagg_harness import MODEL_NAME, Cluster, Proc, Reference, wait_for

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Metric
from splitserve_contract.block_hash import prompt_digest
from splitserve_e2e.net import free_port

PROMPT = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two prefill pods: each test that kills one uses its own."""
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path_factory.mktemp("logs"),
        num_prefill=2,
        num_decode=1,
        health_interval_seconds=30.0,
    ) as running:
        yield running


def _handoff(prefill: Proc, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill pod's answer to the router's first hop: the handoff parameters."""
    response = httpx.post(
        f"{prefill.url}/v1/completions",
        timeout=30,
        json={**body, "max_tokens": 1, "stream": False, KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True}},
    )
    assert response.status_code == 200, response.text
    params: dict[str, Any] = response.json()[KV_TRANSFER_PARAMS_FIELD]
    return params


def _decode(decode: Proc, body: dict[str, Any], params: dict[str, Any], *, stream: bool) -> tuple[str, str]:
    """(text, response id) of the decode pod's answer, which must succeed."""
    response = httpx.post(
        f"{decode.url}/v1/completions", timeout=60, json={**body, "stream": stream, KV_TRANSFER_PARAMS_FIELD: params}
    )
    assert response.status_code == 200, response.text
    if not stream:
        answer = response.json()
        return str(answer["choices"][0]["text"]), str(answer["id"])
    text: list[str] = []
    ids: set[str] = set()
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk
        ids.add(str(chunk["id"]))
        text.extend(choice["text"] for choice in chunk["choices"])
    assert len(ids) == 1
    return "".join(text), ids.pop()


def _decode_idle(cluster: Cluster) -> bool:
    return all(p.metric(Metric.KV_CACHE_USAGE_RATIO) == 0.0 for p in cluster.decode)


@pytest.mark.parametrize(
    ("index", "stream", "sampling"),
    [
        (0, False, {"temperature": 0.0}),
        (1, True, {"temperature": 0.9, "seed": 4321}),
    ],
)
def test_prefill_pod_killed_after_handoff_decode_recomputes(
    cluster: Cluster, reference: Reference, index: int, stream: bool, sampling: dict[str, Any]
) -> None:
    prefill, decode = cluster.prefill[index], cluster.decode[0]
    prompt = f"{PROMPT} ({index})"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, **sampling}
    want_text, want_tokens = reference.generate(
        reference.tokenizer.encode(prompt), max_tokens=16, ignore_eos=True, **sampling
    )
    params = _handoff(prefill, body)
    assert params["first_token_id"] == want_tokens[0]
    prefill.kill()  # after it answered: the KV it holds is gone
    failures = decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL)
    text, request_id = _decode(decode, body, params, stream=stream)
    assert text == want_text  # the first token once, then the same continuation
    assert decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
    warnings = [
        line for line in decode.log_tail(num_chars=1_000_000).splitlines() if "WARNING" in line and request_id in line
    ]
    assert any("connect_failed" in line for line in warnings), decode.log_tail()
    wait_for(lambda: _decode_idle(cluster), timeout_seconds=5, what="decode KV usage back to 0")


def test_handoff_to_a_closed_port_is_computed_on_the_decode_pod(cluster: Cluster, reference: Reference) -> None:
    """kv_transfer_params naming a port nobody listens on (signed, as if by a prefill pod that
    has gone since), sent straight to the decode pod."""
    decode = cluster.decode[0]
    prompt = f"{PROMPT} (closed port)"
    token_ids = reference.tokenizer.encode(prompt)
    want_text, want_tokens = reference.generate(token_ids, max_tokens=12, ignore_eos=True)
    host = "127.0.0.98"
    params = cluster.sign(
        {
            "remote_endpoint": f"{host}:{free_port(host)}",
            "remote_request_id": "cmpl-gone",
            "num_prompt_tokens": len(token_ids),
            "first_token_id": want_tokens[0],
            "compat_hash": "tinyhash",
            "prompt_digest": prompt_digest(token_ids),
        }
    )
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    for stream in (False, True):
        failures = decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL)
        text, _ = _decode(decode, body, params, stream=stream)
        assert text == want_text
        assert decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
    wait_for(lambda: _decode_idle(cluster), timeout_seconds=5, what="decode KV usage back to 0")
