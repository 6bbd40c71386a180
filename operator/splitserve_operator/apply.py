"""Server-side apply of one rendered child, with the ownership rules of docs/architecture.md, "Children and field ownership".

:func:`apply_child` is the only way the reconciler writes a child:

1. Find the live object: in the watch's :class:`~.child_cache.ChildCache` when it holds it
   (no request), else with a GET. If it exists and its controller owner reference is not this
   InferenceService (by UID), raise :class:`NameConflict` and write nothing: we never take
   over an object a human or another tool made. When the cache shows the child exactly as our
   last apply of the same body left it, nothing is sent at all (:meth:`.ChildCache.unchanged`).
2. Add our owner reference (``controller: true``, ``blockOwnerDeletion: true``), so deleting
   the InferenceService garbage-collects the children: no finalizer is needed, and deleting an
   InferenceService never hangs while the operator is down.
3. PATCH with ``application/apply-patch+yaml`` as :data:`~contract.FIELD_MANAGER_RECONCILER`,
   ``force=True``: the rendered fields are ours, and a drifted value is taken back.

Replica ownership. A pool Deployment's ``spec.replicas`` belongs to the autoscaler's field
manager from its creation on. The reconciler creates the Deployment with ``spec.replicas`` (the
pool minimum; none when that is 1, the API server's default, which belongs to no one) and then
hands that one field over by applying just ``spec.replicas`` as
:data:`~contract.FIELD_MANAGER_AUTOSCALER` (the SSA ownership-transfer pattern); when the
reconciler had set it, the field is then shared, and the reconciler's apply of the body without
``spec.replicas``, sent right after, lets go of it. In a reconcile these writes follow once
every child exists. Every later apply omits ``spec.replicas`` too; because the autoscaler holds
it, omitting it does not reset it. If the operator died between the create and the hand-over,
the next apply sees (in ``managedFields``) that the reconciler holds replicas and the autoscaler
does not, and finishes the hand-over first, with the live value (a defaulted count stays
unowned until the autoscaler first scales).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import splitserve_contract as contract

from . import child_cache, kube


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
    """The server's answer, or the cached :func:`.child_cache.slim` copy when nothing was sent."""
    outcome: Outcome
    digest: str = ""
    """Hash of the body the reconciler applies to this child (:func:`.child_cache.digest`)."""
    finish: Callable[[], Applied] | None = None
    """The rest of a pool Deployment's creation (the replica hand-over), when the caller asked
    to send it later (``defer_hand_over``): call it once, when every child exists."""


def controller_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def is_controlled_by(obj: Mapping[str, Any], *, owner: Owner) -> bool:
    ref = controller_of(obj)
    return ref is not None and ref.get("uid") == owner.uid


reconciler_owns_replicas = child_cache.reconciler_owns_replicas


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


def apply_child(
    *,
    api: kube.KubeAPI,
    desired: Mapping[str, Any],
    owner: Owner,
    initial_replicas: int | None,
    fixed_replicas: int | None = None,
    cache: child_cache.ChildCache | None = None,
    defer_hand_over: bool = False,
) -> Applied:
    """Apply one child (see the module docstring). ``desired`` is as rendered, without
    ``spec.replicas``; ``initial_replicas`` is the count a pool Deployment is created with and
    then handed to the autoscaler (None for kinds without replicas); ``fixed_replicas`` is
    the count the reconciler itself keeps on every apply (the router: no autoscaler scales it,
    so an edit of ``spec.router.replicas`` must reach it); ``cache``: what the child watch
    delivered, which replaces the GET (None: always GET); ``defer_hand_over``: a created pool
    Deployment comes back with the hand-over still to send (:attr:`Applied.finish`), so that
    the other children are not kept waiting behind it. Raises :class:`NameConflict` or the API
    error."""
    kind = kube.kind_of(desired)
    meta = desired["metadata"]
    body = with_owner(_without_replicas(desired), owner=owner)
    if fixed_replicas is not None:
        body["spec"]["replicas"] = fixed_replicas
        initial_replicas = None  # ours for good: never handed over
    key = child_cache.key_of(body)
    sent = child_cache.digest(body)
    hands_over = initial_replicas is not None
    seen: child_cache.Seen | None = None
    if cache is not None:
        same = cache.unchanged(key, digest=sent, owner_uid=owner.uid, hands_over_replicas=hands_over)
        if same is not None:
            return Applied(same.obj, Outcome.UNCHANGED, sent)
        seen = cache.seen(key)
    if (
        seen is not None
        and seen.controller_uid == owner.uid
        and not (hands_over and seen.owns_replicas and not seen.handed_over)
    ):
        # Ours, as the watch shows it: apply without reading it first (and without replicas,
        # which lets go of them when the autoscaler already holds them too).
        before = {seen.marker}
        last = cache.last_record(key) if cache is not None else None
        if last is not None:
            before.add(last.marker)  # the cache may not have caught up with our last apply yet
        result = api.apply(obj=body, field_manager=contract.FIELD_MANAGER_RECONCILER, force=True)
        if (result.get("metadata") or {}).get("uid") != seen.obj["metadata"].get("uid"):
            # It was gone (its DELETED event still to come): this apply made it again.
            if initial_replicas is not None:
                _echo(cache, key, result)
                result = _hand_over_replicas(api=api, obj=result, replicas=initial_replicas)
            _record(cache, key, sent, result)
            return Applied(result, Outcome.CREATED, sent)
        _record(cache, key, sent, result)
        return Applied(
            result, Outcome.UNCHANGED if child_cache.change_marker(result) in before else Outcome.UPDATED, sent
        )
    live = api.get(kind=kind, namespace=meta.get("namespace"), name=meta["name"])
    if live is not None and not is_controlled_by(live, owner=owner):
        ref = controller_of(live)
        owner_text = f"{ref.get('kind')}/{ref.get('name')}" if ref else None
        raise NameConflict(kind=kind.kind, name=meta["name"], owner=owner_text)
    if live is None:
        return _create(
            api=api,
            body=body,
            key=key,
            sent=sent,
            initial_replicas=initial_replicas,
            cache=cache,
            defer_hand_over=defer_hand_over,
        )
    if initial_replicas is not None and reconciler_owns_replicas(live) and not child_cache.replicas_handed_over(live):
        current = live.get("spec", {}).get("replicas")
        live = _hand_over_replicas(
            api=api, obj=live, replicas=int(current) if current is not None else initial_replicas
        )
        _echo(cache, key, live)
    before_marker = child_cache.change_marker(live)
    result = api.apply(obj=body, field_manager=contract.FIELD_MANAGER_RECONCILER, force=True)
    _record(cache, key, sent, result)
    return Applied(
        result, Outcome.UNCHANGED if child_cache.change_marker(result) == before_marker else Outcome.UPDATED, sent
    )


def _create(
    *,
    api: kube.KubeAPI,
    body: dict[str, Any],
    key: child_cache.ChildKey,
    sent: str,
    initial_replicas: int | None,
    cache: child_cache.ChildCache | None,
    defer_hand_over: bool,
) -> Applied:
    """Create a child; a pool workload's replicas then go to the autoscaler (module docstring).
    A Deployment that starts with one replica is created without ``spec.replicas`` (the API
    server's default is 1, and a defaulted field belongs to no one), so the hand-over is the
    only other write; any other count is created as the reconciler's and let go of after."""
    defaulted = initial_replicas == 1 and key[1] == kube.DEPLOYMENT.kind
    if initial_replicas is not None and not defaulted:
        body["spec"]["replicas"] = initial_replicas
    created = api.apply(obj=body, field_manager=contract.FIELD_MANAGER_RECONCILER, force=True)
    if initial_replicas is None:
        _record(cache, key, sent, created)
        return Applied(created, Outcome.CREATED, sent)
    _echo(cache, key, created)
    replicas = initial_replicas

    def finish() -> Applied:
        handed = _hand_over_replicas(api=api, obj=created, replicas=replicas)
        if defaulted:
            _record(cache, key, sent, handed)
            return Applied(handed, Outcome.CREATED, sent)
        _echo(cache, key, handed)
        released = api.apply(obj=_without_replicas(body), field_manager=contract.FIELD_MANAGER_RECONCILER, force=True)
        _record(cache, key, sent, released)
        return Applied(released, Outcome.CREATED, sent)

    return Applied(created, Outcome.CREATED, sent, finish=finish) if defer_hand_over else finish()


def _record(
    cache: child_cache.ChildCache | None, key: child_cache.ChildKey, sent: str, result: Mapping[str, Any]
) -> None:
    if cache is not None:
        cache.record(key, digest=sent, result=result)


def _echo(cache: child_cache.ChildCache | None, key: child_cache.ChildKey, written: Mapping[str, Any]) -> None:
    rv = (written.get("metadata") or {}).get("resourceVersion")
    if cache is not None and rv:
        cache.echo(key, str(rv))


_change_marker = child_cache.change_marker
