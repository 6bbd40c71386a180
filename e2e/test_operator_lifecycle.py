"""The operator end to end: installed by its Helm chart, running on the local node with the
chart's ServiceAccount (so the chart's RBAC is what it gets), against a real API server,
controller manager, scheduler and kwok GPU nodes.

One operator release serves the whole module (in its own namespace, namespace-scoped RBAC);
each test uses its own InferenceService names. The leader-election tests run last: they scale
the release to two replicas and kill the leader.
"""

from __future__ import annotations

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
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.kwok import KWOK_NODE_LABEL, KWOK_NODE_LABEL_VALUE, kwok_toleration
from splitserve_operator import api as isvc_api
from splitserve_operator import naming
from splitserve_operator.api import InferenceService
from splitserve_operator.render import render_children

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "splitserve"
RELEASE = "ops"
LEASE_NAME = f"{RELEASE}-splitserve"
OPERATOR_LABELS = "app.kubernetes.io/component=operator,app.kubernetes.io/instance=" + RELEASE
LEASE_DURATION_SECONDS = 15.0
RETRY_PERIOD_SECONDS = 2.0
CHILD_KINDS = ("deployments", "services", "configmaps", "poddisruptionbudgets", "networkpolicies")
CONVERGE_SECONDS = 90.0


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint: the router really runs on the local node and loads its tokenizer."""
    out = tmp_path_factory.mktemp("tiny-model") / "tiny"
    subprocess.run(["splitserve", "make-tiny-model", str(out)], check=True, capture_output=True, timeout=180)
    return out


@pytest.fixture(scope="module")
def ns(cluster: LocalCluster) -> Iterator[str]:
    """The module's namespace with the operator installed by Helm (namespace scope)."""
    name = f"e2e-operator-{uuid.uuid4().hex[:5]}"
    core = cluster.core()
    core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
    cluster.wait_for(lambda: core.read_namespaced_service_account("default", name), timeout_seconds=30,
                     what="default ServiceAccount")
    # CRDs: applied like a platform team would (Helm installs crds/ only once, never upgrades).
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))

    def established() -> bool:
        crd = _get(cluster, "", "crd", "inferenceservices.splitserve.dev") or {}
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])
    cluster.wait_for(established, timeout_seconds=60, what="CRD Established")
    cluster.helm("install", RELEASE, str(CHART), "-n", name, "--skip-crds",
                 "--set", "rbac.scope=namespace", "--set", "replicaCount=1",
                 "--set-string", "nodeSelector.splitserve\\.dev/local-node=true")
    cluster.wait_for(lambda: _lease_holder(cluster, name), timeout_seconds=60, what="operator holds its Lease")
    yield name
    cluster.helm("uninstall", RELEASE, "-n", name, check=False)
    core.delete_namespace(name)


def _manifest(name: str, namespace: str, *, model: Path, prefill_min: int = 2, decode_min: int = 1,
              decode_gpus: int = 2, **spec: Any) -> dict[str, Any]:
    kwok = {"tolerations": [kwok_toleration()], "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE}}
    body: dict[str, Any] = {
        "apiVersion": isvc_api.API_VERSION_STRING, "kind": contract.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": f"file://{model}", "dtype": "float32"},
            "mode": "Disaggregated",
            "prefill": {"replicas": {"min": prefill_min, "max": 4}, "resources": {"gpus": 1}, **kwok},
            "decode": {"replicas": {"min": decode_min, "max": 4}, "resources": {"gpus": decode_gpus},
                       "parallelism": {"tensor": 2 if decode_gpus % 2 == 0 else 1}, **kwok},
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
    result = cluster.kubectl("get", ",".join(CHILD_KINDS), "-n", ns, "-l", f"{contract.LABEL_INSTANCE}={name}",
                             "-o", "json", "--show-managed-fields")
    return list(json.loads(result.stdout)["items"])


def _events(cluster: LocalCluster, ns: str, name: str) -> list[dict[str, Any]]:
    result = cluster.kubectl("get", "events", "-n", ns, "--field-selector",
                             f"involvedObject.name={name},involvedObject.kind={contract.KIND}", "-o", "json")
    return list(json.loads(result.stdout)["items"])


def _lease_holder(cluster: LocalCluster, ns: str) -> str:
    lease = _get(cluster, ns, "leases.coordination.k8s.io", LEASE_NAME)
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def _operator_pods(cluster: LocalCluster, ns: str) -> list[dict[str, Any]]:
    result = cluster.kubectl("get", "pods", "-n", ns, "-l", OPERATOR_LABELS, "-o", "json")
    return [p for p in json.loads(result.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]


def _until(cluster: LocalCluster, predicate: Callable[[], dict[str, Any] | None], *, timeout_seconds: float,
           what: str) -> dict[str, Any]:
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


def _wait_pools(cluster: LocalCluster, ns: str, name: str, *, prefill: int, decode: int) -> dict[str, Any]:
    def ok() -> dict[str, Any] | None:
        obj = _isvc(cluster, ns, name)
        st = obj.get("status") or {}
        good = ((st.get("prefill") or {}).get("readyReplicas") == prefill
                and (st.get("decode") or {}).get("readyReplicas") == decode
                and st.get("observedGeneration") == obj["metadata"]["generation"])
        return obj if good else None
    return _until(cluster, ok, timeout_seconds=CONVERGE_SECONDS, what=f"{name}: prefill {prefill} / decode {decode} ready")


# --------------------------------------------------------------------------- tests
def test_children_created_with_expected_fields(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    _apply(cluster, _manifest("alpha", ns, model=tiny_model))
    obj = _wait_pools(cluster, ns, "alpha", prefill=2, decode=1)
    uid = obj["metadata"]["uid"]
    # No finalizer (kopf timers would add one): `kubectl delete` never waits for the operator.
    assert not obj["metadata"].get("finalizers"), obj["metadata"]["finalizers"]
    children = _children(cluster, ns, "alpha")
    names = sorted((c["kind"], c["metadata"]["name"]) for c in children)
    expected = sorted([("ConfigMap", "alpha-config"), ("NetworkPolicy", "alpha-netpol")] + [
        (kind, f"alpha-{role}") for role in ("prefill", "decode", "router")
        for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy")])
    assert names == expected
    for child in children:
        refs = child["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": isvc_api.API_VERSION_STRING, "kind": contract.KIND, "name": "alpha",
                         "uid": uid, "controller": True, "blockOwnerDeletion": True}]
    deployments = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
    assert deployments["alpha-prefill"]["spec"]["replicas"] == 2
    assert deployments["alpha-decode"]["spec"]["replicas"] == 1
    container = deployments["alpha-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["splitserve", "serve"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # The replica count belongs to the autoscaler's field manager from the first apply on.
    managers = {e["manager"]: e for e in deployments["alpha-prefill"]["metadata"]["managedFields"]}
    assert "f:replicas" in managers[contract.FIELD_MANAGER_AUTOSCALER]["fieldsV1"]["f:spec"]
    assert "f:replicas" not in managers[contract.FIELD_MANAGER_RECONCILER]["fieldsV1"]["f:spec"]
    # Pool pods landed on kwok GPU nodes.
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l",
                                      f"{contract.LABEL_INSTANCE}=alpha,{contract.LABEL_ROLE} in (prefill,decode)",
                                      "-o", "json").stdout)["items"]
    assert len(pods) == 3
    for pod in pods:
        node = json.loads(cluster.kubectl("get", "node", pod["spec"]["nodeName"], "-o", "json").stdout)
        assert node["metadata"]["labels"].get(KWOK_NODE_LABEL) == KWOK_NODE_LABEL_VALUE
    st = obj["status"]
    assert st["endpoint"] == f"http://alpha-router.{ns}.svc:8000"
    assert st["prefill"]["desiredReplicas"] == 2 and st["decode"]["desiredReplicas"] == 1
    assert st["compatHash"] == deployments["alpha-prefill"]["metadata"]["labels"][contract.LABEL_COMPAT_HASH]
    events = {e["reason"] for e in _events(cluster, ns, "alpha")}
    assert "ChildrenCreated" in events


def test_ready_condition_tracks_router(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    """kwok pool pods never answer HTTP, so the router (a real process) is not ready: Ready must
    say so, and name the router, rather than claim success."""
    _wait_pools(cluster, ns, "alpha", prefill=2, decode=1)
    obj = _isvc(cluster, ns, "alpha")
    ready = _condition(obj, "Ready")
    assert ready is not None and ready["status"] == "False"
    assert ready["reason"] in ("RolloutInProgress", "ChildrenCreated") and "router" in ready["message"]
    assert ready["observedGeneration"] == obj["metadata"]["generation"]
    reconciling = _condition(obj, "Reconciling")
    assert reconciling is not None and reconciling["status"] == "True"
    stalled = _condition(obj, "Stalled")
    assert stalled is not None and stalled["status"] == "False"


def test_reconciler_and_autoscaler_conditions_coexist(cluster: LocalCluster, ns: str) -> None:
    """Two writers of status.conditions (reconciler: Ready/Reconciling/Stalled; autoscaler:
    MetricsHealthy/ScalingActive) merge by type: neither erases the other."""
    def with_metrics_condition() -> dict[str, Any] | None:
        current = _isvc(cluster, ns, "alpha")
        return current if _condition(current, "MetricsHealthy") else None
    obj = _until(cluster, with_metrics_condition, timeout_seconds=45, what="autoscaler's MetricsHealthy condition")
    # With no Prometheus configured the autoscaler must say so, not pretend.
    metrics = _condition(obj, "MetricsHealthy")
    assert metrics is not None and metrics["status"] == "False"
    cluster.kubectl("delete", "configmap", "alpha-config", "-n", ns)  # forces a reconcile + status write
    cluster.wait_for(lambda: _get(cluster, ns, "configmap", "alpha-config"), timeout_seconds=30, what="config back")
    time.sleep(2)
    types = {c["type"] for c in _isvc(cluster, ns, "alpha")["status"]["conditions"]}
    assert {"Ready", "Reconciling", "Stalled", "MetricsHealthy"} <= types, types


def test_server_side_apply_twice_shows_no_drift(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    manifest = _manifest("alpha", ns, model=tiny_model)
    _wait_pools(cluster, ns, "alpha", prefill=2, decode=1)
    before = _isvc(cluster, ns, "alpha")["metadata"]["generation"]
    _apply(cluster, manifest)
    _apply(cluster, manifest)
    diff = cluster.kubectl("diff", "--server-side", "-f", "-", input_text=json.dumps(manifest), check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert _isvc(cluster, ns, "alpha")["metadata"]["generation"] == before


def test_spec_edit_rolls_pods(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    before = _get(cluster, ns, "deployment", "alpha-prefill")
    assert before is not None
    _apply(cluster, _manifest("alpha", ns, model=tiny_model, engine={"maxNumSeqs": 32}))

    def rolled() -> dict[str, Any] | None:
        dep = _get(cluster, ns, "deployment", "alpha-prefill")
        return dep if dep and _config_hash(dep) != _config_hash(before) else None
    after = _until(cluster, rolled, timeout_seconds=CONVERGE_SECONDS, what="new pod template")
    assert "32" in after["spec"]["template"]["spec"]["containers"][0]["command"]
    assert after["spec"]["replicas"] == before["spec"]["replicas"]
    _wait_pools(cluster, ns, "alpha", prefill=2, decode=1)


def test_deleted_child_is_recreated(cluster: LocalCluster, ns: str) -> None:
    old = _get(cluster, ns, "service", "alpha-decode")
    assert old is not None
    cluster.kubectl("delete", "service", "alpha-decode", "-n", ns)
    def recreated() -> dict[str, Any] | None:
        svc = _get(cluster, ns, "service", "alpha-decode")
        return svc if svc and svc["metadata"]["uid"] != old["metadata"]["uid"] else None
    new = _until(cluster, recreated, timeout_seconds=30, what="Service alpha-decode recreated")
    assert new["spec"]["ports"] == old["spec"]["ports"]


def test_drift_is_reverted_but_foreign_replicas_are_kept(cluster: LocalCluster, ns: str) -> None:
    dep = _get(cluster, ns, "deployment", "alpha-prefill")
    assert dep is not None
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    cluster.kubectl("scale", "deployment/alpha-prefill", "-n", ns, "--replicas=3")
    cluster.kubectl("set", "image", "deployment/alpha-prefill", "-n", ns, "runtime=drifted:666")

    def reverted() -> dict[str, Any] | None:
        d = _get(cluster, ns, "deployment", "alpha-prefill")
        return d if d and d["spec"]["template"]["spec"]["containers"][0]["image"] == image else None
    cluster.wait_for(reverted, timeout_seconds=30, what="image drift reverted")
    time.sleep(3)  # more reconciles (Deployment status events) must not touch replicas
    final = _get(cluster, ns, "deployment", "alpha-prefill")
    assert final is not None and final["spec"]["replicas"] == 3
    assert final["spec"]["template"]["spec"]["containers"][0]["image"] == image
    cluster.kubectl("scale", "deployment/alpha-prefill", "-n", ns, "--replicas=2")
    _wait_pools(cluster, ns, "alpha", prefill=2, decode=1)


def test_name_conflict_leaves_foreign_object_untouched(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    foreign = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "beta-config", "namespace": ns}, "data": {"owner": "someone else"}}
    cluster.kubectl("create", "-f", "-", input_text=json.dumps(foreign))
    before = _get(cluster, ns, "configmap", "beta-config")
    assert before is not None
    _apply(cluster, _manifest("beta", ns, model=tiny_model, prefill_min=1))

    def stalled() -> dict[str, Any] | None:
        cond = _condition(_isvc(cluster, ns, "beta"), "Stalled")
        return cond if cond and cond["reason"] == "NameConflict" and cond["status"] == "True" else None
    cond = _until(cluster, stalled, timeout_seconds=CONVERGE_SECONDS, what="NameConflict condition")
    assert "ConfigMap beta-config" in cond["message"]
    ready = _condition(_isvc(cluster, ns, "beta"), "Ready")
    assert ready is not None and ready["status"] == "False" and ready["reason"] == "NameConflict"
    after = _get(cluster, ns, "configmap", "beta-config")
    assert after is not None
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"] and after["data"] == {"owner": "someone else"}
    cluster.wait_for(lambda: any(e["reason"] == "NameConflict" and e["type"] == "Warning"
                                 for e in _events(cluster, ns, "beta")), timeout_seconds=20, what="NameConflict Event")
    cluster.kubectl("delete", "inferenceservices.splitserve.dev", "beta", "-n", ns)


def _our_writes(cluster: LocalCluster, ns: str, name: str) -> dict[str, str]:
    """Per object, what only the operator's writes change: the InferenceService's
    resourceVersion (nobody else writes it here), and for children their generation and our
    field managers' entries (controllers keep bumping children's resourceVersion with status)."""
    out: dict[str, str] = {}
    for child in _children(cluster, ns, name):
        ours = [e for e in child["metadata"].get("managedFields") or []
                if e["manager"] in (contract.FIELD_MANAGER_RECONCILER, contract.FIELD_MANAGER_AUTOSCALER)]
        out[f"{child['kind']}/{child['metadata']['name']}"] = json.dumps(
            [child["metadata"].get("generation"), ours], sort_keys=True)
    out["isvc"] = _isvc(cluster, ns, name)["metadata"]["resourceVersion"]
    return out


def test_paused_object_gets_zero_writes(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    _wait_pools(cluster, ns, "alpha", prefill=2, decode=1)
    annotated = cluster.kubectl("annotate", "inferenceservices.splitserve.dev/alpha", "-n", ns,
                                f"{contract.ANNOTATION_PAUSED}=true", "-o", "jsonpath={.metadata.resourceVersion}")
    # From the annotation's own write on, nothing writes: no kopf bookkeeping either (with a
    # timer, kopf removed its finalizer here).
    time.sleep(4)
    paused_obj = _isvc(cluster, ns, "alpha")
    assert paused_obj["metadata"]["resourceVersion"] == annotated.stdout.strip()
    assert not paused_obj["metadata"].get("finalizers")
    hash_before = _config_hash(_get(cluster, ns, "deployment", "alpha-prefill") or {})
    _apply(cluster, _manifest("alpha", ns, model=tiny_model, engine={"maxNumSeqs": 48}))
    paused_versions = _our_writes(cluster, ns, "alpha")
    cluster.kubectl("delete", "service", "alpha-router", "-n", ns)  # not even this is repaired
    time.sleep(8)
    now = _our_writes(cluster, ns, "alpha")
    paused_versions.pop("Service/alpha-router")
    assert now == paused_versions, "a paused InferenceService or its children were written to"
    assert _config_hash(_get(cluster, ns, "deployment", "alpha-prefill") or {}) == hash_before
    cluster.kubectl("annotate", "inferenceservices.splitserve.dev/alpha", "-n", ns, f"{contract.ANNOTATION_PAUSED}-")
    cluster.wait_for(lambda: _get(cluster, ns, "service", "alpha-router"), timeout_seconds=30,
                     what="router Service back after unpause")
    cluster.wait_for(lambda: _config_hash(_get(cluster, ns, "deployment", "alpha-prefill") or {}) != hash_before,
                     timeout_seconds=30, what="rollout after unpause")


def test_missing_gpu_capacity_is_reported(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    # Two kwok nodes with 8 GPUs each: three 8-GPU decode pods cannot all be placed.
    _apply(cluster, _manifest("gamma", ns, model=tiny_model, prefill_min=1, decode_min=3, decode_gpus=8))

    def stalled() -> dict[str, Any] | None:
        cond = _condition(_isvc(cluster, ns, "gamma"), "Stalled")
        return cond if cond and cond["reason"] == "InsufficientGPUCapacity" and cond["status"] == "True" else None
    cond = _until(cluster, stalled, timeout_seconds=CONVERGE_SECONDS, what="InsufficientGPUCapacity condition")
    assert "nvidia.com/gpu" in cond["message"]
    cluster.wait_for(lambda: any(e["reason"] == "InsufficientGPUCapacity" and e["type"] == "Warning"
                                 for e in _events(cluster, ns, "gamma")), timeout_seconds=20, what="capacity Event")
    assert _get(cluster, ns, "deployment", "gamma-decode") is not None  # applied anyway
    cluster.kubectl("delete", "inferenceservices.splitserve.dev", "gamma", "-n", ns)


INVALID_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("min>max", {"prefill": {"replicas": {"min": 3, "max": 2}}}, isvc_api.REPLICAS_RULE_MESSAGE),
    ("no decode", {"decode": None}, isvc_api.DISAGGREGATED_RULE_MESSAGE),
    ("aggregated with prefill", {"mode": "Aggregated", "aggregated": {"resources": {"gpus": 1}}},
     isvc_api.AGGREGATED_RULE_MESSAGE),
    ("gpus not multiple of tp", {"decode": {"resources": {"gpus": 3}, "parallelism": {"tensor": 2}}},
     isvc_api.PARALLELISM_RULE_MESSAGE),
    ("cpu with tp", {"decode": {"resources": {"gpus": 0}, "parallelism": {"tensor": 2}}},
     isvc_api.CPU_PARALLELISM_RULE_MESSAGE),
    ("gpu budget", {"autoscaling": {"gpuBudget": 1}}, isvc_api.GPU_BUDGET_RULE_MESSAGE),
    ("bad uri", {"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
    ("bad mode", {"mode": "Hybrid"}, 'Unsupported value: "Hybrid"'),
    ("bad quantization", {"model": {"uri": "hf://a/b", "quantization": "fp4"}}, 'Unsupported value: "fp4"'),
    ("memory fraction", {"kvCache": {"memoryFraction": 1.5}}, "spec.kvCache.memoryFraction"),
    ("bad policy", {"router": {"policy": "Random"}}, 'Unsupported value: "Random"'),
    ("unknown field", {"prefil": {"replicas": {"min": 1}}}, "prefil"),
    ("negative gpus", {"prefill": {"resources": {"gpus": -1}}}, "spec.prefill.resources.gpus"),
]


def test_invalid_manifests_are_rejected_with_messages(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
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
        if result.returncode == 0 or message not in result.stderr:
            failures.append(f"{label}: rc={result.returncode} stderr={result.stderr.strip()[:300]}")
    long_name = _manifest("x" * (naming.MAX_NAME_LENGTH + 1), ns, model=tiny_model)
    result = _apply(cluster, long_name, check=False)
    if result.returncode == 0 or isvc_api.NAME_LENGTH_RULE_MESSAGE not in result.stderr:
        failures.append(f"long name: rc={result.returncode} stderr={result.stderr.strip()[:300]}")
    assert not failures, "\n".join(failures)
    assert len(INVALID_CASES) + 1 >= 10


def test_rendered_children_and_chart_validate_against_the_api(cluster: LocalCluster, ns: str) -> None:
    for example in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            if not doc or doc.get("kind") != contract.KIND:
                continue
            doc["metadata"]["namespace"] = ns
            result = cluster.kubectl("apply", "--dry-run=server", "--server-side", "-f", "-",
                                     input_text=json.dumps(doc), check=False)
            assert result.returncode == 0, f"{example.name}: {result.stderr}"
            isvc = InferenceService.parse({**doc, "metadata": {**doc["metadata"], "uid": "x", "generation": 1}})
            children = render_children(isvc=isvc, runtime_image="img:1", router_service_account="default")
            listing = {"apiVersion": "v1", "kind": "List", "items": children}
            result = cluster.kubectl("apply", "--dry-run=server", "--server-side", "-f", "-",
                                     input_text=json.dumps(listing), check=False)
            assert result.returncode == 0, f"children of {example.name}: {result.stderr}"
    template = cluster.helm("template", "dry", str(CHART), "-n", ns, "--set", "rbac.scope=namespace")
    result = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input_text=template.stdout, check=False)
    assert result.returncode == 0, result.stderr


def test_operator_killed_mid_reconcile_converges(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    pods = _operator_pods(cluster, ns)
    assert len(pods) == 1
    _apply(cluster, _manifest("delta", ns, model=tiny_model))
    time.sleep(0.3)
    _kill_pod(cluster, ns, pods[0]["metadata"]["name"])
    _wait_pools(cluster, ns, "delta", prefill=2, decode=1)
    kinds = [(c["kind"], c["metadata"]["labels"].get(contract.LABEL_ROLE)) for c in _children(cluster, ns, "delta")
             if c["kind"] == "Deployment"]
    assert sorted(kinds) == [("Deployment", "decode"), ("Deployment", "prefill"), ("Deployment", "router")]
    rs = json.loads(cluster.kubectl("get", "replicasets", "-n", ns, "-l", f"{contract.LABEL_INSTANCE}=delta",
                                    "-o", "json").stdout)["items"]
    assert len(rs) == 3, "a pod template changed across the restart (operator upgrade/restart must not roll pods)"
    cluster.kubectl("delete", "inferenceservices.splitserve.dev", "delta", "-n", ns)


def test_delete_garbage_collects_children(cluster: LocalCluster, ns: str) -> None:
    assert _children(cluster, ns, "alpha")
    cluster.kubectl("delete", "inferenceservices.splitserve.dev", "alpha", "-n", ns, "--wait=true", "--timeout=30s")
    cluster.wait_for(lambda: not _children(cluster, ns, "alpha"), timeout_seconds=60, what="children of alpha collected")


def test_two_replicas_one_writer_and_failover(cluster: LocalCluster, ns: str, tiny_model: Path) -> None:
    cluster.helm("upgrade", RELEASE, str(CHART), "-n", ns, "--reuse-values", "--set", "replicaCount=2")
    cluster.wait_for(lambda: len([p for p in _operator_pods(cluster, ns)
                                  if p.get("status", {}).get("phase") == "Running"]) == 2,
                     timeout_seconds=60, what="two operator pods running")
    pods = [p["metadata"]["name"] for p in _operator_pods(cluster, ns)]

    def current_holder() -> str:
        # After an upgrade that rolls the pods the Lease may still name a replaced pod until it
        # expires; wait for one of the two running pods to hold it.
        held = _lease_holder(cluster, ns)
        return held if any(held.startswith(f"{p}_") for p in pods) else ""

    holder = cluster.wait_for(current_holder, timeout_seconds=LEASE_DURATION_SECONDS + 30, what="Lease holder")
    leader = next(p for p in pods if holder.startswith(f"{p}_"))
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
        spec = (_get(cluster, ns, "leases.coordination.k8s.io", LEASE_NAME) or {}).get("spec") or {}
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
    print(f"\nleader failover: {gap_seconds:.1f}s from the last renewal, {takeover_seconds:.1f}s from the kill "
          f"(lease duration {LEASE_DURATION_SECONDS:.0f}s)")
    assert gap_seconds <= LEASE_DURATION_SECONDS + 2 * RETRY_PERIOD_SECONDS
    assert new_spec["leaseTransitions"] >= 1
    # The standby usually wins; the ReplicaSet's replacement for the killed pod may win the
    # race instead. Either way it is a live replica, never the dead leader.
    assert not new_holder.startswith(f"{leader}_"), (new_holder, leader)
    live = {p["metadata"]["name"] for p in _operator_pods(cluster, ns)}
    assert any(new_holder.startswith(f"{p}_") for p in live | {standby}), (new_holder, live)
    # The new leader reconciles: a deleted child comes back.
    cluster.kubectl("delete", "configmap", "eps-config", "-n", ns)
    cluster.wait_for(lambda: _get(cluster, ns, "configmap", "eps-config"), timeout_seconds=30,
                     what="eps-config recreated by the new leader")
