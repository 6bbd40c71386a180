"""Which children need which: a child is applied only once everything it uses is ours.

A child that names another child (a pod's ServiceAccount or a mounted Secret, a RoleBinding's
Role and ServiceAccount, an InferencePool's endpoint picker Service) trusts whatever object
holds that name. When that name is held by an object this InferenceService does not control
(:class:`~.apply.NameConflict`: it was left untouched), applying the child anyway would bind
and run as someone else's objects: the endpoint picker, with its user-chosen image and a
mounted token, under a planted ServiceAccount bound to a planted Role; prefill and decode pods
trusting a planted KV handoff key; a Gateway sending its requests to a planted picker Service.
So the dependents of a child that is not ours, or that failed to apply, are not applied at all
(transitively); status reports them with the conflict.

The edges are read from the rendered objects themselves, not listed by hand, so a new child
that names another one is covered:

* a workload's pod template: ``serviceAccountName``, Secret and ConfigMap volumes (projected
  ones too) and ``env``/``envFrom`` references;
* a workload whose ServiceAccount a rendered RoleBinding binds: that RoleBinding (a planted
  one may bind the account to anything);
* a RoleBinding: its Role and its ServiceAccount subjects;
* an InferencePool: the Service its ``endpointPickerRef`` names.

Only names of objects the operator makes count (the rendered children, and the KV handoff
key Secret); a user's own Secrets (hub token, API key) are the user's to provide.
:func:`waves` orders the applies: a child goes after everything it needs, so a RoleBinding
finds its Role (the API server checks one against the other) and a pod its ServiceAccount.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

from . import child_cache

ChildKey = child_cache.ChildKey

_WORKLOAD_KINDS: Final = frozenset({"Deployment", "LeaderWorkerSet"})


def _key(api_version: str, kind: str, namespace: str, name: Any) -> ChildKey:
    return (api_version, kind, namespace, str(name))


def _pod_references(node: Any, namespace: str) -> Iterator[ChildKey]:
    """What any pod spec under ``node`` names (a walk, so a LeaderWorkerSet's two templates count)."""
    if isinstance(node, list):
        for item in node:
            yield from _pod_references(item, namespace)
        return
    if not isinstance(node, Mapping):
        return
    if isinstance(node.get("serviceAccountName"), str):
        yield _key("v1", "ServiceAccount", namespace, node["serviceAccountName"])
    secret = node.get("secret")
    if isinstance(secret, Mapping) and (secret.get("secretName") or secret.get("name")):
        yield _key("v1", "Secret", namespace, secret.get("secretName") or secret.get("name"))
    config_map = node.get("configMap")
    if isinstance(config_map, Mapping) and config_map.get("name"):
        yield _key("v1", "ConfigMap", namespace, config_map["name"])
    for field, kind in (
        ("secretKeyRef", "Secret"),
        ("secretRef", "Secret"),
        ("configMapKeyRef", "ConfigMap"),
        ("configMapRef", "ConfigMap"),
    ):
        ref = node.get(field)
        if isinstance(ref, Mapping) and ref.get("name"):
            yield _key("v1", kind, namespace, ref["name"])
    for value in node.values():
        yield from _pod_references(value, namespace)


def references(child: Mapping[str, Any]) -> set[ChildKey]:
    """The objects ``child`` names (whoever makes them)."""
    namespace = str((child.get("metadata") or {}).get("namespace") or "")
    kind = child.get("kind")
    out: set[ChildKey] = set()
    if kind == "RoleBinding":
        role_ref = child.get("roleRef") or {}
        if role_ref.get("kind") == "Role":
            out.add(_key("rbac.authorization.k8s.io/v1", "Role", namespace, role_ref.get("name")))
        for subject in child.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount" and (subject.get("namespace") or namespace) == namespace:
                out.add(_key("v1", "ServiceAccount", namespace, subject.get("name")))
    elif kind == "InferencePool":
        ref = (child.get("spec") or {}).get("endpointPickerRef") or {}
        if ref.get("kind", "Service") == "Service" and not ref.get("group"):
            out.add(_key("v1", "Service", namespace, ref.get("name")))
    elif kind in _WORKLOAD_KINDS:
        out.update(_pod_references(child.get("spec") or {}, namespace))
    return out


def needs(
    children: Sequence[Mapping[str, Any]], *, also_made: Iterable[ChildKey] = ()
) -> dict[ChildKey, set[ChildKey]]:
    """For each child (by key), the objects the operator makes that it names directly:
    ``children`` and ``also_made`` (the KV handoff key Secret, created apart)."""
    made = {child_cache.key_of(c) for c in children} | set(also_made)
    out = {child_cache.key_of(c): references(c) & made for c in children}
    bindings = {key: refs for key, refs in out.items() if key[1] == "RoleBinding"}
    for key, refs in out.items():
        if key[1] in _WORKLOAD_KINDS:
            accounts = {r for r in refs if r[1] == "ServiceAccount"}
            refs.update(b for b, bound in bindings.items() if accounts & bound)
    return out


def waves(edges: Mapping[ChildKey, set[ChildKey]]) -> list[list[ChildKey]]:
    """The keys of ``edges`` in apply waves: each after every wave holding something it needs
    (0 for what needs nothing). A cycle (none is rendered) is broken, not looped on."""
    depth: dict[ChildKey, int] = {}

    def of(key: ChildKey, path: frozenset[ChildKey]) -> int:
        if key not in depth:
            below = [of(d, path | {key}) for d in edges.get(key, ()) if d in edges and d not in path]
            depth[key] = 1 + max(below) if below else 0
        return depth[key]

    for key in edges:
        of(key, frozenset())
    out: list[list[ChildKey]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for key in edges:
        out[depth[key]].append(key)
    return out


def blocked(edges: Mapping[ChildKey, set[ChildKey]], failed: set[ChildKey]) -> dict[ChildKey, ChildKey]:
    """Children that must not be applied because something they need, directly or not, is in
    ``failed`` (not ours, or not applied): each with the failed object it traces back to."""
    out: dict[ChildKey, ChildKey] = {}

    def cause(key: ChildKey, path: frozenset[ChildKey]) -> ChildKey | None:
        for dep in sorted(edges.get(key, ())):
            if dep in failed:
                return dep
            if dep in path:
                continue
            found = cause(dep, path | {key})
            if found is not None:
                return found
        return None

    for key in edges:
        if key not in failed:
            root = cause(key, frozenset())
            if root is not None:
                out[key] = root
    return out
