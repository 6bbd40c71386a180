"""What the operator owns, against planted and deleted objects, on the real API server with the
chart's operator (a hostile review of the operator's ownership of what it creates).

* A planted ``<name>-epp`` ServiceAccount and Role (router mode InferencePool): NameConflict, and
  neither the RoleBinding between them nor the endpoint picker that would run as them is made.
* A planted ``<name>-kv-handoff`` Secret: NameConflict (it used to be adopted silently), and no
  pool that would mount it is made.
* A deleted key Secret is created again at once (its deletion is watched, metadata only), and
  removing the pause annotation puts back what changed during the pause at once.

One operator release (namespace scope, InferencePool mode allowed, the GIE CRDs installed)
serves the module. Pools run on kwok GPU nodes; the router runs on the kubelet node. Cases run
one at a time and delete what they made.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_e2e import gie
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import condition, get_isvc, pod_summary
from splitserve_e2e.kwok import KWOK_NODE_LABEL, KWOK_NODE_LABEL_VALUE, kwok_toleration
from splitserve_e2e.stack import (
    ISVC_PLURAL,
    MODEL_NAME,
    ModelHub,
    create_hub_token_secret,
    create_namespace,
    install_operator,
    remove_release,
)
from splitserve_operator import api

pytestmark = pytest.mark.e2e

STATUS_TIMEOUT_SECONDS = 120.0
AT_ONCE_SECONDS = 20.0
"""How soon "at once" must be: well under the minute after which something else used to repair it."""
QUIET_SECONDS = 6.0


@pytest.fixture(scope="module")
def gie_crds(cluster: LocalCluster) -> Iterator[None]:
    """The GIE CRDs (the InferencePool kind), before the operator starts; deleted at the end."""
    manifests = gie.ensure_gie_crds()
    for manifest in manifests:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(manifest))
    names = [_crd_name(m) for m in manifests]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{n}" for n in names))
    yield
    cluster.kubectl("delete", "crd", "--ignore-not-found", "--timeout=60s", *names, check=False, timeout_seconds=90)


def _crd_name(manifest: Path) -> str:
    match = re.search(r"^  name: (\S+)$", manifest.read_text(), re.MULTILINE)
    assert match is not None, f"no metadata.name in {manifest}"
    return match.group(1)


@pytest.fixture(scope="module")
def ns(cluster: LocalCluster, image: str, model_hub: ModelHub, gie_crds: None) -> Iterator[str]:
    name = f"owned-{uuid.uuid4().hex[:5]}"
    create_namespace(cluster, name, restricted=True)
    try:
        create_hub_token_secret(cluster=cluster, namespace=name, hub=model_hub)
        install_operator(cluster=cluster, namespace=name, image=image, inference_pool=True)
        yield name
    finally:
        remove_release(cluster=cluster, namespace=name)  # and the namespace


def _kwok_pool() -> dict[str, Any]:
    return {
        "replicas": {"min": 1, "max": 1},
        "resources": {"gpus": 1},
        "tolerations": [kwok_toleration()],
        "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE},
    }


def _manifest(name: str, ns: str, hub: ModelHub, *, mode: str, router: dict[str, Any] | None = None) -> dict[str, Any]:
    pools = {"aggregated": _kwok_pool()} if mode == "Aggregated" else {"prefill": _kwok_pool(), "decode": _kwok_pool()}
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": contract.KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "model": {
                "uri": f"hf://{MODEL_NAME}",
                "dtype": "float32",
                "maxModelLen": 1024,
                "hubEndpoint": hub.endpoint,
                "hubTokenSecretRef": {"name": hub.token_secret},
            },
            "runtime": {"extraArgs": ["--device", "cpu", "--num-kv-blocks", "64"]},
            "mode": mode,
            **pools,
            "autoscaling": {"enabled": False},
            **({"router": router} if router else {}),
        },
    }


def _apply(cluster: LocalCluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input_text=json.dumps(obj))


def _get(cluster: LocalCluster, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _delete(cluster: LocalCluster, ns: str, name: str) -> None:
    cluster.kubectl("delete", ISVC_PLURAL, name, "-n", ns, "--ignore-not-found", "--wait=false")
    with contextlib.suppress(TimeoutError):
        cluster.wait_for(
            lambda: (
                not json.loads(
                    cluster.kubectl(
                        "get", "pods", "-n", ns, "-l", f"{contract.LABEL_INSTANCE}={name}", "-o", "json"
                    ).stdout
                )["items"]
            ),
            timeout_seconds=60,
            what=f"pods of {name} gone",
        )


def _stalled(cluster: LocalCluster, ns: str, name: str, reason: str, words: tuple[str, ...]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = get_isvc(cluster=cluster, namespace=ns, name=name)
        cond = condition(obj, ConditionType.STALLED) or {}
        ok = (
            cond.get("status") == "True"
            and cond.get("reason") == reason
            and all(w in str(cond.get("message", "")) for w in words)
        )
        return obj if ok else None

    try:
        return cluster.wait_for(
            check, timeout_seconds=STATUS_TIMEOUT_SECONDS, interval_seconds=1.0, what=f"{name}: Stalled/{reason}"
        )
    except TimeoutError as error:
        status = (get_isvc(cluster=cluster, namespace=ns, name=name).get("status") or {}).get("conditions")
        raise TimeoutError(f"{error}\nconditions: {json.dumps(status)}") from None


def _settled(cluster: LocalCluster, ns: str, name: str) -> None:
    """Once the pools' pods are ready (kwok) and the generation is observed, and then a quiet
    while: nothing is left to trigger a reconcile (the router on the kubelet node cannot
    become ready without pools that serve, and its unreadiness triggers none)."""

    def check() -> bool:
        obj = get_isvc(cluster=cluster, namespace=ns, name=name)
        st = obj.get("status") or {}
        return st.get("observedGeneration") == obj["metadata"]["generation"] and all(
            (st.get(role) or {}).get("readyReplicas", 0) >= 1 for role in ("prefill", "decode")
        )

    try:
        cluster.wait_for(
            check, timeout_seconds=STATUS_TIMEOUT_SECONDS, interval_seconds=1.0, what=f"{name}: pools ready"
        )
    except TimeoutError as error:
        raise TimeoutError(f"{error}\npods: {pod_summary(cluster=cluster, namespace=ns)}") from None
    time.sleep(QUIET_SECONDS)


def _warned(cluster: LocalCluster, ns: str, name: str, reason: str, words: str) -> bool:
    result = cluster.kubectl(
        "get",
        "events",
        "-n",
        ns,
        "-o",
        "json",
        "--field-selector",
        f"involvedObject.kind={contract.KIND},involvedObject.name={name},reason={reason}",
    )
    return any(e.get("type") == "Warning" and words in e.get("message", "") for e in json.loads(result.stdout)["items"])


def test_planted_picker_account_and_role_are_neither_bound_nor_run_as(
    cluster: LocalCluster, ns: str, model_hub: ModelHub
) -> None:
    name = f"o-epp-{uuid.uuid4().hex[:4]}"
    picker = f"{name}-epp"
    cluster.kubectl("create", "serviceaccount", picker, "-n", ns)
    # what the operator itself holds, so the API server's escalation check would not stop a binding
    cluster.kubectl(
        "create", "role", picker, "-n", ns, "--verb=get,list,create,patch", "--resource=deployments,configmaps"
    )
    try:
        _apply(cluster, _manifest(name, ns, model_hub, mode="Aggregated", router={"mode": "InferencePool"}))
        _stalled(
            cluster,
            ns,
            name,
            Reason.NAME_CONFLICT,
            (f"ServiceAccount {picker}", f"Role {picker}", f"Deployment/{picker}", "not applied"),
        )
        cluster.wait_for(
            lambda: _warned(cluster, ns, name, Reason.NAME_CONFLICT, picker),
            timeout_seconds=20,
            what="a NameConflict Warning Event",
        )
        time.sleep(QUIET_SECONDS)  # the behaviour under test is "nothing is made", whatever events come
        assert _get(cluster, ns, "rolebinding", picker) is None
        assert _get(cluster, ns, "deployment", picker) is None
        pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
        assert all(p["spec"].get("serviceAccountName") != picker for p in pods)
        for kind in ("serviceaccount", "role"):
            planted = _get(cluster, ns, kind, picker)
            assert planted is not None and not planted["metadata"].get("ownerReferences"), planted
        # the rest of the service is made: its pool
        assert _get(cluster, ns, "deployment", f"{name}-engine") is not None
    finally:
        _delete(cluster, ns, name)
        cluster.kubectl("delete", "serviceaccount,role", picker, "-n", ns, "--ignore-not-found", check=False)


def test_planted_handoff_key_is_a_name_conflict_and_no_pool_mounts_it(
    cluster: LocalCluster, ns: str, model_hub: ModelHub
) -> None:
    name = f"o-key-{uuid.uuid4().hex[:4]}"
    secret = f"{name}{contract.HANDOFF_KEY_SECRET_SUFFIX}"
    cluster.kubectl(
        "create",
        "secret",
        "generic",
        secret,
        "-n",
        ns,
        f"--from-literal={contract.HANDOFF_KEY_SECRET_KEY}=chosen-by-whoever-creates-secrets",
    )
    planted = _get(cluster, ns, "secret", secret)
    assert planted is not None
    try:
        _apply(cluster, _manifest(name, ns, model_hub, mode="Disaggregated"))
        obj = _stalled(
            cluster,
            ns,
            name,
            Reason.NAME_CONFLICT,
            (f"Secret {secret}", f"Deployment/{name}-prefill", f"Deployment/{name}-decode"),
        )
        assert "chosen-by" not in json.dumps(obj.get("status"))
        cluster.wait_for(
            lambda: _warned(cluster, ns, name, Reason.NAME_CONFLICT, secret),
            timeout_seconds=20,
            what="a NameConflict Warning Event",
        )
        time.sleep(QUIET_SECONDS)
        for role in ("prefill", "decode"):
            assert _get(cluster, ns, "deployment", f"{name}-{role}") is None, role
        assert _get(cluster, ns, "deployment", f"{name}-router") is not None  # it does not mount the key
        after = _get(cluster, ns, "secret", secret)
        assert after is not None and after["data"] == planted["data"]
        assert after["metadata"]["resourceVersion"] == planted["metadata"]["resourceVersion"]  # untouched
    finally:
        _delete(cluster, ns, name)
        cluster.kubectl("delete", "secret", secret, "-n", ns, "--ignore-not-found", check=False)


def test_deleted_handoff_key_is_created_again_at_once_and_owned(
    cluster: LocalCluster, ns: str, model_hub: ModelHub
) -> None:
    name = f"o-del-{uuid.uuid4().hex[:4]}"
    secret = f"{name}{contract.HANDOFF_KEY_SECRET_SUFFIX}"
    try:
        _apply(cluster, _manifest(name, ns, model_hub, mode="Disaggregated"))
        _settled(cluster, ns, name)  # nothing else is left to trigger a reconcile
        uid = get_isvc(cluster=cluster, namespace=ns, name=name)["metadata"]["uid"]
        first = _get(cluster, ns, "secret", secret)
        assert first is not None and [r["uid"] for r in first["metadata"]["ownerReferences"]] == [uid]
        cluster.kubectl("delete", "secret", secret, "-n", ns)
        again = cluster.wait_for(
            lambda: (
                (s := _get(cluster, ns, "secret", secret)) and s["metadata"]["uid"] != first["metadata"]["uid"] and s
            ),
            timeout_seconds=AT_ONCE_SECONDS,
            what=f"Secret {secret} created again",
        )
        assert [(r["uid"], r.get("controller")) for r in again["metadata"]["ownerReferences"]] == [(uid, True)]
        # garbage-collected with the service
        _delete(cluster, ns, name)
        cluster.wait_for(
            lambda: _get(cluster, ns, "secret", secret) is None,
            timeout_seconds=60,
            what=f"Secret {secret} collected with its InferenceService",
        )
        can = {
            verb: cluster.kubectl(
                "auth", "can-i", verb, "secrets", "-n", ns, f"--as=system:serviceaccount:{ns}:splitserve", check=False
            ).stdout.strip()
            for verb in ("create", "get", "list", "watch", "update", "delete")
        }
        assert can == {"create": "yes", "get": "no", "list": "yes", "watch": "yes", "update": "no", "delete": "no"}
    finally:
        _delete(cluster, ns, name)


def test_unpausing_puts_back_what_changed_during_the_pause_at_once(
    cluster: LocalCluster, ns: str, model_hub: ModelHub
) -> None:
    name = f"o-pause-{uuid.uuid4().hex[:4]}"
    service = f"{name}-router"
    try:
        _apply(cluster, _manifest(name, ns, model_hub, mode="Disaggregated"))
        _settled(cluster, ns, name)
        cluster.kubectl("annotate", ISVC_PLURAL, name, "-n", ns, f"{contract.ANNOTATION_PAUSED}=true")
        cluster.kubectl("delete", "service", service, "-n", ns)
        time.sleep(QUIET_SECONDS)  # paused: nothing is put back
        assert _get(cluster, ns, "service", service) is None
        cluster.kubectl("annotate", ISVC_PLURAL, name, "-n", ns, f"{contract.ANNOTATION_PAUSED}-")
        cluster.wait_for(
            lambda: _get(cluster, ns, "service", service),
            timeout_seconds=AT_ONCE_SECONDS,
            what=f"Service {service} put back after the unpause",
        )
    finally:
        _delete(cluster, ns, name)
