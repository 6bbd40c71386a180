"""The child cache: applies without a GET for children the watch has shown, no request at all
for a child exactly as our last apply left it, reconciles without render or apply when nothing
changed, echoes of our own writes ignored, and everything that must still reach the API server
(drift, a changed body, a foreign object, a stale or missing entry) still does.

:class:`SsaFake` models what the cache relies on: one ``managedFields`` Apply entry per field
manager holding the fields it applied, a forced apply of a different value moving a field's
ownership, and a resourceVersion bumped by every change."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from kube_testing import NAME, SETTINGS, FakeKube, isvc_obj

import splitserve_contract as contract
from splitserve_operator import apply, child_cache, handlers, kube, reconcile, render

OWNER = apply.Owner(name="svc", uid="uid-svc")
Path = tuple[str, ...]


def _paths(value: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Leaf paths of an applied configuration, with their values (lists are leaves)."""
    if isinstance(value, Mapping):
        out: dict[Path, Any] = {}
        for key, sub in value.items():
            out.update(_paths(sub, (*prefix, str(key))))
        return out
    return {prefix: value}


def _fields_v1(paths: set[Path]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path in paths:
        node = root
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return root


class SsaFake:
    """Enough of server-side apply for one namespace (see the module docstring)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.owned: dict[tuple[str, str], dict[str, set[Path]]] = {}
        self.calls: list[str] = []
        self.version = 100

    def get(self, *, kind: kube.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.calls.append(f"get {kind.kind}/{name}")
        found = self.objects.get((kind.kind, name))
        return copy.deepcopy(found) if found is not None else None

    def list(self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        return []

    def create(
        self, *, kind: kube.Kind, namespace: str | None, obj: Mapping[str, Any], field_manager: str | None = None
    ) -> dict[str, Any]:
        raise AssertionError("children are applied, never created")

    def list_metadata(
        self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> tuple[Sequence[dict[str, Any]], str]:
        raise AssertionError("only the KV handoff key's owner is looked up this way")

    def merge_patch(
        self,
        *,
        kind: kube.Kind,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        raise AssertionError("no merge patches of children")

    def apply(self, *, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]:
        kind, name = str(obj["kind"]), str(obj["metadata"]["name"])
        self.calls.append(f"apply {kind}/{name} {field_manager}")
        key = (kind, name)
        live = copy.deepcopy(
            self.objects.get(key)
            or {
                "apiVersion": obj["apiVersion"],
                "kind": kind,
                "metadata": {
                    "name": name,
                    "namespace": obj["metadata"].get("namespace"),
                    "generation": 1,
                    "uid": f"uid-{name}-{self.version}",
                },
            }
        )
        owned = self.owned.setdefault(key, {})
        before = (copy.deepcopy(live), copy.deepcopy(owned))
        config = {k: v for k, v in copy.deepcopy(dict(obj)).items() if k not in ("apiVersion", "kind")}
        config["metadata"] = {k: v for k, v in config["metadata"].items() if k not in ("name", "namespace")}
        applied = _paths(config)
        current = _paths({k: v for k, v in live.items() if k not in ("apiVersion", "kind")})
        for path, value in applied.items():
            if current.get(path) != value:  # a forced change takes the field from everyone else
                for manager, paths in owned.items():
                    if manager != field_manager:
                        paths.discard(path)
            node = live
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = copy.deepcopy(value)
        owned[field_manager] = set(applied)
        if (live, owned) != before:
            self.version += 1
            live["metadata"]["resourceVersion"] = str(self.version)
            if live.get("spec") != before[0].get("spec"):
                live["metadata"]["generation"] = int(before[0]["metadata"].get("generation") or 0) + 1
            live["metadata"]["managedFields"] = [
                {"manager": manager, "operation": "Apply", "time": f"t{self.version}", "fieldsV1": _fields_v1(paths)}
                for manager, paths in sorted(owned.items())
            ]
        self.objects[key] = live
        return copy.deepcopy(live)


def deployment(*, image: str = "img:1", label: str = "a") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "svc-decode", "namespace": "n", "labels": {"x": label}},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": image}]}}},
    }


def config_map(value: str = "1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "svc-config", "namespace": "n"},
        "data": {"k": value},
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def new_cache(clock: Clock | None = None) -> child_cache.ChildCache:
    return child_cache.ChildCache(kinds=[kube.DEPLOYMENT, kube.CONFIG_MAP], clock=clock or Clock())


def watch(fake: SsaFake, cache: child_cache.ChildCache) -> None:
    """The watch delivers every object as it is now."""
    for obj in fake.objects.values():
        cache.observe(obj)


def managers_of_replicas(obj: Mapping[str, Any]) -> set[str]:
    return {
        e["manager"] for e in obj["metadata"]["managedFields"] if "f:replicas" in (e["fieldsV1"].get("f:spec") or {})
    }


def test_a_pool_of_one_is_created_without_replicas_and_handed_over_in_one_more_write() -> None:
    fake, cache = SsaFake(), new_cache()
    applied = apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=1, cache=cache)
    assert applied.outcome is apply.Outcome.CREATED
    assert fake.calls == [
        "get Deployment/svc-decode",
        f"apply Deployment/svc-decode {contract.FIELD_MANAGER_RECONCILER}",
        f"apply Deployment/svc-decode {contract.FIELD_MANAGER_AUTOSCALER}",
    ]
    assert managers_of_replicas(fake.objects[("Deployment", "svc-decode")]) == {contract.FIELD_MANAGER_AUTOSCALER}


def test_a_bigger_pool_is_created_with_its_replicas_then_let_go_of() -> None:
    fake = SsaFake()
    apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=2)
    live = fake.objects[("Deployment", "svc-decode")]
    assert live["spec"]["replicas"] == 2
    assert [c.split()[-1] for c in fake.calls[1:]] == [
        contract.FIELD_MANAGER_RECONCILER,
        contract.FIELD_MANAGER_AUTOSCALER,
        contract.FIELD_MANAGER_RECONCILER,
    ]
    assert managers_of_replicas(live) == {contract.FIELD_MANAGER_AUTOSCALER}


def test_the_hand_over_can_wait_until_every_child_exists() -> None:
    fake = SsaFake()
    applied = apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=2, defer_hand_over=True)
    assert len(fake.calls) == 2 and applied.finish is not None  # get + create only
    done = applied.finish()
    assert len(fake.calls) == 4 and done.outcome is apply.Outcome.CREATED and done.finish is None
    assert managers_of_replicas(done.obj) == {contract.FIELD_MANAGER_AUTOSCALER}


def test_a_child_as_our_last_apply_left_it_costs_no_request() -> None:
    fake, cache = SsaFake(), new_cache()
    apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=2, cache=cache)
    apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    watch(fake, cache)
    fake.calls.clear()
    again = apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=2, cache=cache)
    cm = apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    assert fake.calls == []
    assert again.outcome is cm.outcome is apply.Outcome.UNCHANGED
    # what status observation reads is there; the bulky parts are not kept
    assert again.obj["spec"] == {"replicas": 2} and "managedFields" not in again.obj["metadata"]
    assert "data" not in cm.obj


def test_before_the_watch_catches_up_our_last_answer_counts() -> None:
    fake, cache = SsaFake(), new_cache()
    applied = apply.apply_child(
        api=fake, desired=deployment(), owner=OWNER, initial_replicas=2, cache=cache, defer_hand_over=True
    )
    cache.observe(applied.obj)  # the watch has shown the create, not yet the hand-over and release
    assert applied.finish is not None
    applied.finish()
    fake.calls.clear()
    assert (
        apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=2, cache=cache).outcome
        is apply.Outcome.UNCHANGED
    )
    assert fake.calls == []


def test_a_changed_body_is_applied_without_reading_first() -> None:
    fake, cache = SsaFake(), new_cache()
    apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=1, cache=cache)
    watch(fake, cache)
    fake.calls.clear()
    updated = apply.apply_child(
        api=fake, desired=deployment(image="img:2"), owner=OWNER, initial_replicas=1, cache=cache
    )
    assert fake.calls == [f"apply Deployment/svc-decode {contract.FIELD_MANAGER_RECONCILER}"]
    assert updated.outcome is apply.Outcome.UPDATED
    assert fake.objects[("Deployment", "svc-decode")]["spec"]["replicas"] == 1  # the autoscaler's, untouched


def test_drift_by_another_manager_is_taken_back() -> None:
    fake, cache = SsaFake(), new_cache()
    apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=1, cache=cache)
    fake.apply(
        obj={
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "svc-decode", "namespace": "n", "labels": {"x": "edited"}},
        },
        field_manager="kubectl-edit",
        force=True,
    )
    watch(fake, cache)
    fake.calls.clear()
    taken = apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=1, cache=cache)
    assert fake.calls == [f"apply Deployment/svc-decode {contract.FIELD_MANAGER_RECONCILER}"]
    assert taken.outcome is apply.Outcome.UPDATED
    assert fake.objects[("Deployment", "svc-decode")]["metadata"]["labels"] == {"x": "a"}


def test_a_foreign_object_in_the_cache_is_still_refused_after_a_read() -> None:
    fake, cache = SsaFake(), new_cache()
    other = apply.Owner(name="other", uid="uid-other")
    apply.apply_child(api=fake, desired=config_map(), owner=other, initial_replicas=None, cache=cache)
    watch(fake, cache)
    fake.calls.clear()
    with pytest.raises(apply.NameConflict):
        apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    assert fake.calls == ["get ConfigMap/svc-config"]


def test_an_entry_too_old_to_trust_means_read_and_apply_again() -> None:
    fake, clock = SsaFake(), Clock()
    cache = new_cache(clock)
    apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    watch(fake, cache)
    clock.now += child_cache.MAX_AGE_SECONDS + 1
    fake.calls.clear()
    apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    assert fake.calls == ["get ConfigMap/svc-config", f"apply ConfigMap/svc-config {contract.FIELD_MANAGER_RECONCILER}"]
    # the apply answered with the cached version: the entry is current again, the next costs nothing
    fake.calls.clear()
    apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    assert fake.calls == []


def test_a_deleted_child_is_forgotten_and_created_again() -> None:
    fake, cache = SsaFake(), new_cache()
    apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    watch(fake, cache)
    gone = fake.objects.pop(("ConfigMap", "svc-config"))
    cache.forget(gone)
    fake.calls.clear()
    again = apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    assert again.outcome is apply.Outcome.CREATED and fake.calls[0] == "get ConfigMap/svc-config"


def test_a_child_gone_before_its_deleted_event_is_made_again_with_its_hand_over() -> None:
    fake, cache = SsaFake(), new_cache()
    apply.apply_child(api=fake, desired=deployment(), owner=OWNER, initial_replicas=3, cache=cache)
    watch(fake, cache)
    del fake.objects[("Deployment", "svc-decode")], fake.owned[("Deployment", "svc-decode")]
    fake.calls.clear()
    again = apply.apply_child(api=fake, desired=deployment(image="img:2"), owner=OWNER, initial_replicas=3, cache=cache)
    assert again.outcome is apply.Outcome.CREATED
    assert [c.split()[-1] for c in fake.calls] == [contract.FIELD_MANAGER_RECONCILER, contract.FIELD_MANAGER_AUTOSCALER]
    assert again.obj["spec"]["replicas"] == 3 and managers_of_replicas(again.obj) == {contract.FIELD_MANAGER_AUTOSCALER}


def test_unwatched_kinds_are_never_kept() -> None:
    cache = new_cache()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "n", "resourceVersion": "1"}}
    assert not cache.observe(secret)
    cache.record(child_cache.key_of(secret), digest="d", result=secret)
    assert cache.sizes() == {"seen": 0, "records": 0, "echoes": 0, "plans": 0}


def _event(type_: str | None, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": type_, "object": obj}


def test_child_events_reconcile_the_owner_but_not_for_our_own_echo() -> None:
    fake, cache = SsaFake(), new_cache()
    applied = apply.apply_child(api=fake, desired=config_map(), owner=OWNER, initial_replicas=None, cache=cache)
    ours = applied.obj
    owner_key = ("n", OWNER.name)
    assert handlers.child_event_target(event=_event("ADDED", ours), body=ours, children=cache, known={}) is None
    # a later write by someone else is not an echo
    fake.apply(
        obj={**config_map("2"), "metadata": {"name": "svc-config", "namespace": "n"}},
        field_manager="kubectl-edit",
        force=True,
    )
    theirs = fake.objects[("ConfigMap", "svc-config")]
    assert (
        handlers.child_event_target(event=_event("MODIFIED", theirs), body=theirs, children=cache, known={})
        == owner_key
    )
    # the initial listing of a known InferenceService is left to its resume handler
    assert (
        handlers.child_event_target(event=_event(None, theirs), body=theirs, children=cache, known={owner_key: None})
        is None
    )
    assert (
        handlers.child_event_target(event=_event("DELETED", theirs), body=theirs, children=cache, known={}) == owner_key
    )
    assert cache.seen(child_cache.key_of(theirs)) is None


def _watch_fake(fake: FakeKube, cache: child_cache.ChildCache) -> None:
    for (kind, _name), obj in fake.objects.items():
        if kind != contract.KIND:  # a cache of unwatched kinds keeps nothing of them
            cache.observe(obj)


def test_an_unchanged_service_is_reconciled_without_render_or_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube()
    cache = child_cache.ChildCache.for_resources(handlers.CACHED_RESOURCES)
    fake.objects[(contract.KIND, NAME)] = isvc_obj(mode="Disaggregated")

    def run() -> reconcile.Result:
        live = fake.get(kind=kube.INFERENCE_SERVICE, namespace="n", name=NAME)
        assert live is not None
        return reconcile.reconcile(api=fake, obj=live, settings=SETTINGS, nodes=reconcile.NodeCache(), children=cache)

    assert run().created
    _watch_fake(fake, cache)
    fake.writes.clear()
    renders: list[str] = []
    real_render = render.render_children

    def counting_render(**kwargs: Any) -> list[dict[str, Any]]:
        renders.append("render")
        return real_render(**kwargs)

    monkeypatch.setattr(render, "render_children", counting_render)
    result = run()
    assert renders == [] and not result.created and not result.updated
    # no child is written, nor the handoff key (its watch shows it as this service's own)
    assert [w for w in fake.writes if not w[0].startswith(contract.KIND)] == []
    # a key deleted by hand (its watch forgets it) is created again by the next reconcile
    cache.forget(fake.objects.pop(("Secret", f"{NAME}-kv-handoff")))
    fake.writes.clear()
    run()
    assert renders == [] and [w for w in fake.writes if w[0].startswith("Secret")] == [
        (f"Secret/{NAME}-kv-handoff", "create")
    ]
    # a new generation is rendered and applied again
    fake.objects[(contract.KIND, NAME)] = isvc_obj(mode="Disaggregated", generation=2)
    fake.objects[(contract.KIND, NAME)]["spec"]["runtime"] = {"image": "other:2"}
    run()
    assert renders == ["render"]
    assert any(verb == "apply" for _obj, verb in fake.writes)
