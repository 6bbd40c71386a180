"""``pvc://claim/path`` models: the claim is mounted read-only and served from, on the real node.

A PersistentVolume (``hostPath`` on the kubelet node: a directory holding the tiny model,
readable by the image's non-root user) is bound to a PersistentVolumeClaim ``models`` in a
namespace enforcing the ``restricted`` Pod Security level (a ``persistentVolumeClaim`` volume
is allowed there). An Aggregated InferenceService with ``spec.model.uri:
pvc://models/splitserve/tiny-llama`` becomes Ready without any hub: every pod that loads the
model (the engine, and the router for the tokenizer) has the claim as a read-only volume,
and a completion through the router is served. No download happens: the pods' logs say
nothing of one.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e import smollm2
from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, router_endpoints, wait_ready
from splitserve_e2e.stack import (
    MODEL_NAME,
    SERVED_NAME,
    ModelHub,
    ensure_model_cache,
    isvc_manifest,
    operator_namespace,
)

pytestmark = pytest.mark.e2e

CLAIM = "models"
NAME = "from-pvc"
GGUF_NAME = "gguf-fp8kv"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_TIMEOUT_SECONDS = 300.0


def _world_readable_copy(source: Path, target: Path) -> None:
    """``source`` copied to ``target`` with directories 0755 and files 0644 (the containers
    run as UID 65532; the volume shows the host's modes)."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    for directory, _, files in os.walk(target):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(Path(directory) / name, 0o644)
    for parent in (target.parent, target.parent.parent):
        os.chmod(parent, 0o755)


@pytest.fixture(scope="module")
def claim_namespace(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    """A restricted namespace with the operator and a Bound claim ``models`` holding
    ``splitserve/tiny-llama`` and ``smol/<SmolLM2 GGUF file>`` (a hostPath PersistentVolume on
    the kubelet node)."""
    volume_dir = cache_root() / f"pv-{uuid.uuid4().hex[:6]}"
    model = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
    _world_readable_copy(model, volume_dir / "splitserve" / "tiny-llama")
    smol = volume_dir / "smol"  # a real GGUF checkpoint beside it (SmolLM2-135M-Instruct, Q4_1)
    smol.mkdir(mode=0o755)
    shutil.copyfile(smollm2.gguf_path(), smol / GGUF_FILE)
    os.chmod(smol / GGUF_FILE, 0o644)
    core: Any = cluster.core()
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="pvc") as namespace:
        volume = f"{namespace}-models"
        core.create_persistent_volume(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "hostPath": {"path": str(volume_dir), "type": "Directory"},
                    "claimRef": {"namespace": namespace, "name": CLAIM},
                },
            }
        )
        try:
            core.create_namespaced_persistent_volume_claim(
                namespace,
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": {"name": CLAIM},
                    "spec": {
                        "accessModes": ["ReadOnlyMany"],
                        "storageClassName": "",
                        "volumeName": volume,
                        "resources": {"requests": {"storage": "1Gi"}},
                    },
                },
            )
            cluster.wait_for(
                lambda: core.read_namespaced_persistent_volume_claim(CLAIM, namespace).status.phase == "Bound",
                timeout_seconds=60,
                what=f"claim {CLAIM} Bound (the controller manager's binder)",
            )
            yield namespace
        finally:
            core.delete_persistent_volume(volume)
            shutil.rmtree(volume_dir, ignore_errors=True)


def test_model_from_a_claim_is_mounted_read_only_and_served(
    cluster: LocalCluster, claim_namespace: str, model_hub: ModelHub
) -> None:
    namespace = claim_namespace
    manifest = isvc_manifest(name=NAME, namespace=namespace, mode="Aggregated", hub=model_hub)
    model = manifest["spec"]["model"]
    for key in ("hubEndpoint", "hubTokenSecretRef"):
        model.pop(key)
    model["uri"] = f"pvc://{CLAIM}/{MODEL_NAME}"
    manifest["spec"]["autoscaling"]["enabled"] = False
    started = time.monotonic()
    apply_object(cluster=cluster, obj=manifest)
    wait_ready(cluster=cluster, namespace=namespace, name=NAME, timeout_seconds=READY_TIMEOUT_SECONDS)
    print(f"\n{NAME} Ready {time.monotonic() - started:.1f}s after apply (model from the claim)")

    core: Any = cluster.core()
    pods = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_INSTANCE}={NAME}").items
    roles = sorted(str(p.metadata.labels.get(contract.LABEL_COMPONENT)) for p in pods)
    assert roles == [contract.Role.AGGREGATED.value, "router"], roles
    for pod in pods:  # the engine loads the weights, the router the tokenizer: both mount it
        claims = [v for v in pod.spec.volumes if v.persistent_volume_claim is not None]
        assert [(v.persistent_volume_claim.claim_name, v.persistent_volume_claim.read_only) for v in claims] == [
            (CLAIM, True)
        ], pod.metadata.name
        mounts = [m for c in pod.spec.containers for m in c.volume_mounts or [] if m.name == claims[0].name]
        assert mounts and all(m.read_only for m in mounts), mounts
        log = cluster.pod_log(namespace=namespace, pod=pod.metadata.name)
        assert "downloaded " not in log, log[-2000:]

    router = router_endpoints(cluster=cluster, namespace=namespace, name=NAME)[0]
    response = httpx.post(
        f"http://{router}/v1/completions",
        timeout=60,
        json={"model": SERVED_NAME, "prompt": "A claim holds the weights", "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_a_gguf_file_on_a_claim_serves_with_int4_weights_and_an_fp8_kv_cache(
    cluster: LocalCluster, claim_namespace: str, model_hub: ModelHub
) -> None:
    """A real GGUF checkpoint (SmolLM2-135M-Instruct, Q4_1) named by ``pvc://`` and served with
    ``kvCache.dtype: fp8``: the engine reads the config and tokenizer from the file's metadata
    (a sidecar in its model cache; the claim is read-only), keeps the Q4_1 projections as int4,
    and the router tokenizes from the same file. The answer is the model's, not noise."""
    namespace = claim_namespace
    manifest = isvc_manifest(name=GGUF_NAME, namespace=namespace, mode="Aggregated", hub=model_hub, cpu="1")
    spec = manifest["spec"]
    for key in ("hubEndpoint", "hubTokenSecretRef"):
        spec["model"].pop(key)
    spec["model"]["uri"] = f"pvc://{CLAIM}/smol/{GGUF_FILE}"
    spec["model"]["maxModelLen"] = 512
    spec["kvCache"] = {"dtype": "fp8"}
    spec["aggregated"]["resources"]["memory"] = "1536Mi"
    spec["autoscaling"]["enabled"] = False
    started = time.monotonic()
    apply_object(cluster=cluster, obj=manifest)
    wait_ready(cluster=cluster, namespace=namespace, name=GGUF_NAME, timeout_seconds=READY_TIMEOUT_SECONDS)
    print(f"\n{GGUF_NAME} Ready {time.monotonic() - started:.1f}s after apply (GGUF from the claim)")
    core: Any = cluster.core()
    pods = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_INSTANCE}={GGUF_NAME}").items
    engine = next(p for p in pods if p.metadata.labels.get(contract.LABEL_COMPONENT) == contract.Role.AGGREGATED.value)
    log = cluster.pod_log(namespace=namespace, pod=engine.metadata.name)
    assert "kept as int4 (group 32): 210 Q4_1" in log, log[-3000:]
    router = router_endpoints(cluster=cluster, namespace=namespace, name=GGUF_NAME)[0]
    response = httpx.post(
        f"http://{router}/v1/chat/completions",
        timeout=120,
        json={
            "model": SERVED_NAME,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        },
    )
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"], response.json()
