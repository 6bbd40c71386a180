"""Whether the cluster's nodes can hold a pool's GPU pods: a pure check over node objects.

The operator still applies a pool that does not fit (capacity may be on its way: a cluster
autoscaler, a node coming back); it only reports the gap as a condition and an Event. The
check is deliberately coarse: per pool, how many pods of ``gpus`` GPUs fit into the
allocatable ``nvidia.com/gpu`` of the schedulable nodes whose labels match the pool's
nodeSelector and whose NoSchedule/NoExecute taints the pool tolerates. Other workloads'
usage is the scheduler's business (their pods would show up as Pending, which
:func:`unschedulable_gpu_pods` reports).

A pool whose constraints match no node at all is not a GPU shortfall: the scheduler says what
keeps its pods off the nodes (a nodeSelector or affinity no node matches, an untolerated taint),
and :mod:`failures` relays those words. Likewise a Pending pod counts as short of GPUs only
when the scheduler names ``nvidia.com/gpu`` as the only resource it lacks
(:func:`lacks_only_gpus`): "1 Insufficient nvidia.com/gpu, 2 Insufficient memory" says a node
without GPUs was passed over while the GPU nodes lack memory.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

GPU_RESOURCE = "nvidia.com/gpu"
_INSUFFICIENT: Final = re.compile(r"Insufficient ([A-Za-z0-9][A-Za-z0-9./_-]*[A-Za-z0-9])")
"""A scheduler's "N Insufficient <resource>" (NodeResourcesFit); the resource is group 1."""


@dataclasses.dataclass(frozen=True)
class Shortfall:
    pool: str
    pods: int
    gpus_per_pod: int
    fitting_pods: int
    matching_nodes: int

    def message(self) -> str:
        return (
            f"{self.pool} needs {self.pods} pod(s) with {self.gpus_per_pod} {GPU_RESOURCE} each; "
            f"the {self.matching_nodes} matching node(s) have allocatable GPUs for {self.fitting_pods}"
        )


def _quantity_int(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def tolerates(*, tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for tol in tolerations:
        effect = tol.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        operator = tol.get("operator", "Equal")
        key = tol.get("key")
        if operator == "Exists":
            if not key or key == taint.get("key"):
                return True
        elif key == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def node_is_eligible(
    *, node: Mapping[str, Any], node_selector: Mapping[str, str], tolerations: Sequence[Mapping[str, Any]]
) -> bool:
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return False
    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in node_selector.items()):
        return False
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations=tolerations, taint=taint):
            return False
    return True


def gpu_shortfall(
    *,
    pool: str,
    pods: int,
    gpus_per_pod: int,
    node_selector: Mapping[str, str],
    tolerations: Sequence[Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]],
) -> Shortfall | None:
    """None when ``pods`` pods of ``gpus_per_pod`` GPUs fit into the eligible nodes."""
    if gpus_per_pod <= 0 or pods <= 0:
        return None
    eligible = [n for n in nodes if node_is_eligible(node=n, node_selector=node_selector, tolerations=tolerations)]
    fitting = sum(
        _quantity_int(((n.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0)) // gpus_per_pod
        for n in eligible
    )
    if fitting >= pods or not eligible:
        return None
    return Shortfall(
        pool=pool, pods=pods, gpus_per_pod=gpus_per_pod, fitting_pods=fitting, matching_nodes=len(eligible)
    )


def scheduling_failure(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message for a Pending pod it could not place (``PodScheduled=False``,
    reason ``Unschedulable``); None for any other pod."""
    status = pod.get("status") or {}
    if status.get("phase") != "Pending":
        return None
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return str(cond.get("message") or "")
    return None


def lacks_only_gpus(message: str) -> bool:
    """Whether a scheduler's message names :data:`GPU_RESOURCE` as the only resource the nodes
    lack (the part before its "preemption:" verdict, which repeats the counts)."""
    placement = message.split("preemption:", 1)[0]
    return set(_INSUFFICIENT.findall(placement)) == {GPU_RESOURCE}


def unschedulable_gpu_pods(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names of Pending pods the scheduler could not place for lack of GPUs alone."""
    out = []
    for pod in pods:
        message = scheduling_failure(pod)
        if message is not None and lacks_only_gpus(message):
            out.append(str(pod["metadata"]["name"]))
    return out
