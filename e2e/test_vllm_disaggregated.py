"""``runtime.engine: vllm`` with ``mode: Disaggregated`` on the real kubelet node: a vLLM prefill
pool and a vLLM decode pool handing the prompt's KV over with vLLM's ``NixlConnector`` (NIXL over
UCX's TCP transport, the KV in host memory), driven by the bundled router.

The stack is ``test_vllm_engine.py``'s (the chart, vLLM's CPU image from ``Containerfile.vllm``,
SmolLM2-135M-Instruct from the session's hub); the InferenceService is the demo's vLLM one with
one prefill and one decode pod instead of the aggregated pool.

Checked:

1. Both pools run ``vllm serve`` with the ``--kv-transfer-config`` the operator renders, and the
   InferenceService is Ready.
2. A greedy completion of a prompt longer than the router's short-prompt threshold goes through
   the router as prefill then decode (``splitserve_router_routes_total{route="disaggregated"}``);
   the prefill pod answered the one-token prefill request and the decode pod pulled the prompt's
   KV over NIXL (its ``vllm:nixl_bytes_transferred`` histogram counted a transfer, no failed
   one) rather than computing it, through the NetworkPolicies the operator renders.
3. The answer equals the decode pod's own answer to the same request sent to it directly (the
   prompt computed there, as an aggregated vLLM pod would): the handed-over KV gives the same
   greedy tokens.

Figures printed: apply to Ready, the disaggregated request's latency beside the direct one's.
"""

from __future__ import annotations

import time
from typing import Any, Final

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e.demo import VLLM_SERVED_NAME, vllm_manifest
from splitserve_e2e.realnode import Stack, apply_until_ready, wait

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]

NAME: Final = "pd"
READY_TIMEOUT_SECONDS: Final = 900.0
PROMPT: Final = (
    "A lighthouse keeper writes in his log every evening. He notes the weather, the ships that "
    "passed, the oil he burned and the repairs he made to the lamp. Over forty years the log grew "
    "to twelve volumes, and when he retired he gave them to the town library, where children "
    "still read them on rainy afternoons. Write the first entry of the thirteenth volume, in which "
    "the new keeper introduces himself and describes the first storm of the winter."
)
"""Well over the router's short-prompt threshold and several 32-token KV blocks."""


def _manifest(stack: Stack) -> dict[str, Any]:
    manifest = vllm_manifest(name=NAME, namespace=stack.namespace, hub=stack.model_hub)
    spec = manifest["spec"]
    pool = spec.pop("aggregated")
    spec["mode"] = "Disaggregated"
    spec["prefill"] = {**pool, "replicas": {"min": 1, "max": 1}}
    spec["decode"] = {**pool, "replicas": {"min": 1, "max": 1}}
    return manifest


@pytest.fixture(scope="module")
def served(vllm_stack: Stack) -> Stack:
    apply_until_ready(
        vllm_stack,
        _manifest(vllm_stack),
        timeout=READY_TIMEOUT_SECONDS,
        figure="Disaggregated vLLM InferenceService apply -> Ready",
    )
    return vllm_stack


def _pod(stack: Stack, role: contract.Role) -> Any:
    core: Any = stack.cluster.core()
    selector = f"{contract.LABEL_INSTANCE}={NAME},{contract.LABEL_COMPONENT}={role.value}"
    (pod,) = core.list_namespaced_pod(stack.namespace, label_selector=selector).items
    return pod


def _router_url(stack: Stack) -> str:
    core: Any = stack.cluster.core()
    service = core.read_namespaced_service(f"{NAME}-router", stack.namespace)
    return f"http://{service.spec.cluster_ip}:{contract.HTTP_PORT}"


def _samples(url: str, name: str) -> dict[str, float]:
    """Every sample of the series ``name`` (exactly: not ``name_created``) on the /metrics page
    at ``url``, by its full series text."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] == name
    }


def _total(url: str, name: str) -> float:
    return sum(_samples(url, name).values())


def _completion(url: str) -> tuple[str, float]:
    started = time.monotonic()
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": VLLM_SERVED_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
        timeout=300.0,
    )
    assert answer.status_code == 200, (answer.text, _samples(url, "splitserve_router_healthy_pods"))
    return str(answer.json()["choices"][0]["text"]), time.monotonic() - started


def test_prefill_and_decode_pools_run_vllm_with_the_nixl_connector(served: Stack) -> None:
    for role in (contract.Role.PREFILL, contract.Role.DECODE):
        pod = _pod(served, role)
        args = pod.spec.containers[0].args
        config = args[args.index("--kv-transfer-config") + 1]
        assert '"kv_connector":"NixlConnector"' in config and '"kv_buffer_device":"cpu"' in config, config
        assert all(status.ready for status in pod.status.container_statuses), role


def test_the_router_hands_the_prompt_from_prefill_to_decode_over_nixl(served: Stack) -> None:
    router = _router_url(served)
    prefill = f"http://{_pod(served, contract.Role.PREFILL).status.pod_ip}:{contract.HTTP_PORT}"
    decode = f"http://{_pod(served, contract.Role.DECODE).status.pod_ip}:{contract.HTTP_PORT}"

    def router_sees_both() -> dict[str, float] | None:
        healthy = _samples(router, "splitserve_router_healthy_pods")
        roles = {k: v for k, v in healthy.items() if 'upstream="prefill"' in k or 'upstream="decode"' in k}
        return roles if len(roles) == 2 and all(v == 1 for v in roles.values()) else None

    # Ready is the kubelet's view; the router's own polls may take a moment longer
    wait(served.cluster, router_sees_both, timeout=120, what="the router polling both pods healthy", interval=1.0)
    routes_before = _samples(router, "splitserve_router_routes_total")
    prefilled_before = _total(prefill, "vllm:request_success_total")
    pulled_before = _total(decode, "vllm:nixl_bytes_transferred_count")

    through_router, router_seconds = _completion(router)

    routes = _samples(router, "splitserve_router_routes_total")
    moved = {k: v - routes_before.get(k, 0.0) for k, v in routes.items() if v != routes_before.get(k, 0.0)}
    assert list(moved) and all('route="disaggregated"' in k for k in moved), moved
    assert _total(prefill, "vllm:request_success_total") > prefilled_before  # the one-token prefill

    # The KV came over NIXL: vLLM publishes its connector's transfer stats with its periodic stats.
    def pulled() -> float | None:
        count = _total(decode, "vllm:nixl_bytes_transferred_count")
        return count if count > pulled_before else None

    wait(served.cluster, pulled, timeout=60, what="the decode pod's NIXL transfer counted", interval=2.0)
    assert _total(decode, "vllm:nixl_num_failed_transfers_total") == 0

    # The same request straight to the decode pod, which computes the prompt itself.
    direct, direct_seconds = _completion(decode)
    assert through_router == direct, (through_router, direct)
    served.figures["greedy completion, 24 tokens: router (prefill -> decode) / direct to decode"] = (
        f"{router_seconds:.2f}s / {direct_seconds:.2f}s"
    )
