"""A decode pod that refuses a request after accepting its handoff parameters releases the
export on the prefill pod at once, instead of leaving the prompt's KV pinned there until the
lease (``--kv-ttl-seconds``, 30 s) runs out; parameters that fail authentication are never
acted on, not even to release (the decode pod connects to nothing they name).

The defect this pins: a KV-capacity 400 raised after ``accept_remote`` (and any failure before
the pull) left the prefill pod's blocks pinned for the whole lease, so a client repeating such
requests could hold a prefill pod's KV cache full. Real processes on loopback: one prefill pod,
one decode pod whose KV cache (8 blocks of 16 tokens) is smaller than the request needs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from disagg_harness import MODEL_NAME, Cluster, Proc, wait_for

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Metric

PROMPT = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)
DECODE_KV_BLOCKS = 8
RELEASE_SECONDS = 2.0
"""Well inside the 30 s lease: the release is immediate, this is only the metrics' lag."""


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path_factory.mktemp("logs"),
        num_prefill=1,
        num_decode=1,
        health_interval_seconds=30.0,
        kv_ttl_seconds=30.0,
        decode_overrides={"num_kv_blocks": DECODE_KV_BLOCKS},
    ) as running:
        yield running


def _handoff(prefill: Proc, prompt: str) -> dict[str, Any]:
    """The prefill pod's answer to a router's first hop: its (signed) handoff parameters."""
    response = httpx.post(
        f"{prefill.url}/v1/completions",
        timeout=30,
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True},
        },
    )
    assert response.status_code == 200, response.text
    params: dict[str, Any] = response.json()[KV_TRANSFER_PARAMS_FIELD]
    return params


def _pinned(prefill: Proc) -> float:
    return float(prefill.metric(Metric.KV_CACHE_USAGE_RATIO))


@pytest.mark.parametrize("stream", [False, True])
def test_kv_capacity_refusal_releases_the_prefill_export_at_once(cluster: Cluster, stream: bool) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt = f"{PROMPT} ({'stream' if stream else 'whole'})"
    wait_for(lambda: _pinned(prefill) == 0.0, timeout_seconds=5, what="an idle prefill pod")
    params = _handoff(prefill, prompt)
    assert _pinned(prefill) > 0.0  # pinned for the decode pod's pull
    # fits the context (512) but not the decode pod's 128-token KV cache: refused after the
    # parameters were accepted, before any pull
    response = httpx.post(
        f"{decode.url}/v1/completions",
        timeout=30,
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 200,
            "temperature": 0,
            "stream": stream,
            KV_TRANSFER_PARAMS_FIELD: params,
        },
    )
    refused_at = time.monotonic()
    assert response.status_code == 400, response.text
    assert "exceeds the KV cache capacity" in response.json()["error"]["message"], response.text
    wait_for(
        lambda: _pinned(prefill) == 0.0,
        timeout_seconds=RELEASE_SECONDS,
        what="the prefill pod's export released after the decode pod refused the request",
    )
    print(f"released {time.monotonic() - refused_at:.2f} s after the refusal")


def test_parameters_of_another_prompt_are_refused_without_touching_the_export(cluster: Cluster) -> None:
    """The digest check fails: the parameters are not trusted for this request, so the decode
    pod neither pulls nor releases; the export stays for the request it was made for."""
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt = f"{PROMPT} (bound)"
    wait_for(lambda: _pinned(prefill) == 0.0, timeout_seconds=5, what="an idle prefill pod")
    params = _handoff(prefill, prompt)
    other = prompt.replace("king", "ruler")
    response = httpx.post(
        f"{decode.url}/v1/completions",
        timeout=30,
        json={
            "model": MODEL_NAME,
            "prompt": other,
            "max_tokens": 4,
            "temperature": 0,
            KV_TRANSFER_PARAMS_FIELD: params,
        },
    )
    assert response.status_code == 403, response.text
    time.sleep(RELEASE_SECONDS)  # a release would have landed by now
    assert _pinned(prefill) > 0.0
    response = httpx.post(
        f"{decode.url}/v1/completions",
        timeout=30,
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            KV_TRANSFER_PARAMS_FIELD: params,
        },
    )
    assert response.status_code == 200, response.text
    wait_for(
        lambda: _pinned(prefill) == 0.0,
        timeout_seconds=RELEASE_SECONDS,
        what="the export released by the pull of the request it was made for",
    )
