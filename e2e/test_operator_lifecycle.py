"""The operator end to end: installed by its Helm chart, a container from the image on the
kubelet node with the chart's ServiceAccount (so the chart's RBAC is what it gets), against a real API server,
controller manager, scheduler and kwok GPU nodes.

One operator release serves the module (in its own namespace, namespace-scoped RBAC); every
test creates the InferenceServices it needs (the ``isvc`` fixture: applied and converged, with
a fresh name) so each test passes alone and in any order. The leader-election test installs its
own two-replica release in a namespace of its own, so killing its leader touches nobody else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import splitserve_contract as contract
from splitserve_e2e import gie
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.kwok import KWOK_NODE_LABEL, KWOK_NODE_LABEL_VALUE, kwok_toleration
from splitserve_e2e.stack import (
    MODEL_NAME,
    ModelHub,
    create_hub_token_secret,
    create_namespace,
    install_operator,
)
from splitserve_operator import api as isvc_api
from splitserve_operator import naming
from splitserve_operator.api import InferenceService, rules
from splitserve_operator.render import render_children

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "splitserve"
RELEASE = "ops"
HA_RELEASE = "ops-ha"
LEASE_DURATION_SECONDS = 15.0
RETRY_PERIOD_SECONDS = 2.0
CHILD_KINDS = ("deployments", "services", "configmaps", "poddisruptionbudgets", "networkpolicies")
CONVERGE_SECONDS = 180.0  # kwok pools converge in seconds; the bound absorbs a loaded 2-core CI machine
QUIET_SECONDS = 4.0
"""How long a "nothing is written" check watches: several reconcile triggers (Deployment status
events from kwok, the autoscaler's interval) happen within it."""
IN_FLIGHT_GRACE_SECONDS = 2.0
"""After pausing: how long a write the operator began before it saw the pause may take to land."""


# --------------------------------------------------------------------------- fixtures
def _install_operator(
    cluster: LocalCluster, image: str, hub: ModelHub, *, prefix: str, release: str, replicas: int
) -> str:
    """A fresh restricted namespace with the CRDs applied (like a platform team would: Helm
    installs crds/ only once, never upgrades), the hub's token Secret, and the operator
    installed there by Helm (namespace scope, no Prometheus: no autoscaling decisions);
    returns once a live operator pod holds the Lease."""
    name = f"{prefix}-{uuid.uuid4().hex[:5]}"
    create_namespace(cluster, name, restricted=True)
    create_hub_token_secret(cluster=cluster, namespace=name, hub=hub)
    install_operator(
        cluster=cluster, namespace=name, image=image, release=release, replicas=replicas, with_prometheus=False
    )
    _wait_leader(cluster, name, release=release)
    return name


def _uninstall_operator(cluster: LocalCluster, ns: str, *, release: str) -> None:
    cluster.helm("uninstall", release, "-n", ns, check=False)
    cluster.core().delete_namespace(ns)


@pytest.fixture(scope="module")
def ns(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    """The module's namespace with one operator replica installed by Helm (namespace scope)."""
    name = _install_operator(cluster, image, model_hub, prefix="e2e-operator", release=RELEASE, replicas=1)
    yield name
    _uninstall_operator(cluster, name, release=RELEASE)


@pytest.fixture
def ha_ns(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    """A namespace of its own with a two-replica operator release (leader election)."""
    name = _install_operator(cluster, image, model_hub, prefix="e2e-operator-ha", release=HA_RELEASE, replicas=2)
    yield name
    _uninstall_operator(cluster, name, release=HA_RELEASE)


@dataclasses.dataclass(frozen=True)
class Isvc:
    """An InferenceService a test owns: applied from ``manifest`` and converged."""

    name: str
    ns: str
    manifest: dict[str, Any]

    def child(self, suffix: str) -> str:
        return f"{self.name}-{suffix}"


@pytest.fixture
def isvc(cluster: LocalCluster, ns: str, tiny_model: ModelHub) -> Iterator[Isvc]:
    """A fresh InferenceService (prefill 2, decode 1), applied and waited for until both pools
    are ready at the current generation; deleted (children collected) afterwards."""
    name = f"alpha-{uuid.uuid4().hex[:5]}"
    manifest = _manifest(name, ns, model=tiny_model)
    _apply(cluster, manifest)
    _wait_pools(cluster, ns, name, prefill=2, decode=1)
    yield Isvc(name=name, ns=ns, manifest=manifest)
    _delete_isvc(cluster, ns, name)


def _delete_isvc(cluster: LocalCluster, ns: str, name: str) -> None:
    """Delete and wait (bounded, best effort) for its pods to go, so GPUs and the kubelet node's
    CPUs are free for the next test."""
    cluster.kubectl("delete", "inferenceservices.splitserve.dev", name, "-n", ns, "--ignore-not-found", "--wait=false")
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


@pytest.fixture(scope="module")
def tiny_model(model_hub: ModelHub) -> ModelHub:
    """Where the tiny model comes from: the router really runs on the kubelet node and
    downloads its tokenizer from the session's hub."""
    return model_hub


def _manifest(
    name: str,
    namespace: str,
    *,
    model: ModelHub,
    prefill_min: int = 2,
    decode_min: int = 1,
    decode_gpus: int = 2,
    **spec: Any,
) -> dict[str, Any]:
    """Parallelism stays at its default (tensor 1, pipeline 1)."""
    kwok = {"tolerations": [kwok_toleration()], "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE}}
    body: dict[str, Any] = {
        "apiVersion": isvc_api.API_VERSION_STRING,
        "kind": contract.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {
                "uri": f"hf://{MODEL_NAME}",
                "dtype": "float32",
                "hubEndpoint": model.endpoint,
                "hubTokenSecretRef": {"name": model.token_secret},
            },
            "mode": "Disaggregated",
            "prefill": {"replicas": {"min": prefill_min, "max": 4}, "resources": {"gpus": 1}, **kwok},
            "decode": {"replicas": {"min": decode_min, "max": 4}, "resources": {"gpus": decode_gpus}, **kwok},
            **spec,
        },
    }
    return body


def _apply(cluster: LocalCluster, obj: dict[str, Any], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "--server-side", "-f", "-", input_text=json.dumps(obj), check=check)


def _get(cluster: LocalCluster, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    scope = ["-n", ns] if ns else []
    result = cluster.kubectl("get", kind, name, *scope, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _isvc(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    obj = _get(cluster, ns, "inferenceservices.splitserve.dev", name)
    assert obj is not None
    return obj


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def _children(cluster: LocalCluster, ns: str, name: str) -> list[dict[str, Any]]:
    result = cluster.kubectl(
        "get",
        ",".join(CHILD_KINDS),
        "-n",
        ns,
        "-l",
        f"{contract.LABEL_INSTANCE}={name}",
        "-o",
        "json",
        "--show-managed-fields",
    )
    return list(json.loads(result.stdout)["items"])


def _events(cluster: LocalCluster, ns: str, name: str) -> list[dict[str, Any]]:
    result = cluster.kubectl(
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        f"involvedObject.name={name},involvedObject.kind={contract.KIND}",
        "-o",
        "json",
    )
    return list(json.loads(result.stdout)["items"])


def _lease_name(release: str) -> str:
    return f"{release}-splitserve"


def _lease_holder(cluster: LocalCluster, ns: str, *, release: str = RELEASE) -> str:
    lease = _get(cluster, ns, "leases.coordination.k8s.io", _lease_name(release))
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def _operator_pods(cluster: LocalCluster, ns: str, *, release: str = RELEASE) -> list[dict[str, Any]]:
    labels = f"app.kubernetes.io/component=operator,app.kubernetes.io/instance={release}"
    result = cluster.kubectl("get", "pods", "-n", ns, "-l", labels, "-o", "json")
    return [p for p in json.loads(result.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]


def _wait_leader(cluster: LocalCluster, ns: str, *, release: str = RELEASE) -> str:
    """The name of the live operator pod that holds the Lease (a Lease still naming a killed
    or replaced pod does not count)."""

    def leader() -> str:
        held = _lease_holder(cluster, ns, release=release)
        running = [
            p["metadata"]["name"]
            for p in _operator_pods(cluster, ns, release=release)
            if (p.get("status") or {}).get("phase") == "Running"
        ]
        return next((p for p in running if held.startswith(f"{p}_")), "")

    return cluster.wait_for(leader, timeout_seconds=LEASE_DURATION_SECONDS + 60, what=f"{release} leader")


def _hold_still(seconds: float, why: str) -> None:
    """Deliberately let time pass: the behaviour under test is that nothing happens during it
    (there is no event to wait for when the expected event is "none")."""
    assert why
    time.sleep(seconds)


def _until(
    cluster: LocalCluster, predicate: Callable[[], dict[str, Any] | None], *, timeout_seconds: float, what: str
) -> dict[str, Any]:
    result = cluster.wait_for(predicate, timeout_seconds=timeout_seconds, what=what)
    assert result is not None
    return result


def _kill_pod(cluster: LocalCluster, ns: str, pod: str) -> None:
    """Delete with no grace period: the process dies without releasing its Lease."""
    cluster.kubectl("delete", "pod", pod, "-n", ns, "--grace-period=0", "--force", "--wait=false")


def _parse_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _config_hash(dep: dict[str, Any]) -> str:
    return str(dep["spec"]["template"]["metadata"]["annotations"][contract.ANNOTATION_CONFIG_HASH])


def _rolled_out(cluster: LocalCluster, ns: str, deployment: str, replicas: int) -> bool:
    d = _get(cluster, ns, "deployment", deployment)
    if d is None:
        return False
    st = d.get("status") or {}
    return (
        d["spec"].get("replicas") == replicas
        and st.get("observedGeneration", 0) >= d["metadata"]["generation"]
        and st.get("replicas") == st.get("updatedReplicas") == st.get("readyReplicas") == replicas
    )


def _wait_pools(cluster: LocalCluster, ns: str, name: str, *, prefill: int, decode: int) -> dict[str, Any]:
    """Both pool Deployments rolled out at the given sizes (their own status: a surge pod
    during a rollout does not count), then the InferenceService observed at its generation."""

    def ok() -> dict[str, Any] | None:
        if not (
            _rolled_out(cluster, ns, f"{name}-prefill", prefill) and _rolled_out(cluster, ns, f"{name}-decode", decode)
        ):
            return None
        obj = _isvc(cluster, ns, name)
        st = obj.get("status") or {}
        return obj if st.get("observedGeneration") == obj["metadata"]["generation"] else None

    try:
        return _until(
            cluster, ok, timeout_seconds=CONVERGE_SECONDS, what=f"{name}: prefill {prefill} / decode {decode} ready"
        )
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{_diagnosis(cluster, ns, name)}") from None


def _diagnosis(cluster: LocalCluster, ns: str, name: str) -> str:
    """What a failed convergence wait saw: the InferenceService's status, its Deployments'
    status, the Lease holder and the operator pods' log tails (a rare failure under CI load
    is only debuggable from this)."""
    lines: list[str] = []
    try:
        obj = _isvc(cluster, ns, name)
        lines.append(f"generation={obj['metadata'].get('generation')} status={json.dumps(obj.get('status'))}")
        for role in ("prefill", "decode", "router"):
            d = _get(cluster, ns, "deployment", f"{name}-{role}")
            lines.append(
                f"deployment {role}: "
                + (
                    json.dumps(
                        {
                            "spec.replicas": d["spec"].get("replicas"),
                            "generation": d["metadata"].get("generation"),
                            "status": d.get("status"),
                        }
                    )
                    if d
                    else "absent"
                )
            )
        lines.append(f"lease holder: {_lease_holder(cluster, ns)!r}")
        for pod in _operator_pods(cluster, ns):
            pod_name = pod["metadata"]["name"]
            lines.append(f"operator pod {pod_name} phase={(pod.get('status') or {}).get('phase')}")
            log = cluster.pod_log(namespace=ns, pod=pod_name)
            lines.extend(f"  | {line}" for line in log.splitlines()[-40:])
    except Exception as error:  # noqa: BLE001 - a diagnosis must never hide the real failure
        lines.append(f"(diagnosis incomplete: {error!r})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tests
def test_children_created_with_expected_fields(cluster: LocalCluster, isvc: Isvc) -> None:
    ns, name = isvc.ns, isvc.name
    obj = _isvc(cluster, ns, name)
    uid = obj["metadata"]["uid"]
    # No finalizer (kopf timers would add one): `kubectl delete` never waits for the operator.
    assert not obj["metadata"].get("finalizers"), obj["metadata"]["finalizers"]
    children = _children(cluster, ns, name)
    names = sorted((c["kind"], c["metadata"]["name"]) for c in children)
    expected = sorted(
        [("ConfigMap", isvc.child("config")), ("NetworkPolicy", isvc.child("netpol"))]
        + [
            (kind, isvc.child(role))
            for role in ("prefill", "decode", "router")
            for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy")
        ]
    )
    assert names == expected
    for child in children:
        refs = child["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": isvc_api.API_VERSION_STRING,
                "kind": contract.KIND,
                "name": name,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    deployments = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
    assert deployments[isvc.child("prefill")]["spec"]["replicas"] == 2
    assert deployments[isvc.child("decode")]["spec"]["replicas"] == 1
    container = deployments[isvc.child("decode")]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["splitserve", "serve"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # The replica count belongs to the autoscaler's field manager from the first apply on.
    managers = {e["manager"]: e for e in deployments[isvc.child("prefill")]["metadata"]["managedFields"]}
    assert "f:replicas" in managers[contract.FIELD_MANAGER_AUTOSCALER]["fieldsV1"]["f:spec"]
    assert "f:replicas" not in managers[contract.FIELD_MANAGER_RECONCILER]["fieldsV1"]["f:spec"]
    # Pool pods landed on kwok GPU nodes.
    pods = json.loads(
        cluster.kubectl(
            "get",
            "pods",
            "-n",
            ns,
            "-l",
            f"{contract.LABEL_INSTANCE}={name},{contract.LABEL_ROLE} in (prefill,decode)",
            "-o",
            "json",
        ).stdout
    )["items"]
    assert len(pods) == 3
    for pod in pods:
        node = json.loads(cluster.kubectl("get", "node", pod["spec"]["nodeName"], "-o", "json").stdout)
        assert node["metadata"]["labels"].get(KWOK_NODE_LABEL) == KWOK_NODE_LABEL_VALUE
    st = obj["status"]
    assert st["endpoint"] == f"http://{isvc.child('router')}.{ns}.svc:8000"
    assert st["prefill"]["desiredReplicas"] == 2 and st["decode"]["desiredReplicas"] == 1
    assert st["compatHash"] == deployments[isvc.child("prefill")]["metadata"]["labels"][contract.LABEL_COMPAT_HASH]
    cluster.wait_for(
        lambda: "ChildrenCreated" in {e["reason"] for e in _events(cluster, ns, name)},
        timeout_seconds=20,
        what="ChildrenCreated Event",
    )


def test_ready_condition_tracks_router(cluster: LocalCluster, isvc: Isvc) -> None:
    """kwok pool pods never answer HTTP, so the router (a real process) is not ready: Ready must
    say so, and name the router, rather than claim success."""
    obj = _isvc(cluster, isvc.ns, isvc.name)
    ready = _condition(obj, "Ready")
    assert ready is not None and ready["status"] == "False"
    assert ready["reason"] in ("RolloutInProgress", "ChildrenCreated") and "router" in ready["message"]
    assert ready["observedGeneration"] == obj["metadata"]["generation"]
    reconciling = _condition(obj, "Reconciling")
    assert reconciling is not None and reconciling["status"] == "True"
    stalled = _condition(obj, "Stalled")
    assert stalled is not None and stalled["status"] == "False"


def test_reconciler_and_autoscaler_conditions_coexist(cluster: LocalCluster, isvc: Isvc, tiny_model: ModelHub) -> None:
    """Two writers of status.conditions (reconciler: Ready/Reconciling/Stalled; autoscaler:
    MetricsHealthy/ScalingActive) merge by type: neither erases the other."""
    ns, name = isvc.ns, isvc.name

    def with_metrics_condition() -> dict[str, Any] | None:
        current = _isvc(cluster, ns, name)
        return current if _condition(current, "MetricsHealthy") else None

    # The autoscaler writes MetricsHealthy on its first round that finds a Ready pool pod: rounds
    # run every spec.autoscaling.interval (15 s), so a healthy operator needs at most two of
    # them after the pools are ready; the bound is the module's, for a loaded 2-core CI machine.
    started = time.monotonic()
    try:
        obj = _until(
            cluster,
            with_metrics_condition,
            timeout_seconds=CONVERGE_SECONDS,
            what="autoscaler's MetricsHealthy condition",
        )
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{_diagnosis(cluster, ns, name)}") from None
    print(f"MetricsHealthy written {time.monotonic() - started:.1f}s after the pools were ready")
    # With no Prometheus configured the autoscaler must say so, not pretend.
    metrics = _condition(obj, "MetricsHealthy")
    assert metrics is not None and metrics["status"] == "False"
    # A spec edit makes the reconciler write its conditions again (at the new generation):
    # once it has, the autoscaler's condition must still be there.
    _apply(cluster, _manifest(name, ns, model=tiny_model, engine={"maxNumSeqs": 32}))
    generation = _isvc(cluster, ns, name)["metadata"]["generation"]
    assert generation > obj["metadata"]["generation"]

    def reconciled() -> dict[str, Any] | None:
        current = _isvc(cluster, ns, name)
        ready = _condition(current, "Ready") or {}
        return current if ready.get("observedGeneration") == generation else None

    after = _until(cluster, reconciled, timeout_seconds=CONVERGE_SECONDS, what="Ready at the new generation")
    types = {c["type"] for c in after["status"]["conditions"]}
    assert {"Ready", "Reconciling", "Stalled", "MetricsHealthy"} <= types, types


def test_server_side_apply_twice_shows_no_drift(cluster: LocalCluster, isvc: Isvc) -> None:
    before = _isvc(cluster, isvc.ns, isvc.name)["metadata"]["generation"]
    _apply(cluster, isvc.manifest)
    _apply(cluster, isvc.manifest)
    diff = cluster.kubectl("diff", "--server-side", "-f", "-", input_text=json.dumps(isvc.manifest), check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert _isvc(cluster, isvc.ns, isvc.name)["metadata"]["generation"] == before


def test_spec_edit_rolls_pods(cluster: LocalCluster, isvc: Isvc, tiny_model: ModelHub) -> None:
    ns, prefill = isvc.ns, isvc.child("prefill")
    before = _get(cluster, ns, "deployment", prefill)
    assert before is not None
    _apply(cluster, _manifest(isvc.name, ns, model=tiny_model, engine={"maxNumSeqs": 32}))

    def rolled() -> dict[str, Any] | None:
        dep = _get(cluster, ns, "deployment", prefill)
        return dep if dep and _config_hash(dep) != _config_hash(before) else None

    after = _until(cluster, rolled, timeout_seconds=CONVERGE_SECONDS, what="new pod template")
    assert "32" in after["spec"]["template"]["spec"]["containers"][0]["args"]
    assert after["spec"]["replicas"] == before["spec"]["replicas"]
    _wait_pools(cluster, ns, isvc.name, prefill=2, decode=1)


def test_deleted_child_is_recreated(cluster: LocalCluster, isvc: Isvc) -> None:
    ns, decode = isvc.ns, isvc.child("decode")
    old = _get(cluster, ns, "service", decode)
    assert old is not None
    cluster.kubectl("delete", "service", decode, "-n", ns)

    def recreated() -> dict[str, Any] | None:
        svc = _get(cluster, ns, "service", decode)
        return svc if svc and svc["metadata"]["uid"] != old["metadata"]["uid"] else None

    new = _until(cluster, recreated, timeout_seconds=30, what=f"Service {decode} recreated")
    assert new["spec"]["ports"] == old["spec"]["ports"]


def test_drift_is_reverted_but_foreign_replicas_are_kept(cluster: LocalCluster, isvc: Isvc) -> None:
    ns, prefill = isvc.ns, isvc.child("prefill")
    dep = _get(cluster, ns, "deployment", prefill)
    assert dep is not None
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    cluster.kubectl("scale", f"deployment/{prefill}", "-n", ns, "--replicas=3")
    cluster.kubectl("set", "image", f"deployment/{prefill}", "-n", ns, "runtime=drifted:666")

    def reverted() -> dict[str, Any] | None:
        d = _get(cluster, ns, "deployment", prefill)
        return d if d and d["spec"]["template"]["spec"]["containers"][0]["image"] == image else None

    cluster.wait_for(reverted, timeout_seconds=30, what="image drift reverted")
    # More reconciles, triggered by the Deployment's status events, must not touch replicas
    # either: wait until the operator has reported the third pod ready (a reconcile that saw
    # the Deployment at 3 replicas and wrote status), then look.
    _wait_pools(cluster, ns, isvc.name, prefill=3, decode=1)
    final = _get(cluster, ns, "deployment", prefill)
    assert final is not None and final["spec"]["replicas"] == 3
    assert final["spec"]["template"]["spec"]["containers"][0]["image"] == image


def test_name_conflict_leaves_foreign_object_untouched(cluster: LocalCluster, ns: str, tiny_model: ModelHub) -> None:
    name = f"beta-{uuid.uuid4().hex[:5]}"
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "namespace": ns},
        "data": {"owner": "someone else"},
    }
    cluster.kubectl("create", "-f", "-", input_text=json.dumps(foreign))
    before = _get(cluster, ns, "configmap", f"{name}-config")
    assert before is not None
    _apply(cluster, _manifest(name, ns, model=tiny_model, prefill_min=1))
    try:

        def stalled() -> dict[str, Any] | None:
            cond = _condition(_isvc(cluster, ns, name), "Stalled")
            return cond if cond and cond["reason"] == "NameConflict" and cond["status"] == "True" else None

        cond = _until(cluster, stalled, timeout_seconds=CONVERGE_SECONDS, what="NameConflict condition")
        assert f"ConfigMap {name}-config" in cond["message"]
        ready = _condition(_isvc(cluster, ns, name), "Ready")
        assert ready is not None and ready["status"] == "False" and ready["reason"] == "NameConflict"
        after = _get(cluster, ns, "configmap", f"{name}-config")
        assert after is not None
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        assert "ownerReferences" not in after["metadata"] and after["data"] == {"owner": "someone else"}
        cluster.wait_for(
            lambda: any(e["reason"] == "NameConflict" and e["type"] == "Warning" for e in _events(cluster, ns, name)),
            timeout_seconds=20,
            what="NameConflict Event",
        )
    finally:
        _delete_isvc(cluster, ns, name)


def _our_writes(cluster: LocalCluster, ns: str, name: str) -> dict[str, str]:
    """Per object, what only the operator's writes change: the InferenceService's
    resourceVersion (nobody else writes it here), and for children their generation and our
    field managers' entries (controllers keep bumping children's resourceVersion with status)."""
    out: dict[str, str] = {}
    for child in _children(cluster, ns, name):
        ours = [
            e
            for e in child["metadata"].get("managedFields") or []
            if e["manager"] in (contract.FIELD_MANAGER_RECONCILER, contract.FIELD_MANAGER_AUTOSCALER)
        ]
        out[f"{child['kind']}/{child['metadata']['name']}"] = json.dumps(
            [child["metadata"].get("generation"), ours], sort_keys=True
        )
    out["isvc"] = _isvc(cluster, ns, name)["metadata"]["resourceVersion"]
    return out


def test_paused_object_gets_zero_writes(cluster: LocalCluster, isvc: Isvc, tiny_model: ModelHub) -> None:
    ns, name, prefill, router = isvc.ns, isvc.name, isvc.child("prefill"), isvc.child("router")
    annotated = cluster.kubectl(
        "annotate",
        f"inferenceservices.splitserve.dev/{name}",
        "-n",
        ns,
        f"{contract.ANNOTATION_PAUSED}=true",
        "-o",
        "jsonpath={.metadata.resourceVersion}",
    )
    # A write the operator started before it saw the annotation may still land (CI saw one,
    # under load, right after the fixture's rollout); after that grace nothing writes: no kopf
    # bookkeeping either (with a timer, kopf removed its finalizer here).
    assert annotated.stdout.strip()
    _hold_still(IN_FLIGHT_GRACE_SECONDS, "a write already in flight may land")
    settled = _isvc(cluster, ns, name)["metadata"]["resourceVersion"]
    _hold_still(QUIET_SECONDS, "a paused object must see no write at all")
    paused_obj = _isvc(cluster, ns, name)
    assert paused_obj["metadata"]["resourceVersion"] == settled
    assert not paused_obj["metadata"].get("finalizers")
    hash_before = _config_hash(_get(cluster, ns, "deployment", prefill) or {})
    _apply(cluster, _manifest(name, ns, model=tiny_model, engine={"maxNumSeqs": 48}))
    paused_versions = _our_writes(cluster, ns, name)
    cluster.kubectl("delete", "service", router, "-n", ns)  # not even this is repaired
    _hold_still(2 * QUIET_SECONDS, "neither the spec edit nor the deleted child may be acted on while paused")
    now = _our_writes(cluster, ns, name)
    paused_versions.pop(f"Service/{router}")
    assert now == paused_versions, "a paused InferenceService or its children were written to"
    assert _config_hash(_get(cluster, ns, "deployment", prefill) or {}) == hash_before
    cluster.kubectl("annotate", f"inferenceservices.splitserve.dev/{name}", "-n", ns, f"{contract.ANNOTATION_PAUSED}-")
    cluster.wait_for(
        lambda: _get(cluster, ns, "service", router), timeout_seconds=30, what="router Service back after unpause"
    )
    cluster.wait_for(
        lambda: _config_hash(_get(cluster, ns, "deployment", prefill) or {}) != hash_before,
        timeout_seconds=30,
        what="rollout after unpause",
    )


def test_missing_gpu_capacity_is_reported(cluster: LocalCluster, ns: str, tiny_model: ModelHub) -> None:
    # Two kwok nodes with 8 GPUs each: three 8-GPU decode pods cannot all be placed.
    name = f"gamma-{uuid.uuid4().hex[:5]}"
    _apply(cluster, _manifest(name, ns, model=tiny_model, prefill_min=1, decode_min=3, decode_gpus=8))
    try:

        def stalled() -> dict[str, Any] | None:
            cond = _condition(_isvc(cluster, ns, name), "Stalled")
            return cond if cond and cond["reason"] == "InsufficientGPUCapacity" and cond["status"] == "True" else None

        cond = _until(cluster, stalled, timeout_seconds=CONVERGE_SECONDS, what="InsufficientGPUCapacity condition")
        assert "nvidia.com/gpu" in cond["message"]
        cluster.wait_for(
            lambda: any(
                e["reason"] == "InsufficientGPUCapacity" and e["type"] == "Warning" for e in _events(cluster, ns, name)
            ),
            timeout_seconds=20,
            what="capacity Event",
        )
        assert _get(cluster, ns, "deployment", f"{name}-decode") is not None  # applied anyway
    finally:
        _delete_isvc(cluster, ns, name)


INVALID_CASES: list[tuple[str, dict[str, Any], str | tuple[str, ...]]] = [
    ("min>max", {"prefill": {"replicas": {"min": 3, "max": 2}}}, rules.REPLICAS_RULE_MESSAGE),
    ("no decode", {"decode": None}, rules.DISAGGREGATED_RULE_MESSAGE),
    (
        "aggregated with prefill",
        {"mode": "Aggregated", "aggregated": {"resources": {"gpus": 1}}},
        rules.AGGREGATED_RULE_MESSAGE,
    ),
    # Parallelism: a pod's GPUs hold tensor x pipeline ranks; draft speculation is not served with it yet.
    (
        "tensor parallel 2 on 1 GPU",
        {"decode": {"resources": {"gpus": 1}, "parallelism": {"tensor": 2}}},
        rules.PARALLELISM_RULE_MESSAGE,
    ),
    (
        "pipeline parallel 2 with a draft model",
        {
            "decode": {"resources": {"gpus": 2}, "parallelism": {"pipeline": 2}},
            "scheduling": {"speculative": {"method": "draft", "draftModel": "hf://a/d"}},
        },
        rules.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE,
    ),
    (
        "draft model without draft",
        {"scheduling": {"speculative": {"method": "ngram", "draftModel": "hf://a/d"}}},
        rules.DRAFT_MODEL_RULE_MESSAGE,
    ),
    ("gpu budget", {"autoscaling": {"gpuBudget": 1}}, rules.GPU_BUDGET_RULE_MESSAGE),
    ("bad uri", {"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
    ("bad mode", {"mode": "Hybrid"}, 'Unsupported value: "Hybrid"'),
    # A value the API does not know at all is a plain enum error.
    ("bad quantization", {"model": {"uri": "hf://a/b", "quantization": "fp4"}}, 'Unsupported value: "fp4"'),
    ("memory fraction", {"kvCache": {"memoryFraction": 1.5}}, "spec.kvCache.memoryFraction"),
    ("bad policy", {"router": {"policy": "Random"}}, 'Unsupported value: "Random"'),
    ("unknown field", {"prefil": {"replicas": {"min": 1}}}, "prefil"),
    ("negative gpus", {"prefill": {"resources": {"gpus": -1}}}, "spec.prefill.resources.gpus"),
    (
        "picker settings without a picker",
        {"router": {"inferencePool": {"failureMode": "FailOpen"}}},
        rules.INFERENCE_POOL_SETTINGS_RULE_MESSAGE,
    ),
]


def test_invalid_manifests_are_rejected_with_messages(cluster: LocalCluster, ns: str, tiny_model: ModelHub) -> None:
    failures = []
    for label, patch, message in INVALID_CASES:
        body = _manifest(f"bad-{abs(hash(label)) % 10_000}", ns, model=tiny_model)
        for key, value in patch.items():
            if value is None:
                body["spec"].pop(key)
            elif isinstance(value, dict) and isinstance(body["spec"].get(key), dict):
                body["spec"][key] = {**body["spec"][key], **value}
            else:
                body["spec"][key] = value
        result = _apply(cluster, body, check=False)
        accepted = (message,) if isinstance(message, str) else message
        if result.returncode == 0 or not any(m in result.stderr for m in accepted):
            failures.append(f"{label}: rc={result.returncode} stderr={result.stderr.strip()[:300]}")
    long_name = _manifest("x" * (naming.MAX_NAME_LENGTH + 1), ns, model=tiny_model)
    result = _apply(cluster, long_name, check=False)
    if result.returncode == 0 or rules.NAME_LENGTH_RULE_MESSAGE not in result.stderr:
        failures.append(f"long name: rc={result.returncode} stderr={result.stderr.strip()[:300]}")
    assert not failures, "\n".join(failures)
    assert len(INVALID_CASES) + 1 >= 10


def test_router_mode_cannot_change_after_creation(cluster: LocalCluster, ns: str, tiny_model: ModelHub) -> None:
    """A transition rule (oldSelf): the operator never deletes children, so switching between
    the builtin router and an InferencePool would leave the other mode's objects behind."""
    name = f"mode-{uuid.uuid4().hex[:5]}"
    body = _manifest(name, ns, model=tiny_model)
    body["metadata"]["annotations"] = {contract.ANNOTATION_PAUSED: "true"}  # no children needed
    _apply(cluster, body)
    try:
        body["spec"]["router"] = {"mode": "InferencePool"}
        result = _apply(cluster, body, check=False)
        assert result.returncode != 0 and rules.ROUTER_MODE_IMMUTABLE_RULE_MESSAGE in result.stderr, result.stderr
    finally:
        _delete_isvc(cluster, ns, name)


def test_rendered_children_and_chart_validate_against_the_api(cluster: LocalCluster, ns: str) -> None:
    # examples/gateway-inferencepool.yaml renders an InferencePool: its CRD (from the Gateway
    # API Inference Extension module) must be there for the dry run
    for manifest in gie.ensure_gie_crds():
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(manifest))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/inferencepools.inference.networking.k8s.io"
    )
    for example in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            if not doc or doc.get("kind") != contract.KIND:
                continue
            doc["metadata"]["namespace"] = ns
            result = cluster.kubectl(
                "apply", "--dry-run=server", "--server-side", "-f", "-", input_text=json.dumps(doc), check=False
            )
            assert result.returncode == 0, f"{example.name}: {result.stderr}"
            isvc = InferenceService.parse({**doc, "metadata": {**doc["metadata"], "uid": "x", "generation": 1}})
            children = render_children(isvc=isvc, runtime_image="img:1", router_service_account="default")
            listing = {"apiVersion": "v1", "kind": "List", "items": children}
            result = cluster.kubectl(
                "apply", "--dry-run=server", "--server-side", "-f", "-", input_text=json.dumps(listing), check=False
            )
            assert result.returncode == 0, f"children of {example.name}: {result.stderr}"
    template = cluster.helm("template", "dry", str(CHART), "-n", ns, "--set", "rbac.scope=namespace")
    result = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input_text=template.stdout, check=False)
    assert result.returncode == 0, result.stderr


def test_operator_killed_mid_reconcile_converges(cluster: LocalCluster, ns: str, tiny_model: ModelHub) -> None:
    leader = _wait_leader(cluster, ns)
    assert len(_operator_pods(cluster, ns)) == 1
    name = f"delta-{uuid.uuid4().hex[:5]}"
    _apply(cluster, _manifest(name, ns, model=tiny_model))
    try:
        # Mid reconcile: the operator has started writing children (not necessarily all).
        cluster.wait_for(
            lambda: _children(cluster, ns, name),
            timeout_seconds=30,
            interval_seconds=0.05,
            what=f"first child of {name}",
        )
        _kill_pod(cluster, ns, leader)
        _wait_pools(cluster, ns, name, prefill=2, decode=1)
        kinds = [
            (c["kind"], c["metadata"]["labels"].get(contract.LABEL_ROLE))
            for c in _children(cluster, ns, name)
            if c["kind"] == "Deployment"
        ]
        assert sorted(kinds) == [("Deployment", "decode"), ("Deployment", "prefill"), ("Deployment", "router")]
        rs = json.loads(
            cluster.kubectl(
                "get", "replicasets", "-n", ns, "-l", f"{contract.LABEL_INSTANCE}={name}", "-o", "json"
            ).stdout
        )["items"]
        assert len(rs) == 3, "a pod template changed across the restart (operator upgrade/restart must not roll pods)"
        assert _wait_leader(cluster, ns) != leader
    finally:
        _delete_isvc(cluster, ns, name)


def test_delete_garbage_collects_children(cluster: LocalCluster, isvc: Isvc) -> None:
    ns, name = isvc.ns, isvc.name
    assert _children(cluster, ns, name)
    cluster.kubectl("delete", "inferenceservices.splitserve.dev", name, "-n", ns, "--wait=true", "--timeout=30s")
    cluster.wait_for(lambda: not _children(cluster, ns, name), timeout_seconds=60, what=f"children of {name} collected")


def test_two_replicas_one_writer_and_failover(cluster: LocalCluster, ha_ns: str, tiny_model: ModelHub) -> None:
    ns = ha_ns
    cluster.wait_for(
        lambda: (
            len(
                [
                    p
                    for p in _operator_pods(cluster, ns, release=HA_RELEASE)
                    if p.get("status", {}).get("phase") == "Running"
                ]
            )
            == 2
        ),
        timeout_seconds=60,
        what="two operator pods running",
    )
    pods = [p["metadata"]["name"] for p in _operator_pods(cluster, ns, release=HA_RELEASE)]
    leader = _wait_leader(cluster, ns, release=HA_RELEASE)
    holder = _lease_holder(cluster, ns, release=HA_RELEASE)
    assert holder.startswith(f"{leader}_")
    standby = next(p for p in pods if p != leader)
    _apply(cluster, _manifest("eps", ns, model=tiny_model, prefill_min=1))
    _wait_pools(cluster, ns, "eps", prefill=1, decode=1)
    # Every Event about eps was posted by the Lease holder (kopf reports our identity).
    reporters = {e.get("reportingInstance") for e in _events(cluster, ns, "eps")}
    assert reporters == {holder}, reporters
    # Kill the leader hard (no Lease release): the standby must take over after expiry.
    killed_at = time.monotonic()
    _kill_pod(cluster, ns, leader)
    last_renew: list[str] = []

    def changed_holder() -> dict[str, Any] | None:
        spec = (_get(cluster, ns, "leases.coordination.k8s.io", _lease_name(HA_RELEASE)) or {}).get("spec") or {}
        if spec.get("holderIdentity") == holder:
            last_renew[:] = [str(spec["renewTime"])]
            return None
        return spec if spec.get("holderIdentity") else None

    new_spec = _until(cluster, changed_holder, timeout_seconds=LEASE_DURATION_SECONDS + 20, what="new Lease holder")
    new_holder = str(new_spec["holderIdentity"])
    takeover_seconds = time.monotonic() - killed_at
    # The Lease is free lease-duration after the dead leader's last renewal; the standby sees
    # that within one retry period. (The kill itself lands when the node agent notices the
    # force-deleted pod, so time-from-kill includes that delay too.)
    gap_seconds = (_parse_time(str(new_spec["acquireTime"])) - _parse_time(last_renew[0])).total_seconds()
    print(
        f"\nleader failover: {gap_seconds:.1f}s from the last renewal, {takeover_seconds:.1f}s from the kill "
        f"(lease duration {LEASE_DURATION_SECONDS:.0f}s)"
    )
    assert gap_seconds <= LEASE_DURATION_SECONDS + 2 * RETRY_PERIOD_SECONDS
    assert new_spec["leaseTransitions"] >= 1
    # The standby usually wins; the ReplicaSet's replacement for the killed pod may win the
    # race instead. Either way it is a live replica, never the dead leader.
    assert not new_holder.startswith(f"{leader}_"), (new_holder, leader)
    live = {p["metadata"]["name"] for p in _operator_pods(cluster, ns, release=HA_RELEASE)}
    assert any(new_holder.startswith(f"{p}_") for p in live | {standby}), (new_holder, live)
    # The new leader reconciles: a deleted child comes back.
    cluster.kubectl("delete", "configmap", "eps-config", "-n", ns)
    cluster.wait_for(
        lambda: _get(cluster, ns, "configmap", "eps-config"),
        timeout_seconds=30,
        what="eps-config recreated by the new leader",
    )
