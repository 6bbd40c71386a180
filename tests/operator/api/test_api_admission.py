"""Specs the API server used to admit and then failed on later (or ignored): the models refuse
each with the same message the CRD's rule gives (tests/operator/api/test_crd_apiserver.py checks
the CRD side on a real API server), and the bounds keep the spec small enough for kopf, which
keeps the last handled spec in an annotation (256 KiB for all of an object's annotations)."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest

from splitserve_operator import api
from splitserve_operator.api import fields, rules


def _aggregated(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"uri": "hf://org/model"}, "mode": "Aggregated", "aggregated": {}}
    body.update(extra)
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": "InferenceService",
        "metadata": {"name": "demo", "namespace": "ns"},
        "spec": body,
    }


def _errors(obj: dict[str, Any]) -> str:
    with pytest.raises(api.InvalidSpecError) as info:
        api.InferenceService.parse(obj)
    return "\n".join(info.value.errors)


def _node_affinity(requirement: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [requirement]}]
            }
        }
    }


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    (
        "toleration-bad-key",
        {"aggregated": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}},
        api.TOLERATION_KEY_PATTERN_RULE_MESSAGE,
    ),
    (
        "affinity-in-without-values",
        {"aggregated": {"affinity": _node_affinity({"key": "zone", "operator": "In"})}},
        api.SELECTOR_VALUES_RULE_MESSAGE,
    ),
    (
        "affinity-notin-empty-values",
        {"aggregated": {"affinity": _node_affinity({"key": "zone", "operator": "NotIn", "values": []})}},
        api.SELECTOR_VALUES_RULE_MESSAGE,
    ),
    (
        "affinity-exists-with-values",
        {
            "aggregated": {
                "affinity": {
                    "podAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "topologyKey": "zone",
                                "labelSelector": {
                                    "matchExpressions": [{"key": "app", "operator": "DoesNotExist", "values": ["x"]}]
                                },
                            }
                        ]
                    }
                }
            }
        },
        api.SELECTOR_VALUES_RULE_MESSAGE,
    ),
    (
        "affinity-empty-topology-key",
        {
            "aggregated": {
                "affinity": {
                    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": ""}]}
                }
            }
        },
        "topologyKey: should be at least 1 chars long",
    ),
    ("extra-arg-nul", {"runtime": {"extraArgs": ["--seed", "1\x00"]}}, api.ARG_CONTROL_RULE_MESSAGE),
    ("extra-arg-escape", {"runtime": {"extraArgs": ["--seed\x1b[2J"]}}, api.ARG_CONTROL_RULE_MESSAGE),
    ("env-value-nul", {"runtime": {"env": [{"name": "FOO", "value": "a\x00b"}]}}, api.ENV_VALUE_CONTROL_RULE_MESSAGE),
    (
        "env-value-escape",
        {"runtime": {"env": [{"name": "FOO", "value": "\x1b[2J"}]}},
        api.ENV_VALUE_CONTROL_RULE_MESSAGE,
    ),
    ("env-value-too-long", {"runtime": {"env": [{"name": "FOO", "value": "x" * 4097}]}}, "4096"),
    (
        "env-values-total",
        {"runtime": {"env": [{"name": f"V{i}", "value": "x" * 4096} for i in range(5)]}},
        api.ENV_TOTAL_RULE_MESSAGE,
    ),
    ("extra-args-total", {"runtime": {"extraArgs": ["x" * 1024] * 9}}, api.EXTRA_ARGS_TOTAL_RULE_MESSAGE),
    ("too-many-env-vars", {"runtime": {"env": [{"name": f"V{i}", "value": ""} for i in range(33)]}}, "32"),
    (
        "memory-huge",
        {"aggregated": {"resources": {"memory": "1e30"}}},
        "resources.memory must be above 0 and at most 16Ti",
    ),
    ("memory-zero", {"aggregated": {"resources": {"memory": "0"}}}, "resources.memory must be above 0"),
    ("memory-17Ti", {"aggregated": {"resources": {"memory": "17Ti"}}}, "at most 16Ti"),
    ("cpu-zero", {"aggregated": {"resources": {"cpu": "0m"}}}, "resources.cpu must be above 0"),
    ("cpu-huge", {"aggregated": {"resources": {"cpu": 100_000}}}, "resources.cpu must be above 0 and at most 1024"),
    ("interval-overflows", {"autoscaling": {"interval": "99999999999999h"}}, "autoscaling.interval"),
    ("interval-above-a-day", {"autoscaling": {"interval": "25h"}}, api.INTERVAL_RULE_MESSAGE),
    ("ttft-overflows", {"autoscaling": {"slo": {"ttftP99": "99999999999999h", "itlP99": "50ms"}}}, "ttftP99"),
    (
        "inference-pool-router-replicas",
        {"router": {"mode": "InferencePool", "replicas": 3}},
        api.ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE,
    ),
    ("inference-pool-router-policy", {"router": {"mode": "InferencePool", "policy": "RoundRobin"}}, "(set: policy)"),
    (
        "inference-pool-short-prompt-threshold",
        {"router": {"mode": "InferencePool", "shortPromptThreshold": 0}},
        "(set: shortPromptThreshold)",
    ),
    (
        "aggregated-prefill-overflow",
        {"router": {"prefillOverflowTokens": 512}},
        api.PREFILL_OVERFLOW_AGGREGATED_RULE_MESSAGE,
    ),
]


@pytest.mark.parametrize(("patch", "words"), [(p, w) for _, p, w in HOSTILE], ids=[i for i, _, _ in HOSTILE])
def test_hostile_specs_are_refused_with_a_message(patch: dict[str, Any], words: str) -> None:
    assert words in _errors(_aggregated(**patch))


def test_what_the_bounds_leave_parses() -> None:
    obj = _aggregated(
        aggregated={
            "resources": {"memory": "16Ti", "cpu": "500m"},
            "affinity": _node_affinity({"key": "zone", "operator": "Exists"}),
            "tolerations": [{"key": "example.com/gpu", "operator": "Exists"}, {"operator": "Exists"}],
        },
        runtime={"env": [{"name": "PEM", "value": "line1\nline2\tend\r"}], "extraArgs": ["--seed", "3"]},
        autoscaling={"interval": "24h", "slo": {"ttftP99": "1.5s", "itlP99": "99999ms"}},
        router={"mode": "InferencePool", "inferencePool": {"failureMode": "FailOpen"}},
    )
    api.InferenceService.parse(obj)
    api.InferenceService.parse({**obj, "spec": {**obj["spec"], "router": {"prefillOverflowTokens": 0}}})


def test_router_builtin_defaults_are_the_models() -> None:
    # The CEL rule compares against ROUTER_BUILTIN_DEFAULTS: a changed model default would
    # refuse every InferencePool object that leaves the field out.
    dumped = api.RouterSpec().dump()
    assert {k: dumped[k] for k in api.ROUTER_BUILTIN_DEFAULTS} == api.ROUTER_BUILTIN_DEFAULTS


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("16Gi", Decimal(16 * 2**30)),
        ("500m", Decimal("0.5")),
        ("1e3", Decimal(1000)),
        ("+2", Decimal(2)),
        ("1.5k", Decimal(1500)),
        (".5", Decimal("0.5")),
        ("1E-3", Decimal("0.001")),
        ("16Ti", Decimal(16 * 2**40)),
    ],
)
def test_parse_quantity(text: str, value: Decimal) -> None:
    assert fields.parse_quantity(text) == value


def test_durations_fit_go_and_cel() -> None:
    # "99999999999999h" matched the old pattern and overflowed CEL's duration: a type
    # conversion error at admission instead of a message.
    longest = "99999h" * 5 + "9s"
    assert len(longest) <= 32 and api.parse_duration_seconds(longest) < 290 * 365 * 86_400
    with pytest.raises(ValueError):
        api.parse_duration_seconds("99999999999999h")


def test_runtime_worst_case_fits_the_annotation_budget() -> None:
    # runtime.env once admitted 64 values of 32 KiB (2 MiB): kopf's last-handled annotation
    # could never be written and the object failed forever.
    values = rules.MAX_ENV_VALUES_TOTAL // rules.MAX_ENV_VARS
    runtime = {
        "env": [{"name": "V" * 250 + f"{i:02}", "value": "x" * values} for i in range(rules.MAX_ENV_VARS)],
        "extraArgs": ["x" * (rules.MAX_EXTRA_ARGS_TOTAL // rules.MAX_EXTRA_ARGS)] * rules.MAX_EXTRA_ARGS,
    }
    parsed = api.InferenceService.parse(_aggregated(runtime=runtime))
    assert len(json.dumps(parsed.spec.dump()["runtime"])) < 40 * 1024
    assert rules.MAX_ENV_VALUE_LENGTH <= rules.MAX_ENV_VALUES_TOTAL
