"""What the operator owns, against planted objects (a hostile review of the operator).

* A planted ``<name>-epp`` ServiceAccount or Role (InferencePool mode) used to be reported as a
  NameConflict "left untouched" while the operator still created the RoleBinding between them
  and ran the endpoint picker (a user-chosen image, its token mounted) as that account: now no
  child that uses an object this InferenceService does not control is applied
  (:mod:`splitserve_operator.dependencies`).
* A planted ``<name>-kv-handoff`` Secret used to be adopted silently (its create's 409 read as
  "it is there"), fixing the key a future service's pods trust: now it is a NameConflict and
  the pools that would mount it are not applied.
* A deleted key Secret came back only at some unrelated event, and removing the pause
  annotation triggered nothing: now the operator's own Secrets are watched (metadata only) and
  an unpause reconciles at once (:mod:`splitserve_operator.handlers`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from kube_testing import NAME, NAMESPACE, FakeKube, api_error, isvc_obj, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_operator import (
    child_cache,
    dependencies,
    handlers,
    handoff_key,
    kube,
    render,
    secret_watch,
)
from splitserve_operator.api import InferenceService

PICKER = f"{NAME}-epp"
KEY_SECRET = f"{NAME}-kv-handoff"
FOREIGN = {"apiVersion": "v1", "kind": "Secret", "name": "someone", "uid": "other-uid", "controller": True}


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = record_events(monkeypatch)
    return out


def _picker_isvc(mode: str = "Disaggregated") -> dict[str, Any]:
    obj: dict[str, Any] = isvc_obj(mode=mode)
    obj["spec"]["router"] = {"mode": "InferencePool"}
    return obj


def _plant(fake: FakeKube, kind: str, name: str, **extra: Any) -> dict[str, Any]:
    """An object someone else made under a child's name (no owner reference to the service)."""
    api_version = kube.KINDS[next(k for k in kube.KINDS if k[1] == kind)].api_version
    obj = {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"planted-{kind}", "resourceVersion": "7"},
        **extra,
    }
    fake.objects[(kind, name)] = obj
    planted: dict[str, Any] = copy.deepcopy(obj)
    return planted


def _written(fake: FakeKube) -> set[str]:
    return {what for what, verb in fake.writes if verb in ("apply", "create")}


# ---------------------------------------------------------------- the endpoint picker's account
@pytest.mark.parametrize("planted", [("ServiceAccount",), ("Role",), ("ServiceAccount", "Role")])
def test_a_planted_picker_account_or_role_is_never_bound_nor_run_as(
    planted: tuple[str, ...], posted: list[tuple[str, str, str]]
) -> None:
    fake = FakeKube()
    before = {kind: _plant(fake, kind, PICKER) for kind in planted}
    result, conds = run(fake, _picker_isvc())
    assert result.outcome == Reason.NAME_CONFLICT
    written = _written(fake)
    # the RoleBinding between them and the picker that would run as them: never sent
    assert f"RoleBinding/{PICKER}" not in written and f"Deployment/{PICKER}" not in written
    assert ("RoleBinding", PICKER) not in fake.objects and ("Deployment", PICKER) not in fake.objects
    for kind, obj in before.items():
        assert fake.objects[(kind, PICKER)] == obj  # left untouched
    # the rest of the service is applied (its pools, the key, the picker's Service)
    assert {f"Deployment/{NAME}-prefill", f"Deployment/{NAME}-decode", f"Secret/{KEY_SECRET}"} <= written
    stalled = conds[ConditionType.STALLED]
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.NAME_CONFLICT)
    assert f"RoleBinding/{PICKER}" in stalled["message"] and f"Deployment/{PICKER}" in stalled["message"]
    assert "not applied" in stalled["message"]
    assert [e for e in posted if e[1] == Reason.NAME_CONFLICT and f"Deployment/{PICKER}" in e[2]]


def test_a_planted_picker_role_binding_keeps_the_picker_from_running() -> None:
    fake = FakeKube()
    _plant(
        fake,
        "RoleBinding",
        PICKER,
        roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
        subjects=[{"kind": "ServiceAccount", "name": PICKER, "namespace": NAMESPACE}],
    )
    result, _ = run(fake, _picker_isvc())
    assert result.outcome == Reason.NAME_CONFLICT
    written = _written(fake)
    assert {f"ServiceAccount/{PICKER}", f"Role/{PICKER}"} <= written
    assert f"Deployment/{PICKER}" not in written  # it would run as an account bound to admin


def test_a_planted_picker_service_is_not_named_by_the_inference_pool() -> None:
    fake = FakeKube()
    _plant(fake, "Service", PICKER, spec={"type": "ExternalName", "externalName": "evil.example"})
    result, _ = run(fake, _picker_isvc())
    assert result.outcome == Reason.NAME_CONFLICT
    assert f"InferencePool/{NAME}" not in _written(fake)  # the Gateway would call the planted picker


def test_once_the_planted_objects_are_gone_everything_is_applied() -> None:
    fake = FakeKube()
    _plant(fake, "ServiceAccount", PICKER)
    assert run(fake, _picker_isvc())[0].outcome == Reason.NAME_CONFLICT
    del fake.objects[("ServiceAccount", PICKER)]
    result, _ = run(fake, _picker_isvc())
    assert result.outcome != Reason.NAME_CONFLICT and not result.conflicts
    assert {f"RoleBinding/{PICKER}", f"Deployment/{PICKER}", f"InferencePool/{NAME}"} <= _written(fake)


# ---------------------------------------------------------------- the KV handoff key
@pytest.mark.parametrize("owner", [None, FOREIGN], ids=["unowned", "owned-by-another"])
def test_a_planted_handoff_key_is_a_name_conflict_and_no_pool_mounts_it(
    owner: dict[str, Any] | None, posted: list[tuple[str, str, str]]
) -> None:
    fake = FakeKube()
    planted = _plant(fake, "Secret", KEY_SECRET, type="Opaque", data={contract.HANDOFF_KEY_SECRET_KEY: "QUFBQQ=="})
    if owner is not None:
        planted["metadata"]["ownerReferences"] = [owner]
        fake.objects[("Secret", KEY_SECRET)] = copy.deepcopy(planted)
    result, conds = run(fake, isvc_obj(mode="Disaggregated"))
    assert result.outcome == Reason.NAME_CONFLICT and f"Secret/{KEY_SECRET}" in result.conflicts
    assert fake.objects[("Secret", KEY_SECRET)] == planted  # untouched
    written = _written(fake)
    assert f"Deployment/{NAME}-prefill" not in written and f"Deployment/{NAME}-decode" not in written
    assert f"Deployment/{NAME}-router" in written  # the router does not mount the key
    stalled = conds[ConditionType.STALLED]
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.NAME_CONFLICT)
    assert f"Secret {KEY_SECRET} already exists" in stalled["message"]
    assert f"Deployment/{NAME}-prefill" in stalled["message"]
    if owner is not None:
        assert "controlled by Secret/someone" in stalled["message"]
    assert [e for e in posted if e[:2] == ("Warning", Reason.NAME_CONFLICT) and KEY_SECRET in e[2]]
    assert "QUFBQQ" not in stalled["message"]  # no Secret data in a message


def test_the_services_own_key_found_by_a_later_reconcile_is_kept() -> None:
    fake = FakeKube()
    run(fake, isvc_obj(mode="Disaggregated"))
    key = fake.objects[("Secret", KEY_SECRET)]["data"]
    fake.writes.clear()
    result, _ = run(fake, isvc_obj(mode="Disaggregated", generation=2))
    assert not result.conflicts and fake.objects[("Secret", KEY_SECRET)]["data"] == key
    # the 409 is followed by a metadata-only look at that one name, never a read of the data
    assert ("Secret", "list metadata") in fake.writes and (f"Secret/{KEY_SECRET}", "get") not in fake.writes


def test_the_created_key_is_owned_by_the_service() -> None:
    fake = FakeKube()
    run(fake, isvc_obj(mode="Disaggregated"))
    refs = fake.objects[("Secret", KEY_SECRET)]["metadata"]["ownerReferences"]
    assert [(r["uid"], r["controller"], r["blockOwnerDeletion"]) for r in refs] == [("uid-1", True, True)]


def test_a_failed_key_create_keeps_the_pools_back_and_is_retried() -> None:
    fake = FakeKube()
    fake.errors[f"Secret/{KEY_SECRET}"] = api_error(500, "InternalError", "etcd is away")
    with pytest.raises(Exception, match="not applied"):
        run(fake, isvc_obj(mode="Disaggregated"))
    assert f"Deployment/{NAME}-prefill" not in _written(fake)


# ---------------------------------------------------------------- the dependency graph
def _rendered_picker_service() -> list[dict[str, Any]]:
    isvc = InferenceService.parse(_picker_isvc())
    return render.render_children(isvc=isvc, runtime_image="img:1", router_service_account="")


def _k(kind: str, name: str) -> child_cache.ChildKey:
    api_version = kube.KINDS[next(k for k in kube.KINDS if k[1] == kind)].api_version
    return (api_version, kind, NAMESPACE, name)


def test_dependencies_are_read_from_the_rendered_objects() -> None:
    key = _k("Secret", KEY_SECRET)
    edges = dependencies.needs(_rendered_picker_service(), also_made=[key])
    assert edges[_k("RoleBinding", PICKER)] == {_k("Role", PICKER), _k("ServiceAccount", PICKER)}
    assert edges[_k("Deployment", PICKER)] == {_k("ServiceAccount", PICKER), _k("RoleBinding", PICKER)}
    assert edges[_k("Deployment", f"{NAME}-prefill")] == {key} == edges[_k("Deployment", f"{NAME}-decode")]
    assert edges[_k("InferencePool", NAME)] == {_k("Service", PICKER)}
    edges[key] = set()
    waves = dependencies.waves(edges)
    assert {_k("ServiceAccount", PICKER), _k("Role", PICKER), key} <= set(waves[0])
    assert _k("RoleBinding", PICKER) in waves[1] and _k("Deployment", PICKER) in waves[2]
    stopped = dependencies.blocked(edges, {_k("Role", PICKER)})
    assert stopped == {_k("RoleBinding", PICKER): _k("Role", PICKER), _k("Deployment", PICKER): _k("Role", PICKER)}


# ---------------------------------------------------------------- watching the operator's Secrets
def _ours(rv: str = "5", *, owner: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": KEY_SECRET,
        "namespace": NAMESPACE,
        "uid": "s-1",
        "resourceVersion": rv,
        "labels": {contract.LABEL_INSTANCE: NAME, contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE},
    }
    if owner:
        meta["ownerReferences"] = [
            {
                "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
                "kind": contract.KIND,
                "name": NAME,
                "uid": "uid-1",
                "controller": True,
            }
        ]
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta}


def _cache() -> child_cache.ChildCache:
    return child_cache.ChildCache.for_resources(handlers.CACHED_RESOURCES)


def test_a_deleted_key_reconciles_its_service_at_once() -> None:
    cache = _cache()
    assert handlers.secret_event_target(event_type=None, secret=_ours(), children=cache) is None  # listing
    assert cache.seen(child_cache.key_of(_ours())) is not None
    assert handlers.secret_event_target(event_type="DELETED", secret=_ours(), children=cache) == (NAMESPACE, NAME)
    assert cache.seen(child_cache.key_of(_ours())) is None  # the next reconcile creates it again


def test_the_echo_of_our_create_triggers_nothing_and_a_stripped_owner_does() -> None:
    cache = _cache()
    cache.record(child_cache.key_of(_ours()), digest="", result=_ours("9"))
    assert handlers.secret_event_target(event_type="ADDED", secret=_ours("9"), children=cache) is None
    # someone removed its owner reference: no longer ours, the instance label names the service
    assert handlers.secret_event_target(event_type="MODIFIED", secret=_ours("10", owner=False), children=cache) == (
        NAMESPACE,
        NAME,
    )


def test_a_reconcile_sends_nothing_for_a_key_the_watch_shows_as_ours() -> None:
    fake = FakeKube()
    cache = _cache()
    cache.observe(_ours())
    owner = {"apiVersion": "x", "kind": contract.KIND, "name": NAME, "uid": "uid-1", "controller": True}
    assert not handoff_key.ensure(api=fake, isvc_name=NAME, namespace=NAMESPACE, owner_reference=owner, cache=cache)
    assert fake.writes == []


def test_unpausing_reconciles_at_once() -> None:
    paused: set[tuple[str, str]] = set()
    obj = isvc_obj()
    obj["metadata"]["annotations"] = {contract.ANNOTATION_PAUSED: "true"}
    assert handlers.unpause_target(event={"type": None}, body=obj, paused=paused) is None
    assert handlers.unpause_target(event={"type": "MODIFIED"}, body=obj, paused=paused) is None
    unpaused = isvc_obj()
    assert handlers.unpause_target(event={"type": "MODIFIED"}, body=unpaused, paused=paused) == (NAMESPACE, NAME)
    # only the transition counts: later events of a running object trigger nothing here
    assert handlers.unpause_target(event={"type": "MODIFIED"}, body=unpaused, paused=paused) is None
    assert paused == set()


class _WatchAPI:
    """Lists and watch streams handed out in order; records what was asked."""

    def __init__(self, lists: list[list[dict[str, Any]]], watches: list[list[dict[str, Any]]]) -> None:
        self.lists = lists
        self.watches = watches
        self.asked: list[tuple[str, str]] = []

    def list_metadata(
        self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> tuple[Sequence[dict[str, Any]], str]:
        self.asked.append(("list", label_selector))
        return [{**o, "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata"} for o in self.lists.pop(0)], "5"

    def watch_metadata(
        self,
        *,
        kind: kube.Kind,
        namespace: str | None,
        label_selector: str,
        resource_version: str,
        timeout_seconds: int,
    ) -> Iterator[dict[str, Any]]:
        self.asked.append(("watch", resource_version))
        yield from self.watches.pop(0)


def test_the_secret_watch_relists_after_410_and_reports_what_vanished() -> None:
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
    modified = {"type": "MODIFIED", "object": {**_ours("6"), "kind": "PartialObjectMetadata"}}
    fake = _WatchAPI(lists=[[_ours()], []], watches=[[modified, gone], []])
    seen: list[tuple[str | None, str, str]] = []
    watch: secret_watch.SecretWatch

    def on_change(event_type: str | None, secret: Mapping[str, Any]) -> None:
        seen.append((event_type, secret["kind"], secret["metadata"]["resourceVersion"]))
        if event_type == "DELETED":
            watch.stop()

    watch = secret_watch.SecretWatch(api=fake, namespace=NAMESPACE, on_change=on_change)
    watch.run_until_stopped()
    # listed (not an event), changed, then after the 410 the new list lacks it: deleted
    assert seen == [(None, "Secret", "5"), ("MODIFIED", "Secret", "6"), ("DELETED", "Secret", "6")]
    label = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_VALUE}"
    assert fake.asked[:3] == [("list", label), ("watch", "5"), ("list", label)]


class _RecordingClient:
    """Enough of ``kubernetes.client.ApiClient`` for :class:`kube.Kube`: records each request's
    path, query and headers, and answers with ``body``."""

    class _Raw:
        def __init__(self, body: bytes) -> None:
            self.body = body

        def stream(self, amt: int, decode_content: bool) -> Iterator[bytes]:
            yield self.body

        def release_conn(self) -> None:
            pass

    class _Response:
        def __init__(self, body: bytes) -> None:
            self.status, self.reason, self.body = 200, "OK", body
            self.response = _RecordingClient._Raw(body)

        def read(self) -> bytes:
            return self.body

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.sent: list[tuple[str, list[tuple[str, str]], dict[str, str]]] = []

    def param_serialize(
        self,
        *,
        method: str,
        resource_path: str,
        query_params: list[tuple[str, str]],
        header_params: dict[str, str],
        auth_settings: list[str],
        body: Any = None,
    ) -> tuple[str, str, dict[str, str], Any, Any]:
        self.sent.append((resource_path, list(query_params), dict(header_params)))
        return method, resource_path, header_params, body, None

    def call_api(
        self, method: str, url: str, header_params: dict[str, str], body: Any, _request_timeout: Any
    ) -> _Response:
        return _RecordingClient._Response(self.body)


def test_secrets_are_only_ever_asked_for_as_metadata() -> None:
    listed = b'{"kind":"PartialObjectMetadataList","metadata":{"resourceVersion":"42"},"items":[]}'
    client = _RecordingClient(listed)
    api = kube.Kube(api_client=client)  # type: ignore[arg-type]
    assert api.list_metadata(kind=kube.SECRET, namespace=NAMESPACE, field_selector="metadata.name=x") == ([], "42")
    client.body = b'{"type":"DELETED","object":{"metadata":{"name":"x","resourceVersion":"43"}}}\n'
    events = list(
        api.watch_metadata(
            kind=kube.SECRET, namespace=NAMESPACE, label_selector="a=b", resource_version="42", timeout_seconds=5
        )
    )
    assert [e["type"] for e in events] == ["DELETED"]
    for path, _query, headers in client.sent:
        assert path == f"/api/v1/namespaces/{NAMESPACE}/secrets"
        assert headers["Accept"].startswith("application/json;as=PartialObjectMetadata"), headers
    assert ("fieldSelector", "metadata.name=x") in client.sent[0][1]
    assert ("watch", "true") in client.sent[1][1] and ("resourceVersion", "42") in client.sent[1][1]
