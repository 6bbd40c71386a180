"""Fake GPU nodes, simulated by kwok.

Scale and GPU-scheduling tests need many ``nvidia.com/gpu`` nodes but no real processes. kwok
(Kubernetes WithOut Kubelet) keeps Node objects alive (heartbeat Leases, Ready condition) and
moves pods bound to them through their lifecycle as its Stage configuration says; kwok 0.8 has
no built-in stages, so the build step writes the "fast" stage set of the pinned kwok release
(pods become Running and Ready at once, with a fake IP from ``POD_CIDR``).

kwok only manages nodes labelled ``type=kwok``; the nodes carry kwok's usual
``kwok.x-k8s.io/node=fake:NoSchedule`` taint, so only pods that tolerate it land there and the
project's real pods go to the kubelet node instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client as k8s

from splitserve_e2e.net import LOOPBACK, free_port
from splitserve_e2e.process import ManagedProcess, start_process, wait_until

KWOK_NODE_LABEL = "type"
KWOK_NODE_LABEL_VALUE = "kwok"
KWOK_TAINT_KEY = "kwok.x-k8s.io/node"
KWOK_TAINT_VALUE = "fake"
GPU_RESOURCE = "nvidia.com/gpu"
NODE_LEASE_SECONDS = 40
"""kwok renews each node's Lease in ``kube-node-lease`` (every quarter of this, like a kubelet).
Without it (kwok leaves leases off when ``--config`` names only stages) a node's only heartbeat
is the 10-minute status stage, so the node-lifecycle controller marks the node NotReady every
~50 s, and with it every Running pod there NotReady; kwok's stages never make a Running pod Ready
again, so a pool that happened to start just before such a flip stayed unready for good."""
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
POD_CIDR = "10.244.0.0/16"


@dataclasses.dataclass(frozen=True)
class GpuNodeShape:
    """What one fake GPU node offers."""

    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H200"
    cpu_cores: int = 96
    memory: str = "1024Gi"
    max_pods: int = 110


def kwok_toleration() -> dict[str, str]:
    """The toleration a pod needs to be scheduled onto a kwok node."""
    return {"key": KWOK_TAINT_KEY, "operator": "Equal", "value": KWOK_TAINT_VALUE, "effect": "NoSchedule"}


def gpu_node_manifest(*, name: str, shape: GpuNodeShape) -> dict[str, Any]:
    """A Node object for kwok to manage."""
    resources = {
        "cpu": str(shape.cpu_cores),
        "memory": shape.memory,
        "pods": str(shape.max_pods),
        GPU_RESOURCE: str(shape.gpus_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE,
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node-role.kubernetes.io/agent": "",
                GPU_PRODUCT_LABEL: shape.gpu_product,
                GPU_COUNT_LABEL: str(shape.gpus_per_node),
            },
        },
        "spec": {"taints": [{"key": KWOK_TAINT_KEY, "value": KWOK_TAINT_VALUE, "effect": "NoSchedule"}]},
        "status": {"capacity": resources, "allocatable": resources},
    }


@dataclasses.dataclass
class Kwok:
    process: ManagedProcess
    health_url: str


def start_kwok(
    *, binary: Path, stages: Path, kubeconfig: Path, log_dir: Path, pid_dir: Path, timeout_seconds: float = 60.0
) -> Kwok:
    """Start kwok managing the ``type=kwok`` nodes and wait for its health endpoint."""
    port = free_port()
    argv = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--config={stages}",  # also keeps the user's ~/.kwok/kwok.yaml out
        f"--manage-nodes-with-label-selector={KWOK_NODE_LABEL}={KWOK_NODE_LABEL_VALUE}",
        f"--cidr={POD_CIDR}",
        f"--node-ip={LOOPBACK}",
        f"--server-address={LOOPBACK}:{port}",
        f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
    ]
    process = start_process(name="kwok", argv=argv, log_path=log_dir / "kwok.log", pid_dir=pid_dir)
    health_url = f"http://{LOOPBACK}:{port}/healthz"
    wait_until(
        lambda: httpx.get(health_url, timeout=1.0).status_code == 200,
        timeout_seconds=timeout_seconds,
        what="kwok /healthz",
        alive=process,
    )
    return Kwok(process=process, health_url=health_url)


def create_gpu_nodes(
    *, core: k8s.CoreV1Api, count: int, shape: GpuNodeShape, name_prefix: str = "kwok-gpu-"
) -> list[str]:
    """Create ``count`` fake GPU nodes (``<prefix>0`` ...) and return their names."""
    if count < 0:
        raise ValueError(f"num_gpu_nodes must be >= 0, got {count}")
    names = [f"{name_prefix}{index}" for index in range(count)]
    for name in names:
        manifest: Any = gpu_node_manifest(name=name, shape=shape)  # the client takes dicts
        core.create_node(manifest)
    return names


def node_ready(node: k8s.V1Node) -> bool:
    conditions = (node.status.conditions if node.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)
