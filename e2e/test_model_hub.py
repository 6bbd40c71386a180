"""hf:// models reach pods from a hub, as in production, and a refused token shows in status.

A :class:`~splitserve_e2e.hub.LocalHub` on the kubelet node's bridge gateway (where the pods
reach it) serves the tiny model as ``org/tiny`` and requires its own token. Two
Aggregated InferenceServices point ``spec.model.hubEndpoint`` at it, each with
``hubTokenSecretRef``: with the right token the pods (engine and router, each with its own
emptyDir model cache) download the model and the service becomes Ready and answers a
completion; with a wrong token the pod's termination message becomes Ready=False,
ModelUnavailable, with "HTTP 401" and the Secret's name in the message.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from splitserve_contract import ConditionType, Reason
from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import (
    apply_object,
    condition,
    get_isvc,
    pod_summary,
    router_endpoints,
    wait_ready,
)
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.net import LOOPBACK
from splitserve_e2e.stack import (
    MODEL_NAME,
    SERVED_NAME,
    ModelHub,
    ensure_model_cache,
    isvc_manifest,
    operator_namespace,
)

pytestmark = pytest.mark.e2e

TOKEN = "hf_e2e_right_token"
REPO = "org/tiny"
GOOD, BAD = "hub-ok", "hub-bad-token"
TIMEOUT_SECONDS = 300.0


def _secret(cluster: LocalCluster, namespace: str, name: str, token: str) -> None:
    core: Any = cluster.core()
    core.create_namespaced_secret(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "data": {"HF_TOKEN": base64.b64encode(token.encode()).decode()},
        },
    )


def _manifest(*, name: str, namespace: str, hub: LocalHub, secret: str) -> dict[str, object]:
    """The tiny Aggregated service with the operator's default model cache (an emptyDir per
    pod), its model ``hf://org/tiny`` from ``hub`` with the token in Secret ``secret``."""
    manifest = isvc_manifest(
        name=name,
        namespace=namespace,
        mode="Aggregated",
        hub=ModelHub(endpoint=hub.endpoint, token="", token_secret=secret),
    )
    spec = manifest["spec"]
    spec["model"]["uri"] = f"hf://{REPO}"
    spec["autoscaling"]["enabled"] = False
    return manifest


@pytest.fixture(scope="module")
def hub(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHub]:
    model = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
    with LocalHub(tmp_path_factory.mktemp("hub"), token=TOKEN, host=cluster.pod_gateway or LOOPBACK) as running:
        running.publish(REPO, model, extra_files={"pytorch_model.bin": b"\0" * 4096})
        yield running


@pytest.fixture(scope="module")
def namespace(cluster: LocalCluster, image: str, model_hub: ModelHub, hub: LocalHub) -> Iterator[str]:
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="hub") as name:
        _secret(cluster, name, "hf-token", TOKEN)
        _secret(cluster, name, "hf-wrong", "hf_not_the_token")
        for isvc, secret in ((GOOD, "hf-token"), (BAD, "hf-wrong")):
            apply_object(cluster=cluster, obj=_manifest(name=isvc, namespace=name, hub=hub, secret=secret))
        yield name


def test_model_is_downloaded_from_the_hub_and_served(namespace: str, cluster: LocalCluster, hub: LocalHub) -> None:
    started = time.monotonic()
    wait_ready(cluster=cluster, namespace=namespace, name=GOOD, timeout_seconds=TIMEOUT_SECONDS)
    print(f"\n{GOOD} Ready {time.monotonic() - started:.1f}s after the namespace was set up")
    router = router_endpoints(cluster=cluster, namespace=namespace, name=GOOD)[0]
    url = router if router.startswith("http") else f"http://{router}"
    response = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": SERVED_NAME, "prompt": "The operator watches", "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    fetched = hub.downloaded(REPO)
    assert "config.json" in fetched and "model.safetensors" in fetched, fetched
    assert "pytorch_model.bin" not in fetched


def test_a_refused_token_is_reported_as_model_unavailable(namespace: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    seen: dict[str, object] = {}
    while time.monotonic() < deadline:
        seen = condition(get_isvc(cluster=cluster, namespace=namespace, name=BAD), ConditionType.READY) or {}
        if seen.get("reason") == Reason.MODEL_UNAVAILABLE:
            break
        time.sleep(1.0)
    else:
        pytest.fail(
            f"no {Reason.MODEL_UNAVAILABLE} within {TIMEOUT_SECONDS:.0f}s; Ready={seen}\n"
            f"{pod_summary(cluster=cluster, namespace=namespace)}"
        )
    message = str(seen["message"])
    print(f"\n{BAD} Ready condition: {message}")
    assert seen["status"] == "False"
    assert "HTTP 401" in message and "Secret hf-wrong, key HF_TOKEN" in message, message
