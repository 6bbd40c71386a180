"""Back-pressure and draining in disaggregated serving: a momentarily full decode pod makes
imported prompts wait instead of answering 429, and a draining prefill pod serves its KV.

One prefill and one decode pod whose batch holds a single sequence: concurrent requests all
reach the same decode pod, and each must wait for the one before it to finish, then succeed.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from disagg_harness import MODEL_NAME, Cluster, wait_for

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD

PROMPT = "a prompt long enough to go through the prefill pod rather than straight to decode"


@pytest.fixture
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One per test: two of them stop the prefill pod, so none may share it."""
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path_factory.mktemp("logs"),
        num_prefill=1,
        num_decode=1,
        decode_overrides={"max_num_seqs": 1},
        health_interval_seconds=30.0,
    ) as running:
        yield running


def test_concurrent_imports_wait_for_the_single_batch_slot(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.router_url, api_key="unused", max_retries=0, timeout=60)

    def ask(index: int) -> str:
        answer = client.completions.create(model=MODEL_NAME, prompt=f"{PROMPT} {index}", max_tokens=24, temperature=0)
        return answer.choices[0].finish_reason or ""

    assert cluster.router is not None
    routed = cluster.router.metric("splitserve_router_routes_total", route="disaggregated")
    with ThreadPoolExecutor(max_workers=4) as pool:
        reasons = list(pool.map(ask, range(4)))
    assert len(reasons) == 4 and all(r in ("length", "stop") for r in reasons)
    assert cluster.router.metric("splitserve_router_routes_total", route="disaggregated") == routed + 4


def test_draining_prefill_pod_waits_for_its_kv_to_be_pulled(cluster: Cluster) -> None:
    """SIGTERM on a prefill pod that still holds exported KV: it keeps serving the pull, and
    exits once the decode pod has claimed it."""
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    body = {"model": MODEL_NAME, "prompt": f"{PROMPT} drain", "max_tokens": 8, "temperature": 0}
    handoff = httpx.post(
        f"{prefill.url}/v1/completions",
        timeout=30,
        json={**body, "max_tokens": 1, KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True}},
    )
    assert handoff.status_code == 200, handoff.text
    params = handoff.json()[KV_TRANSFER_PARAMS_FIELD]
    assert prefill.popen is not None
    prefill.popen.send_signal(signal.SIGTERM)
    # The pod has seen the SIGTERM once it reports "draining" (readiness) and its drain loop has
    # looked at the unclaimed export (log); a pod that did not wait would exit on that same tick.
    wait_for(
        lambda: not prefill.ready() and "draining:" in prefill.log_tail(num_chars=100_000),
        timeout_seconds=10,
        what="the prefill pod draining",
    )
    assert prefill.alive() and "drained in" not in prefill.log_tail(num_chars=100_000), (
        "the prefill pod exited with KV still unclaimed"
    )
    answer = httpx.post(f"{decode.url}/v1/completions", timeout=30, json={**body, KV_TRANSFER_PARAMS_FIELD: params})
    assert answer.status_code == 200, answer.text
    prefill.popen.wait(timeout=10)
    assert prefill.popen.returncode == 0


def test_with_no_prefill_pod_left_the_decode_pod_computes_the_prompt(cluster: Cluster) -> None:
    """With the only prefill pod gone, requests still succeed: the router's prefill attempt
    fails and it falls back to computing on the decode pod."""
    cluster.prefill[0].kill()
    assert cluster.router is not None and not cluster.prefill[0].alive()
    client = openai.OpenAI(base_url=cluster.router_url, api_key="unused", max_retries=0, timeout=60)
    answer = client.completions.create(model=MODEL_NAME, prompt=f"{PROMPT} fallback", max_tokens=8, temperature=0)
    assert answer.choices[0].text
    assert cluster.router.metric("splitserve_router_routes_total", route="fallback") == 1
