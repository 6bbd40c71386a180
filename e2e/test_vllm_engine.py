"""``runtime.engine: vllm`` on the real kubelet node: the same operator, router and autoscaler
serving, routing, scaling and explaining vLLM pods.

The chart is installed as in ``test_real_node.py`` (the operator container from this tree's
image, restricted namespaces), with ``runtime.vllmImage`` pointing at vLLM's CPU image built
from ``Containerfile.vllm`` (:func:`splitserve_e2e.image.ensure_vllm_image`). An Aggregated
InferenceService with ``runtime.engine: vllm`` serves SmolLM2-135M-Instruct, published on the
session's token-protected hub as ``HuggingFaceTB/SmolLM2-135M-Instruct``: the vLLM pod
downloads it by repository id (``HF_ENDPOINT``, ``HF_TOKEN`` from the Secret), as on a real
cluster; the router, from the bundled image, loads the tokenizer from the same hub.

Checked, in order:

1. The pod the operator rendered runs ``vllm serve`` from the vLLM image under the restricted
   level and becomes Ready on vLLM's /health; the InferenceService is Ready.
2. Through the router Service (kube-proxy), the official ``openai`` client gets a completion,
   a chat completion and a streamed chat with usage; a bad request is a 4xx in OpenAI's shape.
3. Under a burst (more concurrent requests than ``maxNumSeqs``), the autoscaler reads vLLM's
   own ``vllm:num_requests_waiting`` and scales the pool up; the router serves from both pods;
   one of them is killed mid-load (deleted without grace) and no request fails: a killed vLLM
   pod answers its in-flight requests 500 ("EngineCore encountered an issue") as it goes, the
   router re-polls it, finds it failing and sends them to the other pod (non-streamed: nothing
   had been sent back); when the burst ends the pool goes back to its minimum, and
   ``status.scalingHistory`` and the decisions explain each step.

Figures printed: image build/pull, apply to Ready, the second pod's start, the burst.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Final

import httpx
import openai
import pytest

import splitserve_contract as contract
from splitserve_contract.engine_metrics import VLLM_METRICS
from splitserve_e2e.demo import (
    VLLM_MAX_NUM_SEQS,
    VLLM_REPO_ID,
    VLLM_SERVED_NAME,
    condition,
    get_isvc,
    vllm_manifest,
)
from splitserve_e2e.realnode import Stack, apply_until_ready, explained, log, wait

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO_ID: Final = VLLM_REPO_ID
SERVED_NAME: Final = VLLM_SERVED_NAME
NAME: Final = "chat"
MAX_NUM_SEQS: Final = VLLM_MAX_NUM_SEQS
"""Small, so that a burst of a few requests makes a queue."""
BURST_CONCURRENCY: Final = 4
READY_TIMEOUT_SECONDS: Final = 900.0


@pytest.fixture(scope="module")
def served(vllm_stack: Stack) -> Stack:
    apply_until_ready(
        vllm_stack,
        vllm_manifest(name=NAME, namespace=vllm_stack.namespace, hub=vllm_stack.model_hub),
        timeout=READY_TIMEOUT_SECONDS,
        figure="vLLM InferenceService apply -> Ready",
    )
    return vllm_stack


def _pods(stack: Stack) -> list[Any]:
    core: Any = stack.cluster.core()
    selector = f"{contract.LABEL_INSTANCE}={NAME},{contract.LABEL_COMPONENT}={contract.Role.AGGREGATED.value}"
    return list(core.list_namespaced_pod(stack.namespace, label_selector=selector).items)


def _router_url(stack: Stack) -> str:
    core: Any = stack.cluster.core()
    service = core.read_namespaced_service(f"{NAME}-router", stack.namespace)
    return f"http://{service.spec.cluster_ip}:{contract.HTTP_PORT}"


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{_router_url(stack)}/v1", api_key="unused", timeout=120.0, max_retries=0)


def test_the_operator_runs_vllm_serve_under_the_restricted_level(served: Stack, vllm_image: str) -> None:
    (pod,) = _pods(served)
    container = pod.spec.containers[0]
    assert container.image == vllm_image
    assert container.command == ["vllm", "serve"]
    assert container.args[0] == REPO_ID and "--enforce-eager" in container.args
    assert container.security_context.read_only_root_filesystem is True
    assert pod.spec.security_context.run_as_user == 65532
    assert container.readiness_probe.http_get.path == "/health"
    assert all(status.ready for status in pod.status.container_statuses)
    obj = get_isvc(cluster=served.cluster, namespace=served.namespace, name=NAME)
    assert obj["spec"]["runtime"]["engine"] == "vllm"


def test_the_router_serves_vllm_to_the_openai_client(served: Stack) -> None:
    client = _client(served)
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    completion = client.completions.create(
        model=SERVED_NAME, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert (
        completion.choices[0].text.strip() and completion.usage is not None and completion.usage.completion_tokens > 0
    )
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0
    )
    assert chat.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=-3)
    assert refused.value.status_code == 400


def _burst(stack: Stack, stop: threading.Event, failures: list[str]) -> list[int]:
    """Requests in a loop on BURST_CONCURRENCY threads until ``stop``; their status codes (and
    in ``failures`` the answer of each one that failed)."""
    url = f"{_router_url(stack)}/v1/completions"
    codes: list[int] = []

    def worker() -> None:
        with httpx.Client(timeout=300.0) as http:
            while not stop.is_set():
                body = {"model": SERVED_NAME, "prompt": "Tell me a long story about a lighthouse.", "max_tokens": 96}
                answer = http.post(url, json=body)
                codes.append(answer.status_code)
                if answer.status_code != 200:
                    failures.append(f"{time.strftime('%H:%M:%S')} {answer.status_code} {answer.text[:300]}")

    with concurrent.futures.ThreadPoolExecutor(BURST_CONCURRENCY) as pool:
        for _ in range(BURST_CONCURRENCY):
            pool.submit(worker)
    return codes


def test_vllm_pools_scale_on_vllm_metrics_and_explain_it(served: Stack) -> None:
    cluster, namespace = served.cluster, served.namespace
    stop = threading.Event()
    failures: list[str] = []
    started = time.monotonic()
    with explained(cluster, served.namespaces), concurrent.futures.ThreadPoolExecutor(1) as background:
        codes = background.submit(_burst, served, stop, failures)
        try:

            def two_ready_pods() -> list[Any] | None:
                pods = _pods(served)
                ready = [
                    p for p in pods if p.status.container_statuses and all(s.ready for s in p.status.container_statuses)
                ]
                return ready if len(ready) == 2 else None

            pods = wait(
                cluster, two_ready_pods, timeout=READY_TIMEOUT_SECONDS, what="a second Ready vLLM pod", interval=2.0
            )
            served.figures["burst start -> second vLLM pod Ready"] = f"{time.monotonic() - started:.1f}s"

            # The router discovers the new pod and spreads the burst over both vLLM pods: each
            # pod's own counter moves (a request counts when it ends: seconds on shared cores).
            def both_served() -> dict[str, float] | None:
                served_by_pod = {p.metadata.name: _pod_requests(served, p) for p in pods}
                return served_by_pod if all(v > 0 for v in served_by_pod.values()) else None

            wait(cluster, both_served, timeout=180, what="both vLLM pods answering the burst", interval=3.0)
            # Kill one mid-load, without grace; the router moves its requests to the other.
            victim = pods[0].metadata.name
            core: Any = cluster.core()
            core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
            log(f"killed vLLM pod {victim} mid-load")
            time.sleep(20)
        finally:
            stop.set()
        statuses = codes.result(timeout=600)
        assert statuses and set(statuses) == {200}, "\n".join(failures)
    served.figures["burst requests, one pod killed (all 200)"] = str(len(statuses))

    obj = get_isvc(cluster=cluster, namespace=namespace, name=NAME)
    ups = [e for e in obj["status"].get("scalingHistory", []) if e["pool"] == "aggregated" and e["to"] > e["from"]]
    assert ups, obj["status"]

    def back_to_min() -> dict[str, Any] | None:
        current = get_isvc(cluster=cluster, namespace=namespace, name=NAME)
        downs = [
            e for e in current["status"].get("scalingHistory", []) if e["pool"] == "aggregated" and e["to"] < e["from"]
        ]
        return current if downs and len(_pods(served)) == 1 else None

    started = time.monotonic()
    final = wait(cluster, back_to_min, timeout=300, what="the pool back at its minimum", interval=2.0)
    served.figures["burst end -> back to 1 pod"] = f"{time.monotonic() - started:.1f}s"
    decision = final["status"]["aggregated"]["lastDecision"]
    assert "queue" in " ".join(decision["inputs"]), decision
    # The autoscaler read the vLLM pods' own series through Prometheus, and says so.
    healthy = condition(final, "MetricsHealthy") or {}
    assert healthy.get("status") == "True" and "aggregated" in healthy.get("message", ""), healthy
    log(f"scaling history: {final['status']['scalingHistory']}")


def _pod_requests(stack: Stack, pod: Any) -> float:
    """``vllm:request_success_total`` of one pod, read from its /metrics (pod IP, from the host)."""
    text = httpx.get(f"http://{pod.status.pod_ip}:{contract.HTTP_PORT}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(VLLM_METRICS.requests_total + "{")
    )
