"""hf:// models reach pods from a hub, as in production, and a refused token shows in status.

A :class:`~splitserve_e2e.hub.LocalHub` on 127.0.0.1 (the local node runs pods as host
processes, so they reach it) serves the tiny model as ``org/tiny`` and requires a token. Two
Aggregated InferenceServices point ``spec.model.hubEndpoint`` at it, each with
``hubTokenSecretRef``: with the right token the pods (engine and router, each with its own
emptyDir model cache) download the model and the service becomes Ready and answers a
completion; with a wrong token the pod's termination message becomes Ready=False,
ModelUnavailable, with "HTTP 401" and the Secret's name in the message.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from splitserve_contract import ConditionType, Reason
from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import (
    MODEL_NAME,
    RELEASE,
    SERVED_NAME,
    apply_object,
    condition,
    ensure_model_cache,
    get_isvc,
    install_operator,
    isvc_manifest,
    pod_summary,
    remove_demo,
    router_endpoints,
    wait_ready,
)
from splitserve_e2e.hub import LocalHub

pytestmark = pytest.mark.e2e

TOKEN = "hf_e2e_right_token"
REPO = "org/tiny"
GOOD, BAD = "hub-ok", "hub-bad-token"
TIMEOUT_SECONDS = 300.0


def _secret(cluster: LocalCluster, namespace: str, name: str, token: str) -> None:
    core: Any = cluster.core()
    core.create_namespaced_secret(namespace, {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
        "data": {"HF_TOKEN": base64.b64encode(token.encode()).decode()}})


def _manifest(*, name: str, namespace: str, endpoint: str, secret: str) -> dict[str, object]:
    manifest = isvc_manifest(name=name, namespace=namespace, mode="Aggregated", model_cache=Path("/unused"))
    spec = manifest["spec"]
    spec["model"].update({"uri": f"hf://{REPO}", "hubEndpoint": endpoint,
                          "hubTokenSecretRef": {"name": secret}})
    # The operator's default cache (an emptyDir per pod), not a host directory; and downloads
    # on even if the test session's environment, which pods inherit, turned them off.
    spec["runtime"]["env"] = [{"name": "HF_HUB_OFFLINE", "value": "0"}]
    spec["autoscaling"]["enabled"] = False
    return manifest


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHub]:
    model = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
    with LocalHub(tmp_path_factory.mktemp("hub"), token=TOKEN) as running:
        running.publish(REPO, model, extra_files={"pytorch_model.bin": b"\0" * 4096})
        yield running


@pytest.fixture(scope="module")
def namespace(cluster: LocalCluster, hub: LocalHub) -> Iterator[str]:
    name = f"hub-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    try:
        install_operator(cluster=cluster, namespace=name,
                         prometheus_url=cluster.prometheus_url or "http://127.0.0.1:9")
        _secret(cluster, name, "hf-token", TOKEN)
        _secret(cluster, name, "hf-wrong", "hf_not_the_token")
        for isvc, secret in ((GOOD, "hf-token"), (BAD, "hf-wrong")):
            apply_object(cluster=cluster, obj=_manifest(name=isvc, namespace=name, endpoint=hub.endpoint,
                                                        secret=secret))
        yield name
    finally:
        remove_demo(cluster=cluster, namespace=name, release=RELEASE)


def test_model_is_downloaded_from_the_hub_and_served(namespace: str, cluster: LocalCluster, hub: LocalHub) -> None:
    started = time.monotonic()
    wait_ready(cluster=cluster, namespace=namespace, name=GOOD, timeout_seconds=TIMEOUT_SECONDS)
    print(f"\n{GOOD} Ready {time.monotonic() - started:.1f}s after the namespace was set up")
    router = router_endpoints(cluster=cluster, namespace=namespace, name=GOOD)[0]
    url = router if router.startswith("http") else f"http://{router}"
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": SERVED_NAME, "prompt": "The operator watches", "max_tokens": 4, "temperature": 0})
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
        pytest.fail(f"no {Reason.MODEL_UNAVAILABLE} within {TIMEOUT_SECONDS:.0f}s; Ready={seen}\n"
                    f"{pod_summary(cluster=cluster, namespace=namespace)}")
    message = str(seen["message"])
    print(f"\n{BAD} Ready condition: {message}")
    assert seen["status"] == "False"
    assert "HTTP 401" in message and "Secret hf-wrong, key HF_TOKEN" in message, message
