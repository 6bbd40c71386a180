"""The generated CRD: structural (the API server would accept it), fully described,
carrying the CEL rules and printer columns, defaulting exactly like the models, and
committed in both places byte-identical to what the generator writes now."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crdgen
import pytest
import yaml

from splitserve_contract import capabilities as caps
from splitserve_contract import defaults
from splitserve_operator import api
from splitserve_operator.api import corev1, fields

REPO = Path(__file__).resolve().parents[3]

# Keys a JSONSchemaProps node of apiextensions.k8s.io/v1 may carry (and we use).
ALLOWED_KEYS = frozenset(
    {
        "description",
        "type",
        "format",
        "default",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "items",
        "properties",
        "additionalProperties",
        "required",
        "anyOf",
        "x-kubernetes-int-or-string",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-validations",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
    }
)
TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean"})
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


def _walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def structural_violations(schema: dict[str, Any]) -> list[str]:
    """The structural-schema rules of apiextensions.k8s.io/v1 that our generator could break."""
    problems = []
    for path, node in _walk(schema):
        where = path or "<root>"
        problems += [f"{where}: key {k!r} not allowed" for k in node.keys() - ALLOWED_KEYS]
        if node.get("x-kubernetes-int-or-string"):
            if "type" in node or node.get("anyOf", INT_OR_STRING) != INT_OR_STRING:
                problems.append(f"{where}: int-or-string must be anyOf [integer, string] without type")
            continue
        if "anyOf" in node:
            problems.append(f"{where}: anyOf only allowed for int-or-string")
        if node.get("type") not in TYPES:
            problems.append(f"{where}: missing or bad type {node.get('type')!r}")
        if node.get("type") == "object":
            has_props = "properties" in node
            has_add = "additionalProperties" in node
            if has_props and has_add:
                problems.append(f"{where}: properties and additionalProperties are exclusive")
            if has_add and not isinstance(node["additionalProperties"], dict):
                problems.append(f"{where}: additionalProperties must be a schema")
            if not (has_props or has_add or node.get("x-kubernetes-preserve-unknown-fields")) and path not in (
                ".metadata",
            ):
                problems.append(f"{where}: object without properties (fields would be pruned)")
            for req in node.get("required", []):
                if req not in node.get("properties", {}):
                    problems.append(f"{where}: required {req!r} is not a property")
        elif node.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{where}: preserve-unknown-fields on a non-object")
        if node.get("type") == "array" and not isinstance(node.get("items"), dict):
            problems.append(f"{where}: array without items schema")
        if isinstance(node.get("exclusiveMinimum"), int | float) and not isinstance(node.get("exclusiveMinimum"), bool):
            problems.append(f"{where}: exclusiveMinimum must be a boolean in OpenAPI v3.0")
    return problems


@functools.cache
def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_schema_is_structural() -> None:
    assert structural_violations(_schema()) == []


def test_checker_catches_violations() -> None:
    bad = {
        "type": "object",
        "properties": {
            "a": {"$ref": "#/x"},
            "b": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "c": {"type": "object"},
            "d": {"type": "number", "minimum": 0, "exclusiveMinimum": 0},
            "e": {"type": "array"},
        },
    }
    text = "\n".join(structural_violations(bad))
    for fragment in (
        ".a: key '$ref'",
        ".b: anyOf only",
        ".c: object without properties",
        ".d: exclusiveMinimum",
        ".e: array without items",
    ):
        assert fragment in text


def test_no_refs_or_unions_left() -> None:
    text = yaml.safe_dump(_schema())
    for word in ("$ref", "$defs", "oneOf", "allOf", "title:"):
        assert word not in text, word
    nulls = [
        path
        for path, node in _walk(_schema())
        if node.get("type") == "null" or any(value is None for value in node.values())
    ]
    assert nulls == []


def test_every_field_has_a_description() -> None:
    fields_ = [
        (f"{path}.{name}", name, sub)
        for path, node in _walk(_schema())
        for name, sub in node.get("properties", {}).items()
    ]
    missing = [path for path, _, sub in fields_ if not sub.get("description") and path != ".metadata"]
    # Kubernetes' definitions that appear again in a pool's affinity (LabelSelector eight
    # times) describe their fields at the first place only: the CRD's size budget.
    described = {name for path, name, sub in fields_ if sub.get("description") and _in_core_v1(path)}
    # The deprecated spec.engine (spec.scheduling's old name) describes itself only.
    deprecated = tuple(f".spec.{name}." for name in crdgen.DEPRECATED_SPEC_FIELDS)
    assert [p for p in missing if not _in_core_v1(p) and not p.startswith(deprecated)] == []
    assert {p.rsplit(".", 1)[1] for p in missing if not p.startswith(deprecated)} <= described
    assert len(missing) < len(fields_) // 2


def test_no_field_preserves_unknown_fields() -> None:
    # Pod fields carry Kubernetes' own schemas (issue 12 #11): nothing passes through unchecked.
    assert [path for path, node in _walk(_schema()) if node.get("x-kubernetes-preserve-unknown-fields")] == []


_CORE_V1_FIELDS = ("affinity", "tolerations")
"""Pool fields whose schema is Kubernetes' own (:mod:`splitserve_operator.api.corev1`)."""


def _in_core_v1(path: str) -> bool:
    return any(f".{field}" in path for field in _CORE_V1_FIELDS)


def test_pod_fields_embed_the_api_servers_schemas() -> None:
    for pool in ("prefill", "decode", "aggregated"):
        props = _schema()["properties"]["spec"]["properties"][pool]["properties"]
        affinity = {k: v for k, v in props["affinity"].items() if k != "description"}
        assert affinity == {k: v for k, v in fields._AFFINITY_SCHEMA.items() if k != "description"}
        toleration = props["tolerations"]["items"]
        assert toleration == fields._TOLERATION_SCHEMA
        # Kubernetes' schemas plus what its Go code checks (and bounds for the spec's size)
        assert {k: v for k, v in toleration.items() if k != "x-kubernetes-validations"} == _merged(
            corev1.crd_schema(corev1.TOLERATION),
            {"properties": {"key": {"maxLength": api.rules.MAX_LABEL_KEY_LENGTH}, "value": {"maxLength": 63}}},
        )
        assert toleration["x-kubernetes-validations"] == [dict(r) for r in api.TOLERATION_CEL_RULES]
        assert props["tolerations"]["maxItems"] == 32
        term = affinity["properties"]["podAntiAffinity"]["properties"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["items"]
        assert term["required"] == ["topologyKey"] and term["properties"]["topologyKey"]["type"] == "string"
        assert term["properties"]["topologyKey"]["minLength"] == 1
        assert (
            affinity["properties"]["podAntiAffinity"]["properties"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "maxItems"
            ]
            == 32
        )
        requirement = term["properties"]["labelSelector"]["properties"]["matchExpressions"]["items"]
        assert requirement["x-kubernetes-validations"] == [dict(r) for r in api.rules.SELECTOR_REQUIREMENT_CEL_RULES]
        assert "default" not in yaml.safe_dump(affinity)
        node_selector = props["nodeSelector"]
        assert node_selector["maxProperties"] == 32
        assert node_selector["additionalProperties"]["pattern"] == api.LABEL_VALUE_PATTERN


def _merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) else value
    return out


def test_quantities_are_non_negative() -> None:
    resources = _schema()["properties"]["spec"]["properties"]["prefill"]["properties"]["resources"]["properties"]
    for name in ("cpu", "memory"):
        node = resources[name]
        assert node["minimum"] == 0  # the integer form
        for good in ("2", "500m", "16Gi", "0", "+1", "1e3", "1.5"):
            assert re.match(node["pattern"], good), good
        for bad in ("-1Gi", "-1", "-0.5", "1.5.5Gi", "16GB", ""):
            assert not re.match(node["pattern"], bad), bad


def _cel(path: str) -> list[dict[str, str]]:
    node = _schema()
    for part in [p for p in path.split(".") if p]:
        node = node["properties"][part]
    return list(node.get("x-kubernetes-validations", []))


def test_cel_rules_are_where_they_belong_and_have_messages() -> None:
    root = _cel("")
    assert {"rule": "self.metadata.name.size() <= 40", "message": api.NAME_LENGTH_RULE_MESSAGE} in root
    spec_rules = " ".join(r["rule"] for r in _cel("spec"))
    assert (
        "self.mode != 'Disaggregated' || (has(self.prefill) && has(self.decode) && !has(self.aggregated))" in spec_rules
    )
    assert (
        "self.mode != 'Aggregated' || (has(self.aggregated) && !has(self.prefill) && !has(self.decode))" in spec_rules
    )
    assert "self.autoscaling.gpuBudget >=" in spec_rules
    for pool in ("prefill", "decode", "aggregated"):
        assert _cel(f"spec.{pool}.replicas") == [{"rule": "self.min <= self.max", "message": api.REPLICAS_RULE_MESSAGE}]
        assert any(
            "% (self.parallelism.tensor * self.parallelism.pipeline) == 0" in r["rule"] for r in _cel(f"spec.{pool}")
        )
    for path, node in _walk(_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule.keys() <= {"rule", "message", "messageExpression", "fieldPath"} and rule["message"], path
            # Every field a rule names must exist below the node it is attached to (on a
            # string, self.name(...) is one of its methods).
            for field in re.findall(r"self\.([A-Za-z]+)\b(?!\()", rule["rule"]):
                assert field in node.get("properties", {}), (path, field)


def test_bounds_enums_and_patterns() -> None:
    spec = _schema()["properties"]["spec"]["properties"]
    kv = spec["kvCache"]["properties"]
    assert kv["blockSize"]["enum"] == [8, 16, 32, 64, 128]
    assert kv["blockSize"]["default"] == defaults.BLOCK_SIZE
    assert (kv["dtype"]["enum"], kv["dtype"]["default"]) == (["auto", "fp8"], "auto")
    assert kv["memoryFraction"] == {**kv["memoryFraction"], "minimum": 0, "exclusiveMinimum": True, "maximum": 0.98}
    assert spec["prefill"]["properties"]["parallelism"]["properties"]["tensor"]["enum"] == [1, 2, 4, 8]
    assert spec["mode"]["enum"] == ["Disaggregated", "Aggregated"]
    assert spec["router"]["properties"]["policy"]["enum"] == ["PrefixAffinity", "LeastLoad", "RoundRobin"]
    assert spec["model"]["required"] == ["uri"]
    assert re.match(spec["model"]["properties"]["uri"]["pattern"], "hf://org/name")
    assert not re.match(spec["model"]["properties"]["uri"]["pattern"], "s3://org/name")
    assert (
        spec["autoscaling"]["properties"]["behavior"]["properties"]["scaleUp"]["properties"]["maxStepPercent"][
            "minimum"
        ]
        == 1
    )
    cpu = spec["prefill"]["properties"]["resources"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True
    # Our strings are bounded; Kubernetes' own (affinity, tolerations) are as the API server
    # has them, and no CEL rule reads them but through size().
    strings = [
        path
        for path, node in _walk(_schema())
        if node.get("type") == "string"
        and "enum" not in node
        and node.get("format") != "date-time"
        and path not in (".apiVersion", ".kind")
        and not _in_core_v1(path)
    ]
    assert [p for p in strings if "maxLength" not in _node_at(p)] == []


def _node_at(path: str) -> dict[str, Any]:
    for p, node in _walk(_schema()):
        if p == path:
            return node
    raise KeyError(path)


def test_status_conditions_are_a_map_keyed_by_type() -> None:
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) >= {"type", "status", "reason", "lastTransitionTime"}
    assert conditions["items"]["properties"]["status"]["enum"] == ["True", "False", "Unknown"]


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: fill missing properties that have
    a default, then recurse into every present object and array item."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _apply_defaults(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [_apply_defaults(schema["items"], v) for v in value]
    return value


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_crd_defaults_equal_model_defaults(example: Path) -> None:
    obj = yaml.safe_load(example.read_text())
    by_model = api.InferenceService.parse(obj).dump()["spec"]
    server_side = _apply_defaults(_schema()["properties"]["spec"], copy.deepcopy(obj["spec"]))
    # Every default the model fills in, the API server fills in too (lists and maps
    # default to absent; quantities are normalised to strings by the model).
    assert _normalise(server_side) == _normalise(by_model)


def _normalise(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        items = {k: _normalise(v, k) for k, v in value.items()}
        return {k: v for k, v in items.items() if v not in ([], {})}
    if key in ("cpu", "memory") and isinstance(value, int):
        return str(value)
    return value


def test_printer_columns_and_names() -> None:
    spec = crdgen.crd()["spec"]
    version = spec["versions"][0]
    assert spec["names"]["shortNames"] == ["sis"] and spec["names"]["categories"] == ["splitserve"]
    assert spec["scope"] == "Namespaced" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns)[:5] == ["Mode", "Prefill", "Decode", "Aggregated", "Engine"]
    assert columns["Engine"] == ".spec.runtime.engine"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Age"] == ".metadata.creationTimestamp"
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1]
    assert wide == ["Reason", "Router", "Picker", "Metrics", "Prefill-Scaling", "Decode-Scaling", "Aggregated-Scaling"]
    for name, path in columns.items():
        if name in ("Ready", "Reason", "Metrics", "Age"):
            continue
        node = _schema()
        for part in path.strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == "string", name


def test_committed_crds_are_up_to_date_and_identical() -> None:
    text = crdgen.render()
    for rel in crdgen.OUTPUT_PATHS:
        path = REPO / rel
        assert path.exists(), f"{rel} missing: run make crds"
        assert path.read_text() == text, f"{rel} is stale: run make crds"
    assert (REPO / crdgen.DOC_PATH).exists()
    stale = [str(path) for path, _, _ in crdgen.stale_files(REPO)]
    assert stale == [], "stale: run make crds"


def test_check_mode_reports_stale_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert "+kind: CustomResourceDefinition" in capsys.readouterr().out
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0
    first = tmp_path / crdgen.OUTPUT_PATHS[0]
    first.write_text(first.read_text().replace("maxLength: 1024", "maxLength: 1", 1))
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert "-                    maxLength: 1\n" in capsys.readouterr().out


def test_crd_size_stays_small() -> None:
    # KServe's 2.7 MB CRD breaks client-side apply: `kubectl apply` stores the object as
    # compact JSON in an annotation limited to 256 KiB. Kubernetes' Affinity schema, embedded
    # in each of the three pools, is most of ours; descriptions keep their first sentence.
    # The compact JSON is what that annotation holds; the YAML bound keeps the chart's CRD
    # readable (its Kubernetes descriptions are ~31 KB: trim those before raising it again).
    # Raised once, for the engines (runtime.engine's rules, each pool's extraArgs and
    # scheduling), after the deprecated spec.engine lost its nested descriptions and the
    # reserved-flag messages their owner lists: still half the annotation's limit.
    assert len(json.dumps(crdgen.crd(), separators=(",", ":"))) < 136_000
    assert len(crdgen.render()) < 236_000


def test_capability_messages_stay_within_the_cel_cost_budget() -> None:
    # kube-apiserver refuses a CRD whose messageExpression calls string(int) on these fields
    # ("exceeds budget by factor of more than 100x"); the generator spells the values out.
    text = (REPO / "crds" / "splitserve.dev_inferenceservices.yaml").read_text()
    assert "string(self." not in text
    # every capability is fully supported today, so check the generator on a narrowed one
    narrowed = caps.Capability(name="parallelism.tensor", api_field="tensor", known=(1, 2, 4, 8), supported=(1,))
    rule = caps.cel_rule(narrowed)
    assert "messageExpression" in rule and "string(self." not in rule["messageExpression"]
    assert "'8'" in rule["messageExpression"]
