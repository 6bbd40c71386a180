"""What a pool is right now: its Deployment's replica count and its pods, classified.

A pod counts as capacity only when it is Ready and not terminating. Pods Pending because
the scheduler found no node with enough ``nvidia.com/gpu`` are counted separately (the
decision must neither treat them as capacity nor keep adding more of them); every other
pod that is not Ready (pulling, loading weights) is "starting": requested capacity that is
on its way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .. import capacity, kube, naming


@dataclasses.dataclass(frozen=True)
class PoolObservation:
    pool: str
    deployment: str
    current_replicas: int
    """The Deployment's spec.replicas."""
    ready_pods: tuple[dict[str, Any], ...]
    pending_for_gpus: tuple[str, ...]
    starting: int

    @property
    def ready_replicas(self) -> int:
        return len(self.ready_pods)

    @property
    def ready_pod_names(self) -> list[str]:
        return [str(p["metadata"]["name"]) for p in self.ready_pods]


def is_ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


def classify(*, pool: str, deployment: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> PoolObservation:
    """Classify a pool's pods (see the module docstring); terminating pods are ignored."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    ready = tuple(dict(p) for p in live if is_ready(p))
    pending = tuple(capacity.unschedulable_gpu_pods(live))
    replicas = (deployment.get("spec") or {}).get("replicas")
    return PoolObservation(
        pool=pool,
        deployment=str(deployment["metadata"]["name"]),
        current_replicas=int(replicas) if replicas is not None else 1,
        ready_pods=ready,
        pending_for_gpus=pending,
        starting=len(live) - len(ready) - len(pending),
    )


def observe_pool(*, api: kube.Kube, namespace: str, name: str, pool: str) -> PoolObservation | None:
    """Read one pool's Deployment and pods; None while the Deployment does not exist."""
    deployment_name = naming.child_name(name, pool)
    deployment = api.get(kind=kube.DEPLOYMENT, namespace=namespace, name=deployment_name)
    if deployment is None:
        return None
    selector = ",".join(f"{k}={v}" for k, v in sorted(naming.selector_labels(name, pool).items()))
    pods = api.list(kind=kube.POD, namespace=namespace, label_selector=selector)
    return classify(pool=pool, deployment=deployment, pods=pods)
