"""Hostile review: a spec larger than the annotations' 256 KiB made kopf fail forever.

kopf kept the last handled spec as JSON in the annotation
``splitserve.dev/last-handled-configuration``; all annotations of an object share 256 KiB, and
a pool's affinity is a list of strings without a bound, so the API server refused kopf's
bookkeeping patch (422) after each reconcile and kopf handled the object again and again.
Now kopf keeps a digest of the essence (:mod:`splitserve_operator.diffbase`).

The first test runs the operator's own kopf settings and handlers against a real
kube-apiserver (etcd, no controllers: Deployments are created, no pods) with the generated
CRD; it skips without the harness' binaries, as the other real-API-server tests do. The other
tests pin what kopf compares: an unchanged object handled by the previous version (whole
essence in the annotation) is not a change, a spec edit is, the pause annotation is not.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import crdgen
import kopf
import pytest
from autoscaler_testing import bare_apiserver, wait_until
from kubernetes.config import kube_config

import splitserve_contract as contract
from splitserve_operator import api as crd_api
from splitserve_operator import diffbase, handlers, kube, main, reconcile
from splitserve_operator.metrics import OperatorMetrics

NS = "big"
NAME = "huge"
ANNOTATION = f"{main.ANNOTATION_PREFIX}/last-handled-configuration"
ANNOTATIONS_LIMIT = 256 * 1024
CRD = kube.Kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False)
NAMESPACE = kube.Kind("v1", "Namespace", "namespaces", namespaced=False)
SERVICE_ACCOUNT = kube.Kind("v1", "ServiceAccount", "serviceaccounts")


def _affinity(values: int) -> dict[str, Any]:
    """A preferred node affinity of ``values`` valid label values of 63 characters, in as many
    expressions and terms of at most 32 as the CRD allows (its strings have no bound)."""
    names = [f"z{i:07d}".ljust(63, "x") for i in range(values)]
    expressions = [{"key": "zone", "operator": "In", "values": names[i : i + 32]} for i in range(0, values, 32)]
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": expressions[i : i + 32]}}
                for i in range(0, len(expressions), 32)
            ]
        }
    }


def _manifest(*, values: int) -> dict[str, Any]:
    return {
        "apiVersion": crd_api.API_VERSION_STRING,
        "kind": contract.KIND,
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "mode": "Aggregated",
            "model": {"uri": "hf://org/model"},
            "aggregated": {
                "replicas": {"min": 1, "max": 1},
                "resources": {"gpus": 0, "cpu": "1"},
                "affinity": _affinity(values),
            },
            "autoscaling": {"enabled": False},
        },
    }


@dataclasses.dataclass(frozen=True)
class Server:
    api: kube.Kube
    kubeconfig: Path
    """The admin's kubeconfig: the operator's own login (kopf.login_via_client) reads it."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    state = tmp_path_factory.mktemp("large-spec")
    with bare_apiserver(state) as running:
        api = kube.Kube(api_client=running.api_client)
        api.create(kind=CRD, namespace=None, obj=crdgen.crd())
        api.create(kind=NAMESPACE, namespace=None, obj={"metadata": {"name": NS}})
        api.create(kind=SERVICE_ACCOUNT, namespace=NS, obj={"metadata": {"name": "default"}})
        kubeconfig = state / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "admin",
                    "clusters": [
                        {
                            "name": "c",
                            "cluster": {"server": running.url, "certificate-authority": str(running.pki.ca_cert)},
                        }
                    ],
                    "users": [
                        {
                            "name": "admin",
                            "user": {
                                "client-certificate": str(running.pki.admin.cert),
                                "client-key": str(running.pki.admin.key),
                            },
                        }
                    ],
                    "contexts": [{"name": "admin", "context": {"cluster": "c", "user": "admin"}}],
                }
            )
        )
        yield Server(api, kubeconfig)


async def _create_when_served(api: kube.Kube, obj: dict[str, Any]) -> None:
    async def created() -> bool:
        try:
            await asyncio.to_thread(api.create, kind=kube.INFERENCE_SERVICE, namespace=NS, obj=obj)
        except Exception as exc:  # noqa: BLE001 - 404 until the CRD is served
            if getattr(exc, "status", None) == 404:
                return False
            raise
        return True

    await wait_until(created, timeout_seconds=30, poll_seconds=0.2, what="the CRD served")


async def test_a_spec_larger_than_the_annotations_limit_is_handled_once(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kopf.login_via_client loads the client library's default kubeconfig (read from
    # $KUBECONFIG when the library was imported)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(server.kubeconfig))
    manifest = _manifest(values=5000)
    assert len(json.dumps(manifest["spec"])) > ANNOTATIONS_LIMIT
    await _create_when_served(server.api, manifest)
    ctx = handlers.OperatorContext(
        api=server.api,
        settings=reconcile.ReconcileSettings(runtime_image="img:1"),
        metrics=OperatorMetrics.create(),
        namespaces=(NS,),
    )
    registry, _ = handlers.build_registry(ctx=ctx)
    stop = asyncio.Event()
    operator = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=main.kopf_settings(identity="test", namespaced=True),
            standalone=True,
            namespaces=[NS],
            stop_flag=stop,
        )
    )

    def isvc() -> dict[str, Any]:
        found = server.api.get(kind=kube.INFERENCE_SERVICE, namespace=NS, name=NAME)
        assert found is not None
        return dict(found)

    def settled() -> bool:
        obj = isvc()
        ready = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"]
        return ANNOTATION in (obj["metadata"].get("annotations") or {}) and bool(ready)

    try:
        # before the fix: the children and the status were written, but kopf's annotation
        # patch was refused (metadata.annotations: Too long) and kopf handled it again and again
        await wait_until(
            settled, timeout_seconds=90, poll_seconds=0.2, what="kopf's diff-base stored and the status written"
        )
        deployment = server.api.get(kind=kube.DEPLOYMENT, namespace=NS, name=f"{NAME}-engine")
        assert deployment is not None
        pod_affinity = deployment["spec"]["template"]["spec"]["affinity"]
        assert pod_affinity == manifest["spec"]["aggregated"]["affinity"]
        stored = isvc()["metadata"]["annotations"][ANNOTATION]
        assert len(stored) < 200 and diffbase.DIGEST_FIELD in json.loads(stored)
        # kopf's marker and its diff-base, no progress of a handler left to retry
        assert set(isvc()["metadata"]["annotations"]) == {ANNOTATION, f"{main.ANNOTATION_PREFIX}/kopf-managed"}
        # quiet: no write for 4 s (kopf retries a failed bookkeeping patch within that, so
        # before the fix this never came); a reconcile the children's events still trigger on
        # a loaded machine may write once more first, hence the minute to get there
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            before = isvc()
            await asyncio.sleep(4)
            if isvc()["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]:
                break
            assert asyncio.get_running_loop().time() < deadline, "the object never stops being written"
        assert ctx.metrics.reconcile_errors_total._value.get() == 0
    finally:
        stop.set()
        await asyncio.wait_for(operator, timeout=15)
        ctx.spec_lane.shutdown(wait=False)


# --------------------------------------------------------------------------- what kopf compares
def _storages() -> tuple[kopf.ProgressStorage, diffbase.DigestDiffBaseStorage, kopf.AnnotationsDiffBaseStorage]:
    settings = main.kopf_settings(identity="test", namespaced=True)
    storage = settings.persistence.diffbase_storage
    assert isinstance(storage, diffbase.DigestDiffBaseStorage)
    previous = kopf.AnnotationsDiffBaseStorage(prefix=main.ANNOTATION_PREFIX, key="last-handled-configuration")
    return settings.persistence.progress_storage, storage, previous


def _body(obj: dict[str, Any], **annotations: str) -> kopf.Body:
    obj = copy.deepcopy(obj)
    obj["metadata"].setdefault("annotations", {}).update(annotations)
    obj["metadata"]["resourceVersion"] = "7"
    obj["status"] = {"conditions": [{"type": "Ready", "status": "False"}]}
    return kopf.Body(cast(kopf.RawBody, obj))


def _compared(progress: kopf.ProgressStorage, essence: kopf.BodyEssence | None) -> Any:
    """What kopf's processing compares: the essence cleared by the progress storage."""
    return None if essence is None else progress.clear(essence=essence)


def test_an_object_handled_by_the_previous_version_is_not_a_change() -> None:
    progress, storage, previous = _storages()
    obj = _manifest(values=3)
    # what the previous version stored: kopf's whole essence, as processing stores it
    old_essence = progress.clear(essence=previous.build(body=_body(obj)))
    body = _body(obj, **{ANNOTATION: json.dumps(old_essence, separators=(",", ":")) + "\n", "team": "a"})
    changed = _body(obj, **{ANNOTATION: json.dumps(old_essence, separators=(",", ":")) + "\n", "team": "b"})
    assert _compared(progress, storage.fetch(body=_body(obj, **{ANNOTATION: json.dumps(old_essence)}))) == _compared(
        progress, storage.build(body=_body(obj))
    )
    assert _compared(progress, storage.fetch(body=body)) != _compared(progress, storage.build(body=changed))
    assert storage.fetch(body=_body(obj)) is None  # never handled: a creation


def test_a_spec_edit_is_a_change_and_pausing_is_not() -> None:
    progress, storage, _ = _storages()
    obj = _manifest(values=3)
    base = storage.build(body=_body(obj))
    assert diffbase.is_digest(base) and len(json.dumps(base)) < 100
    paused = storage.build(body=_body(obj, **{contract.ANNOTATION_PAUSED: "true"}))
    assert _compared(progress, paused) == _compared(progress, base)
    edited = copy.deepcopy(obj)
    edited["spec"]["aggregated"]["affinity"] = _affinity(4)
    assert storage.build(body=_body(edited)) != base
    labelled = copy.deepcopy(obj)
    labelled["metadata"]["labels"] = {"team": "a"}
    assert storage.build(body=_body(labelled)) != base  # labels are part of kopf's essence, as before
    # what a store writes is read back as it was built
    patch = kopf.Patch()
    storage.store(body=_body(obj), patch=patch, essence=base)
    assert storage.fetch(body=_body(obj, **{ANNOTATION: patch["metadata"]["annotations"][ANNOTATION]})) == base


def test_a_retried_handlers_message_is_bounded_for_kopfs_progress_annotation() -> None:
    # kopf stores str(TemporaryError) in the progress annotation; an API server's message may
    # quote a value of the spec, which may be as large as the annotations' whole budget
    quoted = 'Deployment.apps "huge-engine" is invalid: values[0]: Invalid value: "' + "x" * 300_000 + '"'
    bounded = handlers.progress_message(quoted)
    assert len(bounded) <= 1024 and bounded.startswith('Deployment.apps "huge-engine" is invalid')
    assert handlers.progress_message("short") == "short"
