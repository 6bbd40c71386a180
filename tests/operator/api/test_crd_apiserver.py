"""The generated CRD on a real kube-apiserver: it is accepted (its CEL rules fit the API
server's cost budget, which no offline check estimates), and the rules that guard what the
operator renders refuse hostile entries with the entry's path and our message.

Why here and not only in the e2e suite: a CRD over the budget is refused as a whole, and every
e2e test then fails on the install; this finds it in seconds (a rule over ``runtime.env`` that
filtered the list again for its message was estimated at over 100x the budget). Skips without
the harness' binaries, as the other real-API-server tests do.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import crdgen
import pytest
from autoscaler_testing import BareApiserver, bare_apiserver, create_inference_service
from kubernetes import client as k8s

import splitserve_contract as contract
from splitserve_operator import api

NAMESPACE = "default"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BareApiserver]:
    with bare_apiserver(tmp_path_factory.mktemp("crd-apiserver")) as running:
        k8s.ApiextensionsV1Api(running.api_client).create_custom_resource_definition(crdgen.crd())  # type: ignore[arg-type]  # the client takes the plain dict too
        yield running


def _obj(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mode": "Aggregated",
        "model": {"uri": "hf://org/model"},
        "aggregated": {"resources": {"gpus": 1}},
    }
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {**copy.deepcopy(base), **spec},
    }


@pytest.mark.parametrize(
    ("spec", "path", "words"),
    [
        (
            {"runtime": {"env": [{"name": "FOO", "value": "1"}, {"name": "SPLITSERVE_API_KEY", "value": ""}]}},
            "spec.runtime.env[1].name",
            "runtime.env SPLITSERVE_API_KEY is set by the operator",
        ),
        (
            {"runtime": {"env": [{"name": "HF_ENDPOINT", "value": "file:///etc"}]}},
            "spec.runtime.env[0].name",
            "spec.model.hubEndpoint",
        ),
        (
            {"runtime": {"extraArgs": ["--device", "cpu", "--role=prefill"]}},
            "spec.runtime.extraArgs[2]",
            "extraArgs --role=prefill sets a flag the operator renders",
        ),
        ({"runtime": {"extraArgs": ["--port", "9000"]}}, "spec.runtime.extraArgs[0]", "--port"),
        (
            {"model": {"uri": "hf://org/model", "hubEndpoint": "http://169.254.169.254/latest"}},
            "spec.model.hubEndpoint",
            "link-local",
        ),
        ({"model": {"uri": "hf://org/model", "revision": "../../../../proc/self/environ"}}, "spec.model.revision", ""),
        # Accepted, then failing later (the hostile review): each is now refused with a message.
        (
            {"aggregated": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}},
            "spec.aggregated.tolerations[0]",
            api.TOLERATION_KEY_PATTERN_RULE_MESSAGE,
        ),
        (
            {
                "aggregated": {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
                            }
                        }
                    }
                }
            },
            "spec.aggregated.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
            ".matchExpressions[0]",
            api.SELECTOR_VALUES_RULE_MESSAGE,
        ),
        (
            {
                "aggregated": {
                    "affinity": {
                        "podAntiAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 1,
                                    "podAffinityTerm": {
                                        "topologyKey": "zone",
                                        "labelSelector": {
                                            "matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]
                                        },
                                    },
                                }
                            ]
                        }
                    }
                }
            },
            "spec.aggregated.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
            ".podAffinityTerm.labelSelector.matchExpressions[0]",
            api.SELECTOR_VALUES_RULE_MESSAGE,
        ),
        (
            {
                "aggregated": {
                    "affinity": {
                        "podAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "", "labelSelector": {}}]
                        }
                    }
                }
            },
            "spec.aggregated.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey",
            "at least 1 chars long",
        ),
        ({"runtime": {"extraArgs": ["--seed", "1\u0000"]}}, "spec.runtime.extraArgs[1]", api.ARG_CONTROL_RULE_MESSAGE),
        (
            {"runtime": {"env": [{"name": "FOO", "value": "a\u0000b"}]}},
            "spec.runtime.env[0].value",
            api.ENV_VALUE_CONTROL_RULE_MESSAGE,
        ),
        ({"runtime": {"env": [{"name": "FOO", "value": "x" * 4097}]}}, "spec.runtime.env[0].value", "4096"),
        (
            {"runtime": {"env": [{"name": f"V{i}", "value": "x" * 4096} for i in range(5)]}},
            "spec.runtime.env",
            api.ENV_TOTAL_RULE_MESSAGE,
        ),
        ({"runtime": {"extraArgs": ["x" * 1024] * 9}}, "spec.runtime.extraArgs", api.EXTRA_ARGS_TOTAL_RULE_MESSAGE),
        (
            {"aggregated": {"resources": {"gpus": 1, "memory": "1e30"}}},
            "spec.aggregated.resources.memory",
            "resources.memory must be above 0 and at most 16Ti",
        ),
        (
            {"aggregated": {"resources": {"gpus": 1, "memory": "0"}}},
            "spec.aggregated.resources.memory",
            "resources.memory must be above 0",
        ),
        (
            {"aggregated": {"resources": {"gpus": 1, "cpu": 100000}}},
            "spec.aggregated.resources.cpu",
            "resources.cpu must be above 0 and at most 1024",
        ),
        ({"autoscaling": {"interval": "99999999999999h"}}, "spec.autoscaling.interval", "should match"),
        ({"autoscaling": {"interval": "25h"}}, "spec.autoscaling", api.INTERVAL_RULE_MESSAGE),
        # Accepted and silently ignored: refused with what does not apply.
        ({"router": {"mode": "InferencePool", "replicas": 3}}, "spec", api.ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE),
        (
            {"router": {"mode": "InferencePool", "policy": "RoundRobin"}},
            "spec",
            api.ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE,
        ),
        ({"router": {"prefillOverflowTokens": 512}}, "spec", api.PREFILL_OVERFLOW_AGGREGATED_RULE_MESSAGE),
    ],
)
def test_a_hostile_entry_is_refused_with_its_path(
    server: BareApiserver, spec: dict[str, Any], path: str, words: str
) -> None:
    message = create_inference_service(server, _obj(f"hostile-{abs(hash(path + words)) % 10**8}", **spec))
    assert message is not None and f"{path}:" in message and words in message, message


def test_what_the_user_may_set_is_admitted(server: BareApiserver) -> None:
    assert (
        create_inference_service(
            server,
            _obj(
                "friendly",
                runtime={
                    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
                    "extraArgs": ["--device", "cpu", "--seed", "3", "--roles-are-not-flags"],
                },
                model={
                    "uri": "hf://org/model",
                    "revision": "refs/pr/1",
                    "hubEndpoint": "https://hf-mirror.example.com",
                },
            ),
        )
        is None
    )


def test_what_the_bounds_leave_is_admitted(server: BareApiserver) -> None:
    assert (
        create_inference_service(
            server,
            _obj(
                "bounded",
                aggregated={
                    "resources": {"gpus": 1, "memory": "16Ti", "cpu": "500m"},
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {"key": "zone", "operator": "In", "values": ["a"]},
                                            {"key": "gpu", "operator": "Exists"},
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                    "tolerations": [{"key": "example.com/gpu", "operator": "Exists"}],
                },
                runtime={
                    "env": [
                        {"name": "PEM", "value": "line1\nline2\tend"},
                        *[{"name": f"V{i}", "value": "x" * 4096} for i in range(3)],
                    ],
                    "extraArgs": ["x" * 1024] * 8,
                },
                autoscaling={"interval": "24h"},
                router={"mode": "InferencePool"},
            ),
        )
        is None
    )


def test_mode_cannot_change(server: BareApiserver) -> None:
    # Defect: spec.mode changed on a live object, leaving the old mode's pools behind.
    assert create_inference_service(server, _obj("mode-change")) is None
    objects = k8s.CustomObjectsApi(server.api_client)
    live: dict[str, Any] = objects.get_namespaced_custom_object(  # type: ignore[assignment]
        contract.API_GROUP, contract.API_VERSION, NAMESPACE, contract.PLURAL, "mode-change"
    )
    live["spec"]["mode"] = "Disaggregated"
    live["spec"].pop("aggregated")
    live["spec"]["prefill"] = live["spec"]["decode"] = {"resources": {"gpus": 1}}
    with pytest.raises(k8s.ApiException) as refused:
        objects.replace_namespaced_custom_object(
            contract.API_GROUP, contract.API_VERSION, NAMESPACE, contract.PLURAL, "mode-change", live
        )
    message = str(json.loads(refused.value.body or "{}").get("message"))
    assert refused.value.status == 422 and api.MODE_IMMUTABLE_RULE_MESSAGE in message, message
