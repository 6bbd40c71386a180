"""Issue 12 #11: free-form pod fields are checked with Kubernetes' own schemas.

``tolerations: [{"foo": "bar"}]``, ``affinity: {"nodeAffinity": "garbage"}`` and
``resources.memory: "-1Gi"`` used to pass admission (and the models) and fail only when the
Deployment was applied. The CRD now embeds the API server's core/v1 schemas (snapshotted by
``operator/tools/corev1gen.py``, converted by :mod:`splitserve_operator.api.corev1`) and
the models check the same schema, so both refuse them with the field path. The CRD side
against a real API server is in ``e2e/test_hostile_manifests.py``."""

from __future__ import annotations

import copy
import fnmatch
import json
import tomllib
from pathlib import Path
from typing import Any

import corev1gen
import pytest
import yaml

from splitserve_operator import api
from splitserve_operator.api import corev1
from splitserve_operator.api.corev1 import SNAPSHOT

REPO = Path(__file__).resolve().parents[3]
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H200"]}]}
            ]
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}
        ],
    },
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 50,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}},
                },
            }
        ]
    },
}


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [str(v) for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_snapshot_is_closed_and_from_the_pinned_api_server() -> None:
    assert SNAPSHOT["source"] == "kube-apiserver GET /openapi/v3/api/v1"
    assert SNAPSHOT["kubernetesVersion"] == "1.34"  # e2e/gobin pins k8s.io/kubernetes v1.34
    assert set(SNAPSHOT["podSpecFields"]) == set(corev1gen.POD_SPEC_FIELDS)
    for ref in _refs(SNAPSHOT):
        assert ref.removeprefix("#/components/schemas/") in SNAPSHOT["schemas"], ref
    assert {corev1.TOLERATION, corev1.AFFINITY} <= set(SNAPSHOT["schemas"])


def _document() -> dict[str, Any]:
    """An /openapi/v3/api/v1 document made of the snapshot plus schemas it does not reach."""
    schemas = copy.deepcopy(SNAPSHOT["schemas"])
    schemas["io.k8s.api.core.v1.Unrelated"] = {"type": "object", "properties": {"x": {"type": "string"}}}
    schemas[corev1gen.POD_SPEC] = {
        "type": "object",
        "properties": {**copy.deepcopy(SNAPSHOT["podSpecFields"]), "hostname": {"type": "string"}},
    }
    return {
        "info": {"title": "Kubernetes", "version": SNAPSHOT["kubernetesVersion"]},
        "components": {"schemas": schemas},
    }


def test_generator_copies_exactly_what_the_pod_fields_reach(tmp_path: Path) -> None:
    assert corev1gen.extract(_document()) == SNAPSHOT
    source = tmp_path / "api_v1.json"
    source.write_text(json.dumps(_document()))
    output = tmp_path / "snapshot.json"
    assert corev1gen.main([str(source), "--check", "--output", str(output)]) == 1
    assert corev1gen.main([str(source), "--output", str(output)]) == 0
    assert output.read_text() == corev1gen.SNAPSHOT_PATH.read_text()  # the committed one is current
    assert corev1gen.main([str(source), "--check", "--output", str(output)]) == 0
    assert json.loads(output.read_text()) == SNAPSHOT


def test_snapshot_is_package_data_the_wheel_ships() -> None:
    """The admission code reads the snapshot at import: a wheel without it cannot start."""
    with (REPO / "pyproject.toml").open("rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["splitserve_operator"]
    assert any(fnmatch.fnmatch(f"api/{corev1.SNAPSHOT_FILE}", pattern) for pattern in patterns)
    assert corev1gen.SNAPSHOT_PATH.is_file()


def test_conversion_to_structural_crd_schemas() -> None:
    toleration = corev1.crd_schema(corev1.TOLERATION)
    affinity = corev1.crd_schema(corev1.AFFINITY)
    text = yaml.safe_dump([toleration, affinity])
    for word in ("$ref", "allOf", "default:", "x-kubernetes-patch"):
        assert word not in text, word
    # Optional enums also take "" as the API server does (Go's omitempty); required ones do not.
    assert toleration["properties"]["operator"]["enum"] == ["Equal", "Exists", ""]
    assert toleration["properties"]["effect"]["enum"] == ["NoExecute", "NoSchedule", "PreferNoSchedule", ""]
    requirement = affinity["properties"]["nodeAffinity"]["properties"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["properties"]["nodeSelectorTerms"]["items"]["properties"]["matchExpressions"]["items"]
    assert requirement["required"] == ["key", "operator"]
    assert "" not in requirement["properties"]["operator"]["enum"]
    assert toleration["properties"]["tolerationSeconds"] == {
        **toleration["properties"]["tolerationSeconds"],
        "type": "integer",
        "format": "int64",
    }
    # Descriptions keep their first sentence (kubectl explain), not the enum lists.
    assert toleration["properties"]["effect"]["description"] == "Effect indicates the taint effect to match."
    assert corev1.crd_schema(corev1.TOLERATION) is not corev1.crd_schema(corev1.TOLERATION)  # fresh copies


def test_problems_reads_like_the_api_server() -> None:
    schema = corev1.crd_schema(corev1.AFFINITY)
    assert corev1.problems(AFFINITY, schema) == []
    assert corev1.problems({"nodeAffinity": "garbage"}, schema) == ["nodeAffinity: must be of type object, got str"]
    assert corev1.problems({"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{}]}}, schema) == [
        "podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey: Required value"
    ]
    assert corev1.problems({"nodeAfinity": {}}, schema) == ["nodeAfinity: field not declared in schema"]
    weight = {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": True, "preference": {}}]}
    assert corev1.problems({"nodeAffinity": weight}, schema) == [
        "nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight: must be of type integer, got bool"
    ]


def _with_prefill(**pool: Any) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": "InferenceService",
        "metadata": {"name": "demo", "namespace": "team"},
        "spec": {"model": {"uri": "hf://org/model"}, "prefill": pool, "decode": {}},
    }


@pytest.mark.parametrize(
    ("pool", "fragments"),
    [
        ({"tolerations": [{"foo": "bar"}]}, ("spec.prefill.tolerations[0]", "foo: field not declared in schema")),
        ({"tolerations": [{}]}, ("spec.prefill.tolerations[0]", api.TOLERATION_KEY_RULE_MESSAGE)),
        ({"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}, (api.TOLERATION_VALUE_RULE_MESSAGE,)),
        (
            {"tolerations": [{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]},
            (api.TOLERATION_SECONDS_RULE_MESSAGE,),
        ),
        ({"tolerations": [{"key": "a", "effect": "Sometimes"}]}, ("effect: Unsupported value: 'Sometimes'",)),
        (
            {"tolerations": [{"key": "a", "tolerationSeconds": "forever", "effect": "NoExecute"}]},
            ("tolerationSeconds: must be of type integer",),
        ),
        ({"affinity": {"nodeAffinity": "garbage"}}, ("spec.prefill.affinity", "nodeAffinity: must be of type object")),
        (
            {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{}]}}},
            ("topologyKey: Required value",),
        ),
        (
            {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}},
            ("nodeSelectorTerms: Required value",),
        ),
        ({"affinity": "garbage"}, ("spec.prefill.affinity", "dictionary")),
        ({"resources": {"memory": "-1Gi"}}, ("spec.prefill.resources.memory", "non-negative")),
        ({"resources": {"cpu": -1}}, ("spec.prefill.resources.cpu", "non-negative")),
        ({"nodeSelector": {"bad key!": "x"}}, ("spec.prefill", api.NODE_SELECTOR_RULE_MESSAGE)),
        ({"nodeSelector": {"zone": "not a label value"}}, ("spec.prefill.nodeSelector.zone", "label value")),
    ],
)
def test_hostile_pod_fields_are_refused_with_the_field_path(pool: dict[str, Any], fragments: tuple[str, ...]) -> None:
    with pytest.raises(api.InvalidSpecError) as caught:
        api.InferenceService.parse(_with_prefill(**pool))
    for fragment in fragments:
        assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "pool",
    [
        {
            "tolerations": [
                KWOK_TOLERATION,
                {"operator": "Exists"},
                {"key": "a", "operator": "Equal", "value": "b", "effect": ""},
                {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute", "tolerationSeconds": 30},
            ]
        },
        {"affinity": AFFINITY},
        {"nodeSelector": {"example.com/gpu-product": "H200", "zone": ""}},
        {"resources": {"cpu": "500m", "memory": "16Gi"}},
        {"resources": {"cpu": 2, "memory": "1"}},  # "0" is refused: a pod needs some memory
    ],
)
def test_valid_pod_fields_pass_and_reach_the_pods_unchanged(pool: dict[str, Any]) -> None:
    isvc = api.InferenceService.parse(_with_prefill(**pool))
    assert isvc.spec.prefill is not None
    dumped = isvc.spec.prefill.dump()
    for field in ("tolerations", "affinity", "nodeSelector"):
        if field in pool:
            assert dumped[field] == pool[field]


def test_runtime_image_may_not_contain_whitespace() -> None:
    obj = _with_prefill()
    obj["spec"]["runtime"] = {"image": " registry.example/splitserve:1"}
    with pytest.raises(api.InvalidSpecError, match="image reference without whitespace"):
        api.InferenceService.parse(obj)
