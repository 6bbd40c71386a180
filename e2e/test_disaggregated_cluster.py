"""Disaggregated serving end to end on the local control plane.

The chart's operator (a container from the image, under its own ServiceAccount) turns a
Disaggregated InferenceService with the tiny model (``hf://`` from the session's hub) into
prefill, decode and router containers on the kubelet node, in a namespace enforcing the
``restricted`` Pod Security level. A client talks to the router's pod through the Service's endpoints, exactly as a user
would through the Service: the router discovers the pools from EndpointSlices, the prompt is
prefilled on the prefill pod, its KV pulled by the decode pod over the KV port, and the answer
streamed back. The same request sent straight to the decode pod (computed locally there) must
give the same greedy text, which proves the handed-over KV was right.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, router_endpoints, wait_ready
from splitserve_e2e.stack import SERVED_NAME, ModelHub, isvc_manifest, operator_namespace

pytestmark = pytest.mark.e2e

NAME = "disagg"
PROMPT = (
    "The operator renders prefill and decode pools; the router sends each prompt to the pod "
    "whose prefix cache already holds it, and the decode pod pulls the KV blocks it lacks."
)


def _url(endpoint: str) -> str:
    return endpoint if endpoint.startswith("http") else f"http://{endpoint}"


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture(scope="module")
def served(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[tuple[str, str]]:
    """(namespace, router URL) of a Ready Disaggregated InferenceService."""
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="disagg") as namespace:
        manifest = isvc_manifest(name=NAME, namespace=namespace, mode="Disaggregated", hub=model_hub)
        manifest["spec"]["autoscaling"]["enabled"] = False
        apply_object(cluster=cluster, obj=manifest)
        wait_ready(cluster=cluster, namespace=namespace, name=NAME, timeout_seconds=300)
        routers = router_endpoints(cluster=cluster, namespace=namespace, name=NAME)
        yield namespace, _url(routers[0])


def test_status_reports_both_pools_ready(served: tuple[str, str], cluster: LocalCluster) -> None:
    namespace, _ = served
    out = cluster.kubectl(
        "get",
        f"{contract.PLURAL}.{contract.API_GROUP}",
        NAME,
        "-n",
        namespace,
        "-o",
        "jsonpath={.status.prefill.readyReplicas}/{.status.decode.readyReplicas}",
    )
    assert out.stdout.strip() == "1/1"


def test_request_through_router_is_prefilled_transferred_and_decoded(
    served: tuple[str, str],
    cluster: LocalCluster,
) -> None:
    namespace, router_url = served
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", timeout=60, max_retries=0)
    before = httpx.get(f"{router_url}/metrics", timeout=5).text

    completion = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    after = httpx.get(f"{router_url}/metrics", timeout=5).text
    routed = "splitserve_router_routes_total"
    assert _counter(after, routed, route="disaggregated") - _counter(before, routed, route="disaggregated") == 2

    decode_pods = cluster.endpoints_of(namespace=namespace, service=f"{NAME}-decode", port_name=contract.HTTP_PORT_NAME)
    prefill_pods = cluster.endpoints_of(
        namespace=namespace, service=f"{NAME}-prefill", port_name=contract.HTTP_PORT_NAME
    )
    decode_metrics = httpx.get(f"{_url(decode_pods[0])}/metrics", timeout=5).text
    assert _counter(decode_metrics, contract.Metric.KV_TRANSFER_BYTES_TOTAL) > 0
    prefill_metrics = httpx.get(f"{_url(prefill_pods[0])}/metrics", timeout=5).text
    assert _counter(prefill_metrics, contract.Metric.PROMPT_TOKENS_TOTAL) > 0

    # The same requests computed entirely on the decode pod: identical greedy text.
    direct = openai.OpenAI(base_url=f"{_url(decode_pods[0])}/v1", api_key="unused", timeout=60, max_retries=0)
    local = direct.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert completion.choices[0].text == local.choices[0].text
    local_chat = direct.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        temperature=0,
    )
    assert streamed == local_chat.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens >= 1
