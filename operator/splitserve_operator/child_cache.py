"""What the operator's own watch last delivered of each child: no read before a write, and no
write of what is already there.

A reconcile used to GET every child (the ownership check) and then apply it, 14 children, 31
requests, even when nothing had changed, and it runs again on every Deployment status change.
The operator already watches its children (:mod:`.handlers`: Deployments, Services,
ConfigMaps, PDBs, NetworkPolicies, ServiceAccounts, Roles, RoleBindings labelled
``managed-by=splitserve-operator``); each event goes into :class:`ChildCache`, which keeps a
small :class:`Seen` per object: its controller's UID, a fingerprint of the reconciler's
``managedFields`` entry, whether the reconciler still owns ``spec.replicas``, and for a
Deployment what status observation reads (generation, ``spec.replicas``, ``status``). No pod
template and no ``managedFields`` are kept: a few hundred bytes per child.

What :func:`.apply.apply_child` and :mod:`.reconcile` do with it:

* **Ownership** of a child the cache holds is checked against the cached controller: no GET. A
  child the cache does not hold (absent, made by someone else without our label, or not
  delivered yet) is read with a GET as before, so an object a human made under our name is
  still never touched.
* **No-op applies are skipped.** After each apply the cache records (:meth:`ChildCache.record`)
  the hash of the body sent and the fingerprint the server answered with. If the next rendered
  body hashes the same and the watched object still carries that fingerprint, the apply is
  skipped. Any write by another field manager that changes one of our fields (``kubectl edit``,
  a forced apply) moves that field's ownership away from us and so changes the fingerprint; a
  deleted child leaves the cache. Either event also triggers a reconcile, which then applies.
* **Whole reconciles without render or apply** (:meth:`ChildCache.plan`): when the spec is
  the one last applied and every child is as recorded, the reconcile goes straight to
  observation.
* **Echoes**: the resourceVersions our own applies returned are remembered, so the watch event
  of our own write does not trigger another reconcile (:meth:`ChildCache.observe`).

A cached entry is trusted for :data:`MAX_AGE_SECONDS` after the watch delivered it or an apply
confirmed it (the apply answered with the cached resourceVersion); after that the reconciler
reads and applies as before. This bounds what a missed event can cost: kopf resumes a watch from
its last resourceVersion, but after a ``410 Gone`` it lists again, and a child deleted in that
gap sends no DELETED event. Kinds that are not watched (the KV handoff Secret, InferencePool,
LeaderWorkerSet) are never cached and always read and applied.

Thread-safe: the kopf event loop writes, reconcile worker threads read and record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import splitserve_contract as contract

from . import kube

MAX_AGE_SECONDS: Final = 300.0
ECHOES_KEPT: Final = 4
"""resourceVersions of our own writes remembered per child (an apply and the replica hand-over)."""

ChildKey = tuple[str, str, str, str]
"""(apiVersion, kind, namespace, name) of a child."""
OwnerKey = tuple[str, str]
"""(namespace, name) of an InferenceService."""


def key_of(obj: Mapping[str, Any]) -> ChildKey:
    meta = obj.get("metadata") or {}
    # apiVersion, kind and namespace repeat across thousands of children: one copy each
    return (
        sys.intern(str(obj.get("apiVersion"))),
        sys.intern(str(obj.get("kind"))),
        sys.intern(str(meta.get("namespace") or "")),
        str(meta.get("name")),
    )


def digest(obj: Mapping[str, Any]) -> str:
    """Hash of an object as sent (stable key order)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:24]


def apply_entry(obj: Mapping[str, Any], manager: str) -> dict[str, Any]:
    """``manager``'s Apply entry in ``managedFields`` ({} when there is none)."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            return dict(entry)
    return {}


def reconciler_entry(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The reconciler's Apply entry in ``managedFields`` ({} when there is none)."""
    return apply_entry(obj, contract.FIELD_MANAGER_RECONCILER)


def fingerprint(obj: Mapping[str, Any]) -> str:
    """What moves when any of the reconciler's fields changes, whoever changed it: the time and
    field set of its managedFields entry. Not the resourceVersion, which controllers bump with
    status updates all the time."""
    entry = reconciler_entry(obj)
    text = json.dumps([entry.get("time"), entry.get("fieldsV1")], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def change_marker(obj: Mapping[str, Any]) -> tuple[Any, str]:
    """What changes when *our* apply changed something: the generation (spec changes) and our
    fingerprint."""
    return ((obj.get("metadata") or {}).get("generation"), fingerprint(obj))


def holds_replicas(obj: Mapping[str, Any], manager: str) -> bool:
    """Whether ``manager``'s Apply entry in managedFields holds spec.replicas."""
    spec = (apply_entry(obj, manager).get("fieldsV1") or {}).get("f:spec") or {}
    return "f:replicas" in spec


def reconciler_owns_replicas(obj: Mapping[str, Any]) -> bool:
    """Whether the reconciler's Apply entry in managedFields still holds spec.replicas."""
    return holds_replicas(obj, contract.FIELD_MANAGER_RECONCILER)


def replicas_handed_over(obj: Mapping[str, Any]) -> bool:
    """Whether the autoscaler's field manager holds spec.replicas (alone, or shared with the
    reconciler between the hand-over and the reconciler's next apply, which lets go of it)."""
    return holds_replicas(obj, contract.FIELD_MANAGER_AUTOSCALER)


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


_KEPT_METADATA: Final = ("name", "namespace", "uid", "resourceVersion", "generation")
_KEPT_STATUS: Final = frozenset(
    {"observedGeneration", "replicas", "updatedReplicas", "readyReplicas", "availableReplicas", "unavailableReplicas"}
)
_KEPT_CONDITION: Final = ("type", "status", "reason", "message")


def slim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a child the reconciler reads back: identity, and for a Deployment
    ``spec.replicas`` and ``status`` (:func:`.reconcile.observe_deployment`, :mod:`.failures`)."""
    meta = obj.get("metadata") or {}
    out: dict[str, Any] = {
        "apiVersion": sys.intern(str(obj.get("apiVersion"))),
        "kind": sys.intern(str(obj.get("kind"))),
        "metadata": {k: meta[k] for k in _KEPT_METADATA if k in meta},
    }
    if obj.get("kind") == kube.DEPLOYMENT.kind:
        replicas = (obj.get("spec") or {}).get("replicas")
        out["spec"] = {} if replicas is None else {"replicas": replicas}
        status = obj.get("status") or {}
        out["status"] = {k: v for k, v in status.items() if k in _KEPT_STATUS}
        if status.get("conditions"):
            out["status"]["conditions"] = [{k: c[k] for k in _KEPT_CONDITION if k in c} for c in status["conditions"]]
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """One child as the watch last delivered it."""

    obj: dict[str, Any]
    """:func:`slim` of the object."""
    controller_uid: str | None
    fingerprint: str
    owns_replicas: bool
    """The reconciler still holds spec.replicas (an apply must let go of it)."""
    handed_over: bool
    """The autoscaler holds spec.replicas."""
    at: float
    """When the watch delivered it, or an apply confirmed it (monotonic seconds)."""

    @classmethod
    def of(cls, obj: Mapping[str, Any], *, at: float) -> Seen:
        return cls(
            obj=slim(obj),
            controller_uid=controller_uid(obj),
            fingerprint=fingerprint(obj),
            owns_replicas=reconciler_owns_replicas(obj),
            handed_over=replicas_handed_over(obj),
            at=at,
        )

    @property
    def marker(self) -> tuple[Any, str]:
        """:func:`change_marker` of the object."""
        return (self.obj["metadata"].get("generation"), self.fingerprint)

    @property
    def resource_version(self) -> str | None:
        rv = self.obj["metadata"].get("resourceVersion")
        return None if rv is None else str(rv)


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """The reconciler's last apply of one child: the body's hash and what the server answered."""

    digest: str
    fingerprint: str
    generation: Any
    owns_replicas: bool
    handed_over: bool
    resource_version: str

    @property
    def marker(self) -> tuple[Any, str]:
        """:func:`change_marker` of the server's answer."""
        return (self.generation, self.fingerprint)


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedChild:
    """One child of a whole-reconcile plan: where it is, the hash of its body, whether it is a
    pool workload whose replicas are handed to the autoscaler, and the role its Deployment is
    observed under (None for other kinds)."""

    key: ChildKey
    digest: str
    hands_over_replicas: bool
    deployment_role: str | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the last complete, conflict-free apply of one InferenceService's spec sent."""

    spec_key: str
    children: tuple[PlannedChild, ...]


class ChildCache:
    """The children the watch delivered (:class:`Seen`), our applies (:class:`Record`) and the
    last whole plan per InferenceService. ``kinds``: the watched kinds; others are never kept."""

    def __init__(
        self,
        *,
        kinds: Iterable[kube.Kind],
        max_age_seconds: float = MAX_AGE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kinds = frozenset((k.api_version, k.kind) for k in kinds)
        self._max_age = max_age_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[ChildKey, Seen] = {}
        self._records: dict[ChildKey, Record] = {}
        self._echoes: dict[ChildKey, tuple[str, ...]] = {}
        self._plans: dict[OwnerKey, Plan] = {}

    @classmethod
    def for_resources(cls, resources: Iterable[tuple[str, str, str]]) -> ChildCache:
        """A cache of the kinds a kopf watch list names as (group, version, plural)."""
        by_plural = {(k.api_version, k.plural): k for k in kube.KINDS.values()}
        kinds = [by_plural[(f"{g}/{v}" if g else v, p)] for g, v, p in resources]
        return cls(kinds=kinds)

    def watches(self, key: ChildKey) -> bool:
        return (key[0], key[1]) in self._kinds

    # ------------------------------------------------------------------ the watch
    def observe(self, obj: Mapping[str, Any]) -> bool:
        """Keep an object the watch delivered; True when it is the echo of our own write."""
        key = key_of(obj)
        if not self.watches(key):
            return False
        seen = Seen.of(obj, at=self._clock())
        with self._lock:
            self._seen[key] = seen
            return seen.resource_version is not None and seen.resource_version in self._echoes.get(key, ())

    def forget(self, obj: Mapping[str, Any]) -> None:
        """A child is gone (a DELETED event): it must be created again."""
        key = key_of(obj)
        with self._lock:
            self._seen.pop(key, None)
            self._records.pop(key, None)
            self._echoes.pop(key, None)

    # ------------------------------------------------------------------ the reconciler
    def seen(self, key: ChildKey) -> Seen | None:
        """The child as last delivered, if that is recent enough to trust (else None). When the
        watch still shows an earlier write of ours than our last apply (its echo has not come
        yet, e.g. between a create and the replica hand-over), our fields are taken from what
        that apply answered: a later write by anyone else is still to come as an event."""
        with self._lock:
            seen = self._seen.get(key)
            record = self._records.get(key)
            echoes = self._echoes.get(key, ())
        if seen is None or self._clock() - seen.at > self._max_age:
            return None
        if record is not None and seen.resource_version in echoes and seen.resource_version != record.resource_version:
            return dataclasses.replace(
                seen, fingerprint=record.fingerprint, owns_replicas=record.owns_replicas, handed_over=record.handed_over
            )
        return seen

    def record(self, key: ChildKey, *, digest: str, result: Mapping[str, Any]) -> None:
        """Our apply of ``key`` sent a body hashing to ``digest`` and the server answered
        ``result`` (the last of our writes, after any replica hand-over)."""
        if not self.watches(key):
            return
        rv = str((result.get("metadata") or {}).get("resourceVersion") or "")
        record = Record(
            digest=digest,
            fingerprint=fingerprint(result),
            generation=(result.get("metadata") or {}).get("generation"),
            owns_replicas=reconciler_owns_replicas(result),
            handed_over=replicas_handed_over(result),
            resource_version=rv,
        )
        with self._lock:
            self._records[key] = record
            if rv:
                self._echoes[key] = (*self._echoes.get(key, ())[-(ECHOES_KEPT - 1) :], rv)
            seen = self._seen.get(key)
            if seen is not None and seen.resource_version == rv:  # the cache is current: confirmed
                self._seen[key] = dataclasses.replace(seen, at=self._clock())

    def echo(self, key: ChildKey, resource_version: str) -> None:
        """A write of ours that is not an apply of the whole child (the replica hand-over)."""
        with self._lock:
            self._echoes[key] = (*self._echoes.get(key, ())[-(ECHOES_KEPT - 1) :], resource_version)

    def last_record(self, key: ChildKey) -> Record | None:
        with self._lock:
            return self._records.get(key)

    def unchanged(self, key: ChildKey, *, digest: str, owner_uid: str, hands_over_replicas: bool) -> Seen | None:
        """The cached child when applying a body hashing to ``digest`` would change nothing:
        it is ours, our last apply sent that body, and no one has changed our fields since
        (nor does the reconciler still hold the replicas it hands over). Else None."""
        seen = self.seen(key)
        if seen is None or seen.controller_uid != owner_uid or (hands_over_replicas and seen.owns_replicas):
            return None
        record = self.last_record(key)
        if record is None or record.digest != digest or record.fingerprint != seen.fingerprint:
            return None
        return seen

    # ------------------------------------------------------------------ whole plans
    def remember_plan(self, owner: OwnerKey, plan: Plan) -> None:
        with self._lock:
            self._plans[owner] = plan

    def plan(self, owner: OwnerKey, *, spec_key: str) -> Plan | None:
        with self._lock:
            plan = self._plans.get(owner)
        return plan if plan is not None and plan.spec_key == spec_key else None

    def forget_owner(self, owner: OwnerKey) -> None:
        """The InferenceService is gone (its children go with it, each by its DELETED event)."""
        with self._lock:
            self._plans.pop(owner, None)

    def sizes(self) -> dict[str, int]:
        """Entries held (for tests and memory checks)."""
        with self._lock:
            return {
                "seen": len(self._seen),
                "records": len(self._records),
                "echoes": len(self._echoes),
                "plans": len(self._plans),
            }
