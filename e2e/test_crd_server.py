"""The CRD and the chart against a real API server: the CEL rules compile and reject bad
objects with our messages, defaults are applied server-side exactly as the models expect,
printer columns and the status subresource work, and every manifest the chart renders
(both RBAC scopes) passes server-side validation."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import crdgen
import pytest
import yaml

from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.stack import apply_crds
from splitserve_operator import api
from splitserve_operator.api import rules

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CRD_FILE = REPO / crdgen.OUTPUT_PATHS[0]
CHART = REPO / "helm" / "splitserve"


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> str:
    apply_crds(cluster, CRD_FILE)
    return crdgen.CRD_NAME


def _apply(
    cluster: LocalCluster, namespace: str, obj: dict[str, Any], *, dry_run: bool = True
) -> subprocess.CompletedProcess[str]:
    args = ["apply", "-n", namespace, "-f", "-"]
    if dry_run:
        args.append("--dry-run=server")
    result: subprocess.CompletedProcess[str] = cluster.kubectl(*args, input_text=json.dumps(obj), check=False)
    return result


def _example(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "examples" / name).read_text()))


def test_examples_are_accepted(cluster: LocalCluster, crd: str, namespace: str) -> None:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        result = _apply(cluster, namespace, _example(path.name))
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"spec": {"prefill": {"replicas": {"min": 3, "max": 2}}}}, rules.REPLICAS_RULE_MESSAGE),
        ({"spec": {"aggregated": {}}}, rules.DISAGGREGATED_RULE_MESSAGE),
        ({"spec": {"mode": "Aggregated"}}, rules.AGGREGATED_RULE_MESSAGE),
        # parallelism: a pod's GPUs hold tensor x pipeline ranks; a CPU pod has one rank; a draft
        # model is not served with parallelism yet
        (
            {"spec": {"prefill": {"resources": {"gpus": 2}, "parallelism": {"tensor": 4}}}},
            rules.PARALLELISM_RULE_MESSAGE,
        ),
        (
            {"spec": {"decode": {"resources": {"gpus": 0}, "parallelism": {"tensor": 2}}}},
            rules.CPU_PARALLELISM_RULE_MESSAGE,
        ),
        ({"spec": {"decode": {"parallelism": {"pipeline": 2}}}}, rules.PARALLELISM_RULE_MESSAGE),
        (
            {
                "spec": {
                    "decode": {"resources": {"gpus": 2}, "parallelism": {"tensor": 2}},
                    "scheduling": {"speculative": {"method": "draft", "draftModel": "hf://org/draft"}},
                }
            },
            rules.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE,
        ),
        (
            {"spec": {"scheduling": {"speculative": {"method": "ngram", "draftModel": "hf://org/draft"}}}},
            rules.DRAFT_MODEL_RULE_MESSAGE,
        ),
        ({"spec": {"scheduling": {"speculative": {"method": "draft"}}}}, rules.DRAFT_METHOD_RULE_MESSAGE),
        ({"spec": {"scheduling": {"speculative": {"numTokens": 17}}}}, "numTokens"),
        ({"spec": {"kvCache": {"dtype": "int8"}}}, "dtype"),
        ({"spec": {"model": {"quantization": "fp4"}}}, "quantization"),
        ({"spec": {"autoscaling": {"gpuBudget": 1}}}, rules.GPU_BUDGET_RULE_MESSAGE),
        ({"metadata": {"name": "x" * 41}}, rules.NAME_LENGTH_RULE_MESSAGE),
        ({"spec": {"kvCache": {"memoryFraction": 0.99}}}, "memoryFraction"),
        ({"spec": {"kvCache": {"blockSize": 24}}}, "blockSize"),
        ({"spec": {"model": {"uri": "s3://bucket/model"}}}, "spec.model.uri"),
        ({"spec": {"autoscaling": {"interval": "fast"}}}, "spec.autoscaling.interval"),
        ({"spec": {"autoscaling": {"interval": "0s"}}}, rules.INTERVAL_RULE_MESSAGE),
    ],
)
def test_invalid_objects_are_rejected_with_a_message(
    cluster: LocalCluster, crd: str, namespace: str, patch: dict[str, Any], message: str | tuple[str, ...]
) -> None:
    obj = _merge(_minimal(), patch)
    result = _apply(cluster, namespace, obj)
    assert result.returncode != 0, f"accepted: {obj}"
    assert any(m in result.stderr for m in ((message,) if isinstance(message, str) else message)), result.stderr
    # The models reject the same object (the operator never acts on what the CRD refuses).
    with pytest.raises(api.InvalidSpecError):
        api.InferenceService.parse(obj)


def test_server_defaults_match_the_models(cluster: LocalCluster, crd: str, namespace: str) -> None:
    obj = _minimal()
    created = _apply(cluster, namespace, obj, dry_run=False)
    assert created.returncode == 0, created.stderr
    live = json.loads(cluster.kubectl("get", "sis", "demo", "-n", namespace, "-o", "json").stdout)
    spec = live["spec"]
    assert spec["mode"] == "Disaggregated"
    assert spec["kvCache"] == {"blockSize": 16, "memoryFraction": 0.9, "prefixCaching": True, "dtype": "auto"}
    # spec.scheduling has no server default (spec.engine, its deprecated old name, must stay
    # distinguishable from it on objects stored before the rename): the models' defaults apply.
    assert "scheduling" not in spec and "engine" not in spec and spec["runtime"]["engine"] == "splitserve"
    assert spec["prefill"]["replicas"] == {"min": 1, "max": 4}
    assert spec["autoscaling"]["behavior"]["scaleDown"] == {"stabilizationSeconds": 300, "maxStep": 1}
    parsed = api.InferenceService.parse(live)
    assert parsed.spec.scheduling_settings.speculative.model_dump() == {
        "method": "none",
        "num_tokens": 4,
        "max_num_seqs": 16,
        "draft_model": None,
    }
    assert parsed.spec == api.InferenceService.parse(obj).spec

    # The status subresource takes the model's dump, and the printer columns show it.
    status = api.InferenceServiceStatus(
        observed_generation=live["metadata"]["generation"],
        endpoint="http://demo-router.x.svc:8000",
        conditions=[
            api.Condition(
                type="Ready",
                status=api.ConditionStatus.TRUE,
                reason=api.Reason.RECONCILED,
                last_transition_time=api.utc_now(),
                observed_generation=1,
            ),
            api.Condition(
                type="MetricsHealthy",
                status=api.ConditionStatus.TRUE,
                reason="MetricsAvailable",
                last_transition_time=api.utc_now(),
                observed_generation=1,
            ),
        ],
        prefill=api.PoolStatus(
            replicas=1,
            ready_replicas=1,
            desired_replicas=2,
            last_decision=api.ScalingDecision(time=api.utc_now(), result=2, reason="ScaledUp"),
        ),
        decode=api.PoolStatus(replicas=1, ready_replicas=1, desired_replicas=1),
    )
    cluster.kubectl(
        "patch",
        "sis",
        "demo",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status.dump()}),
    )
    table = cluster.kubectl("get", "sis", "-n", namespace).stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "MODE",
        "PREFILL",
        "DECODE",
        "AGGREGATED",
        "ENGINE",
        "READY",
        "ENDPOINT",
        "AGE",
    ]
    assert table[1].split()[:7] == [
        "demo",
        "Disaggregated",
        "1/2",
        "1/1",
        "splitserve",
        "True",
        "http://demo-router.x.svc:8000",
    ]
    wide = cluster.kubectl("get", "sis", "-n", namespace, "-o", "wide").stdout.splitlines()
    columns = wide[0].split()
    assert columns[columns.index("METRICS") : columns.index("METRICS") + 4] == [
        "METRICS",
        "PREFILL-SCALING",
        "DECODE-SCALING",
        "AGGREGATED-SCALING",
    ], wide
    starts = [wide[0].index(f"{name} ") if name != columns[-1] else wide[0].rindex(name) for name in columns]
    row = {
        name: wide[1][start:end].strip() for name, start, end in zip(columns, starts, [*starts[1:], None], strict=True)
    }
    assert (row["METRICS"], row["PREFILL-SCALING"], row["DECODE-SCALING"]) == ("MetricsAvailable", "ScaledUp", ""), wide
    again = json.loads(cluster.kubectl("get", "sis", "demo", "-n", namespace, "-o", "json").stdout)
    assert api.InferenceService.parse(again).status.prefill == status.prefill


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_chart_manifests_pass_server_validation(cluster: LocalCluster, crd: str, namespace: str, scope: str) -> None:
    rendered = cluster.helm(
        "template", "e2e", str(CHART), "--namespace", namespace, "--set", f"rbac.scope={scope}"
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    if scope == "namespace":
        assert not [d for d in docs if d["kind"].startswith("Cluster")]
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input_text=rendered, check=False)
    assert result.returncode == 0, result.stderr


def _minimal() -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": "InferenceService",
        "metadata": {"name": "demo"},
        "spec": {"model": {"uri": "hf://org/model"}, "prefill": {}, "decode": {}},
    }


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and value:
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def test_namespace_scope_rbac_grants_exactly_what_the_operator_needs(
    cluster: LocalCluster, crd: str, namespace: str
) -> None:
    watched = f"{namespace}-w"[:63]
    cluster.kubectl("create", "namespace", watched)
    try:
        rendered = cluster.helm(
            "template",
            "rel",
            str(CHART),
            "--namespace",
            namespace,
            "--set",
            "rbac.scope=namespace",
            "--set",
            f"watchNamespace={watched}",
        ).stdout
        cluster.kubectl("apply", "-f", "-", input_text=rendered)
        operator = f"system:serviceaccount:{namespace}:rel-splitserve"
        router = f"system:serviceaccount:{watched}:rel-splitserve-router"
        expected = {
            (operator, f"list inferenceservices.splitserve.dev -n {watched}"): "yes",
            (operator, f"patch inferenceservices.splitserve.dev/status -n {watched}"): "yes",
            (operator, f"update inferenceservices.splitserve.dev/finalizers -n {watched}"): "yes",
            (operator, f"create deployments.apps -n {watched}"): "yes",
            (operator, f"patch pods -n {watched}"): "yes",
            (operator, f"create events.events.k8s.io -n {watched}"): "yes",
            (operator, f"create leases.coordination.k8s.io -n {namespace}"): "yes",
            (operator, f"delete pods -n {watched}"): "no",
            (operator, f"get secrets -n {watched}"): "no",
            (operator, f"list inferenceservices.splitserve.dev -n {namespace}"): "no",
            (operator, "list nodes"): "no",
            (router, f"list endpointslices.discovery.k8s.io -n {watched}"): "yes",
            (router, f"watch pods -n {watched}"): "no",  # EndpointSlices only
            (router, f"patch pods -n {watched}"): "no",
            (router, f"get secrets -n {watched}"): "no",
        }
        got = {
            key: cluster.kubectl("auth", "can-i", *key[1].split(), f"--as={key[0]}", check=False).stdout.strip()
            for key in expected
        }
        assert got == expected
    finally:
        cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)
