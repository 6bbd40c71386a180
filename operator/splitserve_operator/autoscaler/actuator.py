"""The autoscaler's only writes to workloads: a pool Deployment's ``spec.replicas`` (or a
multi-node pool's LeaderWorkerSet's: its number of groups), and the pod-deletion-cost
annotations that pick which pods a scale-down removes.

Replica ownership (docs/architecture.md, "Children and field ownership"): ``spec.replicas`` of a pool workload is owned by
the field manager :data:`~splitserve_contract.FIELD_MANAGER_AUTOSCALER`. We write it
with server-side apply carrying nothing but ``apiVersion``, ``kind``, ``metadata.name`` and
``spec.replicas``, so the apply can never touch a field the reconciler owns, and the
reconciler's applies (which omit replicas) never reset it. ``force`` takes the field over
if someone else (``kubectl scale``) grabbed it meanwhile: the autoscaler is its owner. The
same apply works for both kinds: a LeaderWorkerSet's ``spec.replicas`` is what its scale
subresource scales.

Scale-down victims: the ReplicaSet controller removes unscheduled, Pending and not-ready pods
first, then, among Ready pods, the ones with the lowest
``controller.kubernetes.io/pod-deletion-cost``. Before shrinking we therefore annotate every
Ready pod with a cost proportional to its requests in flight (running + waiting, from
Prometheus), so idle pods go first and long generations keep running. Pods are patched only
when their cost changed. A LeaderWorkerSet removes its highest-numbered groups whatever their
pods' costs, so pods of one are never annotated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from splitserve_contract import ANNOTATION_POD_DELETION_COST, FIELD_MANAGER_AUTOSCALER

from .. import kube, leader_worker_set

COST_PER_REQUEST: Final = 100
"""Deletion cost of one request in flight (leaves room to rank fractional averages)."""
MAX_DELETION_COST: Final = 2**31 - 1
"""The annotation is an int32."""


def replicas_apply_patch(
    *, namespace: str, deployment: str, replicas: int, kind: kube.Kind = kube.DEPLOYMENT
) -> dict[str, Any]:
    """The whole server-side apply body the autoscaler sends (``deployment``: the name of the
    pool's workload, of ``kind``)."""
    return {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": {"name": deployment, "namespace": namespace},
        "spec": {"replicas": replicas},
    }


def workload_kind(*, api: kube.Kube, namespace: str, name: str) -> kube.Kind:
    """The kind of the pool workload ``name``: the Deployment when there is one, else the
    LeaderWorkerSet (a multi-node pool)."""
    if api.get(kind=kube.DEPLOYMENT, namespace=namespace, name=name) is not None:
        return kube.DEPLOYMENT
    return kube.LEADER_WORKER_SET


def apply_replicas(
    *, api: kube.Kube, namespace: str, deployment: str, replicas: int, kind: kube.Kind | None = None
) -> None:
    """Set ``spec.replicas`` of the pool workload ``deployment`` as the autoscaler's field
    manager. ``kind``: the workload's (:attr:`.observe.PoolObservation.kind`); None: looked up
    (:func:`workload_kind`)."""
    if kind is None:
        kind = workload_kind(api=api, namespace=namespace, name=deployment)
    if kind not in (kube.DEPLOYMENT, kube.LEADER_WORKER_SET):
        raise ValueError(f"{kind.kind} is not a pool workload")
    api.apply(
        obj=replicas_apply_patch(namespace=namespace, deployment=deployment, replicas=replicas, kind=kind),
        field_manager=FIELD_MANAGER_AUTOSCALER,
        force=True,
    )


def clamp_replicas(
    *, api: kube.Kube, namespace: str, name: str, min_replicas: int, max_replicas: int
) -> tuple[int, int] | None:
    """Bring ``spec.replicas`` of the pool workload ``name`` (Deployment, else LeaderWorkerSet)
    into ``[min_replicas, max_replicas]`` as the autoscaler's field manager: the one write to
    a pool's replicas while autoscaling is off (a count inside the bounds stays the user's,
    ``kubectl scale`` included). Returns ``(before, after)`` when it wrote, None when the count
    was within the bounds or there is no workload yet."""
    kind = kube.DEPLOYMENT
    workload = api.get(kind=kind, namespace=namespace, name=name)
    if workload is None:
        kind = kube.LEADER_WORKER_SET
        workload = api.get(kind=kind, namespace=namespace, name=name)
    if workload is None:
        return None  # not created yet: the reconciler creates it with min replicas
    raw = (workload.get("spec") or {}).get("replicas")
    before = int(raw) if raw is not None else 1
    after = max(min_replicas, min(max_replicas, before))
    if after == before:
        return None
    apply_replicas(api=api, namespace=namespace, deployment=name, replicas=after, kind=kind)
    return before, after


def deletion_cost(*, requests_in_flight: float) -> int:
    """Cost annotation for a pod with this many requests running or waiting."""
    return max(0, min(MAX_DELETION_COST, round(requests_in_flight * COST_PER_REQUEST)))


def annotate_deletion_costs(
    *, api: kube.Kube, namespace: str, pods: Sequence[Mapping[str, Any]], load_by_pod: Mapping[str, float]
) -> list[str]:
    """Annotate ``pods`` (the Ready pods of the shrinking pool) with their deletion cost;
    a pod Prometheus has no value for is idle (cost 0). Returns the names patched."""
    patched = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if leader_worker_set.SET_NAME_LABEL in (meta.get("labels") or {}):
            continue  # a LeaderWorkerSet's scale-down ignores the cost (see the module docstring)
        name = str(meta.get("name"))
        cost = str(deletion_cost(requests_in_flight=load_by_pod.get(name, 0.0)))
        if (meta.get("annotations") or {}).get(ANNOTATION_POD_DELETION_COST) == cost:
            continue
        api.merge_patch(
            kind=kube.POD,
            namespace=namespace,
            name=name,
            patch={"metadata": {"annotations": {ANNOTATION_POD_DELETION_COST: cost}}},
            field_manager=FIELD_MANAGER_AUTOSCALER,
        )
        patched.append(name)
    return patched
