"""Pools whose replicas span several nodes: what the operator needs to know about LeaderWorkerSets.

A replica bigger than one node (``resources.gpusPerNode`` smaller than ``resources.gpus``) is a
*group* of ``gpus / gpusPerNode`` pods, one per node, holding the tensor x pipeline ranks between
them. Such a pool is rendered as a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``,
``sigs.k8s.io/lws``; :mod:`.render` and ``templates/leaderworkerset.yaml.j2``) named like the
Deployment it replaces. Per replica the LWS controller makes a leader pod (worker index 0: the
HTTP server, the engine, KV transfer, metrics) and ``size - 1`` worker pods (ranks only, plus a
``/health`` and ``/ready`` for the kubelet), and its pod webhook gives each of them
``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX``, from which the runtime
finds its node rank and the leader (``--nnodes`` and ``--rendezvous-key-file``,
:data:`RENDEZVOUS_KEY_FILE`, are the only multi-node flags rendered).

Here: the LWS's labels and names, the leader-only selector of the pool's Service, the Stalled
message for a cluster without the CRD, the apply that leaves an LWS alone when it already holds
what the reconciler would send (:func:`apply_unless_held`), and how a pool's *groups* are
counted from its pods:

* a group is ready when all ``size`` of its pods are Ready (the LWS's own ``readyReplicas``
  rule). The reconciler counts it from the pods it lists anyway rather than from the LWS's
  status: LeaderWorkerSets are not watched (their CRD may be absent, and a kopf watch on a
  missing resource fails), pod events are what trigger the reconcile, and the LWS's status is
  written by its controller after those same events, so it may still be behind when read;
* a group is pending for GPUs when any of its pods is (the autoscaler must not add groups the
  cluster cannot place), and a group counts as one replica everywhere: the autoscaler scales the
  LWS's ``spec.replicas`` (groups), and a replica's GPUs are ``gpus`` (the whole group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import splitserve_contract as contract
from splitserve_contract import Role

from . import apply, capacity, child_cache, handoff_key, kube, naming

API_GROUP: Final = "leaderworkerset.x-k8s.io"
API_VERSION: Final = f"{API_GROUP}/v1"
KIND: Final = "LeaderWorkerSet"
PLURAL: Final = "leaderworkersets"
CRD_NAME: Final = f"{PLURAL}.{API_GROUP}"
VERSION: Final = "v0.7.0"
"""The LWS release whose API the operator renders (and the e2e tests run)."""
INSTALL_MANIFEST_URL: Final = f"https://github.com/kubernetes-sigs/lws/releases/download/{VERSION}/manifests.yaml"

SET_NAME_LABEL: Final = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_WORKER_INDEX: Final = "0"
"""The leader's ``worker-index`` label (workers are 1 .. size-1)."""

RENDEZVOUS_PORT_NAME: Final = "rendezvous"
"""The leader's port the other ranks of its group join at (``--rendezvous-port``)."""
RENDEZVOUS_KEY_FILE: Final = handoff_key.KEY_FILE
"""``--rendezvous-key-file`` of every pod of a group: the ranks run what their leader sends
them, so its messages are authenticated with a key derived from a secret only the
InferenceService's pods hold. The secret is the InferenceService's KV handoff key Secret
(:mod:`.handoff_key`; the runtime derives a separate key per group from it), mounted into the
leader and worker pods of every multi-node pool, aggregated ones included."""


def is_leader_worker_set(obj: Mapping[str, Any]) -> bool:
    return obj.get("kind") == KIND and str(obj.get("apiVersion", "")) == API_VERSION


def leader_selector(isvc_name: str, role: Role | str) -> dict[str, str]:
    """The pool's selector narrowed to the leader pods: what its Service (the router's and the
    InferencePool's view of the pool) selects. Workers serve no API."""
    return {**naming.selector_labels(isvc_name, role), WORKER_INDEX_LABEL: LEADER_WORKER_INDEX}


def crd_missing_message(isvc_name: str, roles: Iterable[Role]) -> str:
    """The Stalled condition's message when the cluster has no LeaderWorkerSet CRD."""
    names = ", ".join(naming.child_name(isvc_name, role) for role in roles)
    return (
        f"a pool spans several nodes (resources.gpusPerNode smaller than resources.gpus), but the "
        f"cluster has no LeaderWorkerSet CRD ({CRD_NAME}, {API_VERSION}), so LeaderWorkerSet "
        f"{names} cannot be created: install LWS {VERSION} (kubectl apply --server-side -f "
        f"{INSTALL_MANIFEST_URL}); the operator retries at least once a minute"
    )


def size_of(lws: Mapping[str, Any]) -> int:
    """Pods per group (``leaderWorkerTemplate.size``; the API's default is 1)."""
    size = ((lws.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size")
    return int(size) if size is not None else 1


def _labels(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def is_leader(pod: Mapping[str, Any]) -> bool:
    return _labels(pod).get(WORKER_INDEX_LABEL) == LEADER_WORKER_INDEX


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, Ready and not terminating."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


@dataclasses.dataclass(frozen=True)
class Group:
    """One replica of a multi-node pool: its index and its live (not terminating) pods."""

    index: str
    pods: tuple[dict[str, Any], ...]

    @property
    def leader(self) -> dict[str, Any] | None:
        return next((p for p in self.pods if is_leader(p)), None)

    def ready(self, size: int) -> bool:
        """All ``size`` pods exist and are Ready."""
        return len(self.pods) >= size and all(is_ready(p) for p in self.pods)

    def pending_for_gpus(self) -> bool:
        """Some pod of the group waits for a node with enough GPUs."""
        return bool(capacity.unschedulable_gpu_pods(self.pods))

    def pending(self) -> bool:
        """Some pod of the group is Pending (not scheduled or not started yet)."""
        return any((p.get("status") or {}).get("phase") == "Pending" for p in self.pods)


def groups(pods: Iterable[Mapping[str, Any]]) -> list[Group]:
    """The pods of one LWS by group (its ``group-index`` label), in index order; pods being
    deleted and pods without the label (not made by the LWS controller) are left out."""
    by_index: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        index = _labels(pod).get(GROUP_INDEX_LABEL)
        if index is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        by_index.setdefault(index, []).append(dict(pod))
    ordered = sorted(by_index, key=lambda i: (len(i), i))
    return [Group(index=i, pods=tuple(by_index[i])) for i in ordered]


@dataclasses.dataclass(frozen=True)
class GroupCounts:
    """A multi-node pool in replicas (groups), for ``status.<pool>`` and Ready."""

    replicas: int
    """Groups the LWS has (its ``status.replicas``)."""
    ready: int
    """Groups whose pods are all Ready (counted from the pods)."""
    desired: int
    """The LWS's ``spec.replicas``."""
    pending: int
    """Groups with a Pending pod."""
    rolled_out: bool
    """Exactly ``desired`` groups, each ready and on the current pod template."""


def _template_hash(lws: Mapping[str, Any]) -> str | None:
    template = ((lws.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("workerTemplate") or {}
    value = ((template.get("metadata") or {}).get("annotations") or {}).get(contract.ANNOTATION_CONFIG_HASH)
    return None if value is None else str(value)


def count_groups(*, lws: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> GroupCounts:
    """Count ``lws``'s groups from its pods (``pods``: the pool's pods; see the module
    docstring). Rolled out: ``spec.replicas`` groups, all ready, every pod carrying the
    template's config hash, and no group above the desired count left."""
    spec_replicas = (lws.get("spec") or {}).get("replicas")
    desired = int(spec_replicas) if spec_replicas is not None else 1
    size = size_of(lws)
    name = str((lws.get("metadata") or {}).get("name", ""))
    own = [p for p in pods if _labels(p).get(SET_NAME_LABEL) == name]
    found = groups(own)
    ready = [g for g in found if g.ready(size)]
    wanted = _template_hash(lws)
    current = (
        all(
            ((p.get("metadata") or {}).get("annotations") or {}).get(contract.ANNOTATION_CONFIG_HASH) == wanted
            for g in found
            for p in g.pods
        )
        if wanted is not None
        else True
    )
    status_replicas = int((lws.get("status") or {}).get("replicas") or 0)
    return GroupCounts(
        replicas=max(status_replicas, len(found)),
        ready=len(ready),
        desired=desired,
        pending=sum(1 for g in found if g.pending()),
        rolled_out=len(found) == desired and len(ready) >= desired and current,
    )


# ---------------------------------------------------------------------------- apply
def _same_value(want: Any, have: Any) -> bool:
    """``want`` (as rendered) equals ``have`` (as stored), recursively; a number and its decimal
    string are equal (the LWS webhook stores quantities such as ``nvidia.com/gpu: 1`` as "1")."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(_same_value(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(_same_value(a, b) for a, b in zip(want, have, strict=True))
        )
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    if (
        isinstance(want, int | float)
        and isinstance(have, str)
        or isinstance(want, str)
        and isinstance(have, int | float)
    ):
        return str(want) == str(have)
    return bool(want == have)


def holds(*, live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether ``live`` already has every label and spec field of ``desired`` (as the reconciler
    applies it: without ``spec.replicas``, the autoscaler's) with the same value."""
    want_spec = {k: v for k, v in (desired.get("spec") or {}).items() if k != "replicas"}
    want_labels = (desired.get("metadata") or {}).get("labels") or {}
    return _same_value(want_labels, (live.get("metadata") or {}).get("labels") or {}) and _same_value(
        want_spec, live.get("spec") or {}
    )


def apply_unless_held(
    *,
    api: kube.KubeAPI,
    desired: Mapping[str, Any],
    owner: apply.Owner,
    initial_replicas: int | None,
    fixed_replicas: int | None = None,
    cache: child_cache.ChildCache | None = None,
    defer_hand_over: bool = False,
) -> apply.Applied:
    """:func:`.apply.apply_child` for a LeaderWorkerSet, except that nothing is sent when the live
    one is ours, its replicas are handed over, and it already :func:`holds` the rendered fields.

    Every write of an LWS bumps its ``metadata.generation``, even one that changes nothing: the
    LWS defaulting webhook answers every write with a patch that adds ``creationTimestamp: null``
    to the pod templates' metadata (its Go types' rendering), which the API server then prunes.
    Applying unchanged LWSs on every reconcile (every pod event of the pool triggers one) would
    churn generations and report the child as updated each time. A field of ours that was edited
    (drift) makes :func:`holds` false, so it is taken back as for every other child; any change to
    the pods also changes their config-hash annotation, which is among the fields compared."""
    meta = desired["metadata"]
    live = api.get(kind=kube.LEADER_WORKER_SET, namespace=meta.get("namespace"), name=meta["name"])
    if (
        live is not None
        and apply.is_controlled_by(live, owner=owner)
        and not apply.reconciler_owns_replicas(live)
        and holds(live=live, desired=desired)
    ):
        return apply.Applied(live, apply.Outcome.UNCHANGED)
    return apply.apply_child(
        api=api,
        desired=desired,
        owner=owner,
        initial_replicas=initial_replicas,
        fixed_replicas=fixed_replicas,
        cache=cache,
        defer_hand_over=defer_hand_over,
    )
