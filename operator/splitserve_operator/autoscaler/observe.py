"""What a pool is right now: its workload's replica count and its pods, classified.

A pod counts as capacity only when it is Ready and not terminating. Pods Pending because
the scheduler found no node with enough ``nvidia.com/gpu`` are counted separately (the
decision must neither treat them as capacity nor keep adding more of them); every other
pod that is not Ready (pulling, loading weights) is "starting": requested capacity that is
on its way.

A pool whose replicas span several nodes is a LeaderWorkerSet (:mod:`..leader_worker_set`)
and a replica is a *group* of pods: a group is capacity when all its pods are Ready (its
leader, the pod that serves and exports the metrics, stands for it), pending for GPUs when
any of its pods is, and starting otherwise. Replicas are groups throughout, so the decision's
arithmetic (and ``gpus`` per replica in the GPU budget) is the same for both kinds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .. import capacity, kube, leader_worker_set, naming


@dataclasses.dataclass(frozen=True)
class PoolObservation:
    pool: str
    deployment: str
    """The name of the pool's workload (Deployment or LeaderWorkerSet)."""
    current_replicas: int
    """The workload's spec.replicas."""
    ready_pods: tuple[dict[str, Any], ...]
    """Ready pods; of a LeaderWorkerSet, the leaders of the ready groups."""
    pending_for_gpus: tuple[str, ...]
    """Pods (of a LeaderWorkerSet: group leaders' names) waiting for GPUs."""
    starting: int
    kind: kube.Kind = kube.DEPLOYMENT
    """The workload's kind: what :func:`..actuator.apply_replicas` scales."""

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


def _spec_replicas(workload: Mapping[str, Any]) -> int:
    replicas = (workload.get("spec") or {}).get("replicas")
    return int(replicas) if replicas is not None else 1


def classify(*, pool: str, deployment: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> PoolObservation:
    """Classify a pool's pods (see the module docstring); terminating pods are ignored."""
    if leader_worker_set.is_leader_worker_set(deployment):
        return classify_groups(pool=pool, lws=deployment, pods=pods)
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    ready = tuple(dict(p) for p in live if is_ready(p))
    pending = tuple(capacity.unschedulable_gpu_pods(live))
    return PoolObservation(
        pool=pool,
        deployment=str(deployment["metadata"]["name"]),
        current_replicas=_spec_replicas(deployment),
        ready_pods=ready,
        pending_for_gpus=pending,
        starting=len(live) - len(ready) - len(pending),
    )


def classify_groups(*, pool: str, lws: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> PoolObservation:
    """Classify a LeaderWorkerSet's groups (see the module docstring): replicas are groups."""
    size = leader_worker_set.size_of(lws)
    ready: list[dict[str, Any]] = []
    pending: list[str] = []
    starting = 0
    for group in leader_worker_set.groups(pods):
        leader = group.leader
        name = str((leader or group.pods[0])["metadata"]["name"])
        if group.ready(size) and leader is not None:
            ready.append(leader)
        elif group.pending_for_gpus():
            pending.append(name)
        else:
            starting += 1
    return PoolObservation(
        pool=pool,
        deployment=str(lws["metadata"]["name"]),
        current_replicas=_spec_replicas(lws),
        ready_pods=tuple(ready),
        pending_for_gpus=tuple(pending),
        starting=starting,
        kind=kube.LEADER_WORKER_SET,
    )


def observe_pool(*, api: kube.Kube, namespace: str, name: str, pool: str) -> PoolObservation | None:
    """Read one pool's workload and pods; None while there is no workload. The Deployment is
    read first; a pool without one may be a LeaderWorkerSet (a multi-node pool), which is
    read only then (404 as well on a cluster without the LWS CRD)."""
    workload_name = naming.child_name(name, pool)
    workload = api.get(kind=kube.DEPLOYMENT, namespace=namespace, name=workload_name)
    if workload is None:
        workload = api.get(kind=kube.LEADER_WORKER_SET, namespace=namespace, name=workload_name)
    if workload is None:
        return None
    selector = ",".join(f"{k}={v}" for k, v in sorted(naming.selector_labels(name, pool).items()))
    pods = api.list(kind=kube.POD, namespace=namespace, label_selector=selector)
    return classify(pool=pool, deployment=workload, pods=pods)
