"""The Helm chart: lints strictly, renders least-privilege RBAC in both scopes, runs the
operator under the restricted pod security profile with flags the operator accepts, and
rejects unknown values. Needs the `helm` binary (PATH, $SPLITSERVE_HELM, or the one the
e2e build caches under ~/.cache/splitserve/bin/helm-*/)."""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import splitserve_contract as contract
from splitserve_contract.engines import VLLM_IMAGE
from splitserve_operator import operator_flags

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "splitserve"
NAMESPACE = "ops"


def _find_helm() -> str | None:
    explicit = os.environ.get("SPLITSERVE_HELM")
    if explicit:
        return explicit
    found = shutil.which("helm")
    if found:
        return found
    cached = sorted(glob.glob(str(Path.home() / ".cache" / "splitserve" / "bin" / "helm-*" / "helm")))
    return cached[-1] if cached and os.access(cached[-1], os.X_OK) else None


HELM = _find_helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="helm binary not found (run the e2e build first)")


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60, check=False)


@functools.cache
def _render(*sets: str) -> tuple[dict[str, Any], ...]:
    args = ["template", "rel", str(CHART), "--namespace", NAMESPACE]
    for item in sets:
        args += ["--set", item]
    proc = _helm(*args)
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def _kinds(docs: tuple[dict[str, Any], ...]) -> list[str]:
    return [d["kind"] for d in docs]


def _one(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def _rules(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [rule for d in docs if d["kind"] in ("Role", "ClusterRole") for rule in d["rules"]]


NAMESPACE_SCOPE = ("rbac.scope=namespace", "watchNamespace=team")
NAMESPACES_SCOPE = ("rbac.scope=namespaces", "watchNamespaces={team-a,team-b}")
INFERENCE_POOL = ("inferencePool.enabled=true",)


@needs_helm
@pytest.mark.parametrize(
    "sets",
    [
        (),
        NAMESPACE_SCOPE,
        NAMESPACES_SCOPE,
        INFERENCE_POOL + NAMESPACES_SCOPE,
        ("leaderElection.enabled=false", "replicaCount=1"),
    ],
)
def test_lint_strict(sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for item in sets:
        args += ["--set", item]
    proc = _helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_helm
def test_cluster_scope_renders_cluster_role_with_node_and_crd_reads() -> None:
    docs = _render()
    assert {"ClusterRole", "ClusterRoleBinding"} <= set(_kinds(docs))
    assert "--namespace" not in " ".join(_operator_args(docs))
    cluster_rules = _one(docs, "ClusterRole")["rules"]
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]} in cluster_rules
    assert {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    } in cluster_rules
    binding = _one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-splitserve", "namespace": NAMESPACE}]


@needs_helm
def test_namespace_scope_renders_no_cluster_objects() -> None:
    docs = _render(*NAMESPACE_SCOPE)
    assert not [k for k in _kinds(docs) if k.startswith("Cluster")]
    role = _one(docs, "Role", "rel-splitserve")
    assert role["metadata"]["namespace"] == "team"
    assert not [r for r in role["rules"] if {"nodes", "customresourcedefinitions", "namespaces"} & set(r["resources"])]
    assert "--namespace=team" in _operator_args(docs)
    binding = _one(docs, "RoleBinding", "rel-splitserve")
    assert binding["metadata"]["namespace"] == "team"
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    # The Lease lives next to the operator, not in the watched namespace.
    assert _one(docs, "Role", "rel-splitserve-leader-election")["metadata"]["namespace"] == NAMESPACE


@needs_helm
@pytest.mark.parametrize("sets", [(), NAMESPACE_SCOPE, NAMESPACES_SCOPE, INFERENCE_POOL, ("router.namespaces={a,b}",)])
def test_rbac_is_explicit_and_never_reads_secrets(sets: tuple[str, ...]) -> None:
    rules = _rules(_render(*sets))
    assert rules
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert all("*" not in item for item in rule[field]), rule
        # The KV handoff key Secret is created once; its ownership and deletion are seen with
        # metadata-only lists and watches. No rule may get a Secret (or write one but create).
        if "secrets" in rule["resources"]:
            assert rule["resources"] == ["secrets"] and rule["verbs"] == ["create", "list", "watch"], rule
        assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate", "deletecollection"}, rule


@needs_helm
def test_namespaces_scope_renders_a_role_per_namespace_and_no_cluster_objects() -> None:
    docs = _render(*NAMESPACES_SCOPE)
    assert not [k for k in _kinds(docs) if k.startswith("Cluster")]
    watched = ["team-a", "team-b"]
    for kind in ("Role", "RoleBinding"):
        assert (
            sorted(
                d["metadata"]["namespace"]
                for d in docs
                if d["kind"] == kind and d["metadata"]["name"] == "rel-splitserve"
            )
            == watched
        ), kind
    for binding in (d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "rel-splitserve"):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "rel-splitserve"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-splitserve", "namespace": NAMESPACE}]
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rel-splitserve"]
    assert roles[0]["rules"] == roles[1]["rules"]
    assert not [
        r for r in roles[0]["rules"] if {"nodes", "customresourcedefinitions", "namespaces"} & set(r["resources"])
    ]
    # the operator watches exactly those namespaces
    args = _operator_args(docs)
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a,team-b"]
    assert operator_flags.watched_namespaces(_parse_args(args)) == ("team-a", "team-b")
    # router pods in each watched namespace get their ServiceAccount; the Lease stays home
    assert (
        sorted(
            d["metadata"]["namespace"]
            for d in docs
            if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "rel-splitserve-router"
        )
        == watched
    )
    assert _one(docs, "Role", "rel-splitserve-leader-election")["metadata"]["namespace"] == NAMESPACE


@needs_helm
def test_existing_scopes_keep_their_meaning() -> None:
    # rbac.scope namespace still means one namespace (watchNamespace, default the release's),
    # cluster still a ClusterRole and every namespace; watchNamespaces is ignored by both.
    for sets, flag in [
        (("rbac.scope=namespace", "watchNamespaces={x,y}"), "--namespace=ops"),
        (("watchNamespaces={x,y}",), None),
    ]:
        docs = _render(*sets)
        assert [a for a in _operator_args(docs) if a.startswith("--namespace")] == ([flag] if flag else [])
        assert not [d for d in docs if d["metadata"].get("namespace") in ("x", "y")]


RBAC_WRITES = {"create", "patch", "update", "delete"}
IDENTITY_RESOURCES = {"serviceaccounts", "roles", "rolebindings"}


def _grants(docs: tuple[dict[str, Any], ...], resources: set[str], verbs: set[str]) -> list[tuple[str, str, str]]:
    """(kind/name, resource, verb) of every rule in ``docs`` granting one of ``verbs`` on one of
    ``resources``."""
    return [
        (f"{d['kind']}/{d['metadata']['name']}", resource, verb)
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
        for rule in d["rules"]
        for resource in set(rule["resources"]) & resources
        for verb in set(rule["verbs"]) & verbs
    ]


@needs_helm
@pytest.mark.parametrize("scope", [(), NAMESPACE_SCOPE, NAMESPACES_SCOPE])
def test_inference_pool_rbac_is_off_by_default(scope: tuple[str, ...]) -> None:
    # Creating ServiceAccounts, Roles and RoleBindings lets the operator hand its permissions
    # to any subject: only with inferencePool.enabled, which also tells the operator.
    off = _render(*scope)
    assert _grants(off, IDENTITY_RESOURCES, RBAC_WRITES) == []
    assert _grants(off, {"inferencepools", "inferenceobjectives"}, {"get", "list", "watch"} | RBAC_WRITES) == []
    # the child watch still lists the picker's objects (kopf watches them in every mode)
    assert {(r, v) for _, r, v in _grants(off, IDENTITY_RESOURCES, {"get", "list", "watch"})} == {
        (r, v) for r in IDENTITY_RESOURCES for v in ("get", "list", "watch")
    }
    assert "--no-inference-pool" in _operator_args(off) and "--inference-pool" not in _operator_args(off)
    assert _parse_args(_operator_args(off)).inference_pool is False

    on = _render(*scope, *INFERENCE_POOL)
    operator = [
        g
        for g in _grants(on, IDENTITY_RESOURCES | {"inferencepools"}, RBAC_WRITES)
        if g[0] in ("Role/rel-splitserve", "ClusterRole/rel-splitserve")
    ]
    assert {(r, v) for _, r, v in operator} == {
        (r, v) for r in IDENTITY_RESOURCES | {"inferencepools"} for v in RBAC_WRITES
    }
    assert "--inference-pool" in _operator_args(on)
    assert _parse_args(_operator_args(on)).inference_pool is True

    # nothing else changes: the router's and the Lease's Roles are the same either way
    def rest(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        return [
            d
            for d in docs
            if not (d["kind"] in ("Role", "ClusterRole", "Deployment") and d["metadata"]["name"] == "rel-splitserve")
        ]

    assert rest(on) == rest(off)


def _parse_args(args: list[str]) -> operator_flags.OperatorArgs:
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator_flags.add_operator_arguments(parser)
    return operator_flags.operator_args_from_namespace(parser.parse_args(args))


@needs_helm
def test_operator_rules_cover_what_it_manages() -> None:
    rules = _one(_render(), "ClusterRole")["rules"]

    def verbs(group: str, resource: str) -> set[str]:
        return {v for r in rules if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}

    crud = {"create", "get", "list", "watch", "patch", "update", "delete"}
    assert verbs(contract.API_GROUP, contract.PLURAL) == {"get", "list", "watch", "patch", "update"}
    assert verbs(contract.API_GROUP, f"{contract.PLURAL}/status") == {"get", "patch", "update"}
    assert verbs(contract.API_GROUP, f"{contract.PLURAL}/finalizers") == {"update"}
    for group, resource in [
        ("apps", "deployments"),
        ("", "services"),
        ("", "configmaps"),
        ("policy", "poddisruptionbudgets"),
        ("networking.k8s.io", "networkpolicies"),
    ]:
        assert verbs(group, resource) == crud, resource
    assert verbs("", "pods") == {"get", "list", "watch", "patch"}
    assert verbs("", "secrets") == {"create", "list", "watch"}
    assert verbs("discovery.k8s.io", "endpointslices") == {"get", "list", "watch"}
    assert verbs("", "events") == {"create", "patch"} == verbs("events.k8s.io", "events")


@needs_helm
@pytest.mark.parametrize(("sets", "kind"), [((), "ClusterRole"), (NAMESPACE_SCOPE, "Role")])
def test_operator_creates_handoff_key_secrets_in_both_scopes(sets: tuple[str, ...], kind: str) -> None:
    # Issue 12 #4: the operator creates each disaggregated InferenceService's KV handoff key
    # Secret where the InferenceService lives (the watched namespace in namespace scope).
    role = _one(_render(*sets), kind, "rel-splitserve")
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "list", "watch"]} in role["rules"]
    if kind == "Role":
        assert role["metadata"]["namespace"] == "team"


@needs_helm
def test_leader_election_role_and_flags() -> None:
    docs = _render()
    lease_rules = _one(docs, "Role", "rel-splitserve-leader-election")["rules"]
    assert {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "list", "watch", "create", "update", "patch"],
    } in lease_rules
    args = _operator_args(docs)
    assert {"--leader-election", "--lease-name=rel-splitserve", f"--lease-namespace={NAMESPACE}"} <= set(args)
    assert _one(docs, "Deployment")["spec"]["replicas"] == 2
    assert _one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1

    single = _render("leaderElection.enabled=false", "replicaCount=1")
    assert "--no-leader-election" in _operator_args(single)
    assert "PodDisruptionBudget" not in _kinds(single)
    assert not [d for d in single if d["metadata"]["name"].endswith("leader-election")]


def _operator_args(docs: tuple[dict[str, Any], ...]) -> list[str]:
    container = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in container  # the image's ENTRYPOINT (tini) stays PID 1
    assert container["args"][:2] == ["splitserve", "operator"]
    return list(container["args"][2:])


@needs_helm
@pytest.mark.parametrize(
    "sets",
    [
        (),
        NAMESPACE_SCOPE,
        NAMESPACES_SCOPE,
        INFERENCE_POOL,
        ("leaderElection.enabled=false", "prometheus.url=http://prom:9090"),
    ],
)
def test_rendered_args_are_accepted_by_the_operator(sets: tuple[str, ...]) -> None:
    args = _operator_args(_render(*sets))
    names = {a.split("=", 1)[0] for a in args}
    assert names <= operator_flags.flag_names(), names - operator_flags.flag_names()
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator_flags.add_operator_arguments(parser)
    parsed = operator_flags.operator_args_from_namespace(parser.parse_args(args))
    assert parsed.metrics_port == 8080 and parsed.health_port == 8081
    assert parsed.router_service_account == "rel-splitserve-router"
    assert parsed.runtime_image == "ghcr.io/splitserve/splitserve:0.1.0"


@needs_helm
@pytest.mark.parametrize(
    ("sets", "flag"),
    [
        ((), "--allowed-hub-endpoints=https://huggingface.co"),  # the default: huggingface.co alone
        (
            ("hub.allowedEndpoints={https://hf.corp.example/hf,http://10.0.0.5}",),
            "--allowed-hub-endpoints=https://hf.corp.example/hf,http://10.0.0.5",
        ),
    ],
)
def test_the_operator_serves_only_the_hubs_of_the_values(sets: tuple[str, ...], flag: str) -> None:
    from splitserve_operator.api import hub_policy

    args = _operator_args(_render(*sets))
    assert flag in args
    hub_policy.HubAllowList.parse(flag.split("=", 1)[1])  # the operator accepts the list


@needs_helm
def test_restricted_pod_security() -> None:
    pod = _one(_render(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}


@needs_helm
def test_operator_gets_its_pod_identity_from_the_downward_api() -> None:
    # main.py binds /metrics and the probes to POD_IP, names itself in the Lease by POD_NAME
    # and defaults the Lease namespace to POD_NAMESPACE.
    (container,) = _one(_render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert fields == {
        contract.ENV_POD_IP: "status.podIP",
        contract.ENV_POD_NAME: "metadata.name",
        contract.ENV_POD_NAMESPACE: "metadata.namespace",
    }


@needs_helm
def test_operator_pod_is_scraped_and_selected() -> None:
    docs = _render()
    deployment = _one(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[contract.LABEL_SCRAPE] == "true"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    service = _one(docs, "Service")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", doc["kind"]
        assert doc["metadata"]["labels"]["helm.sh/chart"] == "splitserve-0.1.0", doc["kind"]


@needs_helm
def test_router_service_accounts_per_namespace() -> None:
    default = _render()
    sa = _one(default, "ServiceAccount", "rel-splitserve-router")
    assert sa["metadata"]["namespace"] == NAMESPACE
    role = _one(default, "Role", "rel-splitserve-router")
    assert [r["resources"] for r in role["rules"]] == [["endpointslices"]]  # no pods: least privilege
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in role["rules"])

    many = _render("router.namespaces={a,b}", "router.serviceAccountName=edge")
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert sorted(
            d["metadata"]["namespace"] for d in many if d["kind"] == kind and d["metadata"]["name"] == "edge"
        ) == ["a", "b"]
    assert "--router-service-account=edge" in _operator_args(many)
    assert "edge" not in {d["metadata"]["name"] for d in _render("router.createServiceAccount=false")}


@needs_helm
@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("bogus=1", "bogus"),
        ("rbac.bogus=true", "bogus"),
        ("resources.requests.gpu=1", "gpu"),
        ("rbac.scope=global", "rbac"),
        ("replicaCount=0", "replicaCount"),
        ("logLevel=chatty", "logLevel"),
        ("rbac.scope=namespaces", "watchNamespaces"),  # namespaces scope with no namespace
        ("watchNamespaces={team-*}", "watchNamespaces"),  # kopf would read a glob
        ("inferencePool.enabled=yes", "inferencePool"),
    ],
)
def test_schema_rejects_bad_values(item: str, message: str) -> None:
    proc = _helm("template", "rel", str(CHART), "--set", item)
    assert proc.returncode != 0
    assert message in proc.stderr


@needs_helm
def test_no_hooks_and_crds_only_in_crds_dir() -> None:
    for docs in (_render(), _render(*NAMESPACE_SCOPE)):
        for doc in docs:
            assert "helm.sh/hook" not in (doc["metadata"].get("annotations") or {}), doc["kind"]
            assert doc["kind"] != "CustomResourceDefinition"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["splitserve.dev_inferenceservices.yaml"]


# ----------------------------------------------------------------- no helm needed
def test_every_value_is_documented_by_name() -> None:
    # Helm best practice: the comment block right above a key starts with the key's name.
    undocumented = []
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in (CHART / "values.yaml").read_text().splitlines():
        if line.strip().startswith("#"):
            block.append(line.strip())
            continue
        match = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):", line)
        if match:
            indent, key = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([k for _, k in stack] + [key])
            stack.append((indent, key))
            if not (block and block[0].startswith(f"# {path} ")):
                undocumented.append(path)
        block = []
    assert undocumented == []
    assert len(stack) > 0


def _schema_objects(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)] if node.get("type") == "object" else []
    for name, sub in node.get("properties", {}).items():
        found += _schema_objects(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        found += _schema_objects(node["items"], f"{path}[]")
    return found


FREE_FORM = {
    ".affinity.nodeAffinity",
    ".affinity.podAffinity",
    ".affinity.podAntiAffinity",
    ".networkPolicy.metricsNamespaceSelector.matchExpressions[]",
}


def test_values_schema_is_closed_at_every_level() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = [
        path
        for path, node in _schema_objects(schema)
        if path not in FREE_FORM
        and node.get("additionalProperties") is not False
        and not isinstance(node.get("additionalProperties"), dict)
    ]
    assert open_objects == []
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def keys(value: Any, node: dict[str, Any], path: str) -> None:
        if isinstance(value, dict) and "properties" in node:
            for key, sub in value.items():
                assert key in node["properties"], f"{path}.{key} missing from values.schema.json"
                keys(sub, node["properties"][key], f"{path}.{key}")

    keys(values, schema, "")
    assert set(values) == set(schema["properties"])


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == "0.1.0"
    assert chart["name"] == "splitserve"
    assert not list((CHART / "templates").glob("*crd*"))


def test_the_vllm_image_default_is_the_operators_unless_the_values_name_one() -> None:
    assert _parse_args(_operator_args(_render())).vllm_image == VLLM_IMAGE
    mirrored = _operator_args(_render("runtime.vllmImage=mirror.example/vllm/vllm-openai:v0.32.0"))
    assert _parse_args(mirrored).vllm_image == "mirror.example/vllm/vllm-openai:v0.32.0"
