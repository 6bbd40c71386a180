"""Server-side apply of one rendered child, with the ownership rules of docs/architecture.md, "Children and field ownership".

:func:`apply_child` is the only way the reconciler writes a child:

1. GET the live object. If it exists and its controller owner reference is not this
   InferenceService (by UID), raise :class:`NameConflict` and write nothing: we never take
   over an object a human or another tool made.
2. Add our owner reference (``controller: true``, ``blockOwnerDeletion: true``), so deleting
   the InferenceService garbage-collects the children: no finalizer is needed, and deleting an
   InferenceService never hangs while the operator is down.
3. PATCH with ``application/apply-patch+yaml`` as :data:`~contract.FIELD_MANAGER_RECONCILER`,
   ``force=True``: the rendered fields are ours, and a drifted value is taken back.

Replica ownership. A Deployment is created with ``spec.replicas`` (the pool minimum) and the
reconciler then hands that one field over to the autoscaler's field manager by applying just
``spec.replicas`` as :data:`~contract.FIELD_MANAGER_AUTOSCALER` (the SSA ownership-transfer
pattern). Every later apply omits ``spec.replicas``; because the reconciler no longer owns it,
omitting it does not reset it. If the operator died between the two writes, the next apply
sees (in ``managedFields``) that the reconciler still owns replicas and finishes the hand-over
first, with the live value.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Any

import splitserve_contract as contract

from . import kube


class NameConflict(Exception):
    """A child's name is taken by an object this InferenceService does not control."""

    def __init__(self, *, kind: str, name: str, owner: str | None) -> None:
        self.kind = kind
        self.name = name
        self.owner = owner
        held = f"controlled by {owner}" if owner else "not controlled by this InferenceService"
        super().__init__(f"{kind} {name} already exists and is {held}; it was left untouched")


class Outcome(enum.StrEnum):
    CREATED = "Created"
    UPDATED = "Updated"
    UNCHANGED = "Unchanged"


@dataclasses.dataclass(frozen=True)
class Owner:
    """The InferenceService that owns the children."""

    name: str
    uid: str
    api_version: str = f"{contract.API_GROUP}/{contract.API_VERSION}"
    kind: str = contract.KIND

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclasses.dataclass(frozen=True)
class Applied:
    obj: dict[str, Any]
    outcome: Outcome


def controller_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def is_controlled_by(obj: Mapping[str, Any], *, owner: Owner) -> bool:
    ref = controller_of(obj)
    return ref is not None and ref.get("uid") == owner.uid


def reconciler_owns_replicas(obj: Mapping[str, Any]) -> bool:
    """Whether the reconciler's Apply entry in managedFields still holds spec.replicas."""
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != contract.FIELD_MANAGER_RECONCILER or entry.get("operation") != "Apply":
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in spec:
            return True
    return False


def _without_replicas(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(obj))
    out.get("spec", {}).pop("replicas", None)
    return out


def _hand_over_replicas(*, api: kube.KubeAPI, obj: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    meta = obj["metadata"]
    patch = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": replicas},
    }
    return api.apply(obj=patch, field_manager=contract.FIELD_MANAGER_AUTOSCALER, force=True)


def with_owner(obj: Mapping[str, Any], *, owner: Owner) -> dict[str, Any]:
    out = copy.deepcopy(dict(obj))
    out.setdefault("metadata", {})["ownerReferences"] = [owner.reference()]
    return out


def apply_child(*, api: kube.KubeAPI, desired: Mapping[str, Any], owner: Owner, initial_replicas: int | None,
                fixed_replicas: int | None = None) -> Applied:
    """Apply one child (see the module docstring). ``desired`` is as rendered, without
    ``spec.replicas``; ``initial_replicas`` is the count a pool Deployment is created with and
    then handed to the autoscaler (None for kinds without replicas); ``fixed_replicas`` is
    the count the reconciler itself keeps on every apply (the router: no autoscaler scales it,
    so an edit of ``spec.router.replicas`` must reach it). Raises :class:`NameConflict` or the
    API error."""
    kind = kube.kind_of(desired)
    meta = desired["metadata"]
    live = api.get(kind=kind, namespace=meta.get("namespace"), name=meta["name"])
    if live is not None and not is_controlled_by(live, owner=owner):
        ref = controller_of(live)
        owner_text = f"{ref.get('kind')}/{ref.get('name')}" if ref else None
        raise NameConflict(kind=kind.kind, name=meta["name"], owner=owner_text)
    body = with_owner(_without_replicas(desired), owner=owner)
    if fixed_replicas is not None:
        body["spec"]["replicas"] = fixed_replicas
        initial_replicas = None  # ours for good: never handed over
    if live is None:
        if initial_replicas is not None:
            body["spec"]["replicas"] = initial_replicas
        created = api.apply(obj=body, field_manager=contract.FIELD_MANAGER_RECONCILER, force=True)
        if initial_replicas is not None:
            created = _hand_over_replicas(api=api, obj=created, replicas=initial_replicas)
        return Applied(created, Outcome.CREATED)
    if initial_replicas is not None and reconciler_owns_replicas(live):
        current = live.get("spec", {}).get("replicas")
        live = _hand_over_replicas(
            api=api, obj=live, replicas=int(current) if current is not None else initial_replicas
        )
    before = _change_marker(live)
    result = api.apply(obj=body, field_manager=contract.FIELD_MANAGER_RECONCILER, force=True)
    return Applied(result, Outcome.UNCHANGED if _change_marker(result) == before else Outcome.UPDATED)


def _change_marker(obj: Mapping[str, Any]) -> tuple[Any, ...]:
    """What changes when *our* apply changed something: the generation (spec changes) and our
    managedFields entry (its time and field set move only when our fields change). Not the
    resourceVersion, which controllers bump with status updates all the time."""
    meta = obj.get("metadata", {})
    entry: dict[str, Any] = next((e for e in meta.get("managedFields") or []
                  if e.get("manager") == contract.FIELD_MANAGER_RECONCILER and e.get("operation") == "Apply"), {})
    return (meta.get("generation"), entry.get("time"), json.dumps(entry.get("fieldsV1"), sort_keys=True))
