"""Hostile InferenceService manifests against the real API server and the chart's operator.

Issue 12 (operator defects 11-14): every manifest here either fails ``kubectl apply`` at once
with the field path and our message (admission: the CRD's structural schema, Kubernetes' own
core/v1 schemas for the pod fields, CEL rules), or is admitted and then shows what is wrong
in its status conditions (kstatus ``Stalled=True`` with a reason): a child the API server
refuses for good (``InvalidSpec``, not retried), pods that cannot be created
(``FailedCreate``: a missing PriorityClass), GPUs the cluster does not have, pods that cannot
be configured or keep crashing, pods the scheduler cannot place for another cause
(``Unschedulable`` with the scheduler's words: memory, a nodeSelector, a missing claim).

One operator release (namespace scope, a container on the kubelet node) serves the module;
admission cases need only the CRD. Status cases run one at a time and delete what they made.
Pools of the status cases run on kwok GPU nodes (nothing executes) unless the case needs a
real container, which runs on the kubelet node.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import corev1gen
import pytest

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import condition, get_isvc, pod_summary
from splitserve_e2e.kwok import KWOK_NODE_LABEL, KWOK_NODE_LABEL_VALUE, kwok_toleration
from splitserve_e2e.stack import ISVC_PLURAL, MODEL_NAME, POOL_CPU, ModelHub, operator_namespace
from splitserve_operator import api
from splitserve_operator.api import rules
from splitserve_operator.api.corev1 import SNAPSHOT

pytestmark = pytest.mark.e2e

STATUS_TIMEOUT_SECONDS = 120.0
QUIET_SECONDS = 6.0
"""How long the "not retried" check watches (child events and kopf resumes happen within it)."""


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ns(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    """A namespace with the CRD applied, the hub's token Secret, and one operator installed
    by the chart."""
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="hostile") as name:
        yield name


def _minimal(name: str = "hostile") -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": contract.KIND,
        "metadata": {"name": name},
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


def _prefill(**pool: Any) -> dict[str, Any]:
    return {"spec": {"prefill": pool}}


def _runtime_env(name: str, value: str) -> dict[str, Any]:
    return {"spec": {"runtime": {"env": [{"name": name, "value": value}]}}}


def _hub(endpoint: str) -> dict[str, Any]:
    return {"spec": {"model": {"uri": "hf://org/model", "hubEndpoint": endpoint}}}


# --------------------------------------------------------------------------- admission
# (id, patch onto the minimal object, what the refusal must say: every str, or one of a tuple)
ADMISSION_CASES: list[tuple[str, dict[str, Any], list[str | tuple[str, ...]]]] = [
    # issue 12 #11: pod fields checked with Kubernetes' own schemas
    (
        "toleration-unknown-field",
        _prefill(tolerations=[{"foo": "bar"}]),
        ['unknown field "spec.prefill.tolerations[0].foo"'],
    ),
    (
        "toleration-empty",
        _prefill(tolerations=[{}]),
        ["spec.prefill.tolerations[0]", rules.TOLERATION_KEY_RULE_MESSAGE],
    ),
    (
        "toleration-exists-with-value",
        _prefill(tolerations=[{"key": "a", "operator": "Exists", "value": "b"}]),
        ["spec.prefill.tolerations[0]", rules.TOLERATION_VALUE_RULE_MESSAGE],
    ),
    (
        "toleration-seconds-without-noexecute",
        _prefill(tolerations=[{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]),
        ["spec.prefill.tolerations[0]", rules.TOLERATION_SECONDS_RULE_MESSAGE],
    ),
    (
        "toleration-bad-effect",
        _prefill(tolerations=[{"key": "a", "effect": "Sometimes"}]),
        ['spec.prefill.tolerations[0].effect: Unsupported value: "Sometimes"'],
    ),
    (
        "toleration-bad-operator",
        _prefill(tolerations=[{"key": "a", "operator": "Like"}]),
        ['spec.prefill.tolerations[0].operator: Unsupported value: "Like"'],
    ),
    (
        "toleration-seconds-not-a-number",
        _prefill(tolerations=[{"key": "a", "effect": "NoExecute", "tolerationSeconds": "forever"}]),
        ["spec.prefill.tolerations[0].tolerationSeconds", "integer"],
    ),
    ("tolerations-not-a-list", _prefill(tolerations="NoSchedule"), ["spec.prefill.tolerations", "array"]),
    (
        "too-many-tolerations",
        _prefill(tolerations=[{"key": f"k{i}", "operator": "Exists"} for i in range(33)]),
        ["spec.prefill.tolerations", "Too many"],
    ),
    (
        "affinity-garbage",
        _prefill(affinity={"nodeAffinity": "garbage"}),
        ["spec.prefill.affinity.nodeAffinity", "must be of type object"],
    ),
    (
        "affinity-unknown-field",
        _prefill(affinity={"podAffinity": {"foo": 1}}),
        ['unknown field "spec.prefill.affinity.podAffinity.foo"'],
    ),
    (
        "affinity-missing-topology-key",
        _prefill(
            affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}}
        ),
        [
            "spec.prefill.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey: Required value"
        ],
    ),
    (
        "affinity-missing-node-selector-terms",
        _prefill(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}),
        [
            "spec.prefill.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms: Required value"
        ],
    ),
    (
        "affinity-bad-node-operator",
        _prefill(
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "Near"}]}]
                    }
                }
            }
        ),
        ['matchExpressions[0].operator: Unsupported value: "Near"'],
    ),
    (
        "affinity-weight-not-a-number",
        _prefill(
            affinity={
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": "heavy", "preference": {}}]
                }
            }
        ),
        ["spec.prefill.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight", "integer"],
    ),
    ("memory-negative", _prefill(resources={"memory": "-1Gi"}), ["spec.prefill.resources.memory", '"-1Gi"']),
    (
        "cpu-negative-integer",
        _prefill(resources={"cpu": -1}),
        ["spec.prefill.resources.cpu", "greater than or equal to 0"],
    ),
    ("memory-not-a-quantity", _prefill(resources={"memory": "lots"}), ["spec.prefill.resources.memory"]),
    (
        "node-selector-bad-key",
        _prefill(nodeSelector={"bad key!": "x"}),
        ["spec.prefill.nodeSelector", rules.NODE_SELECTOR_RULE_MESSAGE],
    ),
    (
        "node-selector-bad-value",
        _prefill(nodeSelector={"zone": "not a label value"}),
        ["spec.prefill.nodeSelector.zone"],
    ),
    ("priority-class-bad-name", _prefill(priorityClassName="Not_Valid"), ["spec.prefill.priorityClassName"]),
    ("too-many-gpus", _prefill(resources={"gpus": rules.MAX_REPLICA_GPUS + 1}), ["spec.prefill.resources.gpus"]),
    # issue 12 #14
    ("autoscaling-interval-zero", {"spec": {"autoscaling": {"interval": "0s"}}}, [rules.INTERVAL_RULE_MESSAGE]),
    (
        "autoscaling-interval-not-a-duration",
        {"spec": {"autoscaling": {"interval": "fast"}}},
        ["spec.autoscaling.interval"],
    ),
    # a prior of 1e308 made every status patch carry Infinity
    (
        "slo-prior-huge",
        {
            "spec": {
                "autoscaling": {
                    "slo": {
                        "ttftP99": "2s",
                        "itlP99": "100ms",
                        "prior": {
                            "step": 1e308,
                            "prefillToken": 0,
                            "prefillPair": 0,
                            "decodeRow": 0,
                            "decodeContext": 0,
                        },
                    }
                }
            }
        },
        ["spec.autoscaling.slo.prior.step"],
    ),
    # the rest of the API
    ("replicas-min-above-max", _prefill(replicas={"min": 3, "max": 2}), [rules.REPLICAS_RULE_MESSAGE]),
    ("aggregated-with-pools", {"spec": {"mode": "Aggregated"}}, [rules.AGGREGATED_RULE_MESSAGE]),
    ("disaggregated-with-aggregated", {"spec": {"aggregated": {}}}, [rules.DISAGGREGATED_RULE_MESSAGE]),
    ("model-uri-scheme", {"spec": {"model": {"uri": "s3://bucket/model"}}}, ["spec.model.uri"]),
    (
        "speculative-draft-without-model",
        {"spec": {"scheduling": {"speculative": {"method": "draft"}}}},
        [rules.DRAFT_METHOD_RULE_MESSAGE],
    ),
    (
        "draft-model-with-tensor-parallel-decode",
        {
            "spec": {
                "decode": {"resources": {"gpus": 2}, "parallelism": {"tensor": 2}},
                "scheduling": {"speculative": {"method": "draft", "draftModel": "hf://org/draft"}},
            }
        },
        [rules.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE],
    ),
    ("gpu-budget-below-minimum", {"spec": {"autoscaling": {"gpuBudget": 1}}}, [rules.GPU_BUDGET_RULE_MESSAGE]),
    ("name-too-long", {"metadata": {"name": "x" * 41}}, [rules.NAME_LENGTH_RULE_MESSAGE]),
    ("name-with-dots", {"metadata": {"name": "a.b"}}, [rules.NAME_PATTERN_RULE_MESSAGE]),
    ("kv-memory-fraction", {"spec": {"kvCache": {"memoryFraction": 0.99}}}, ["spec.kvCache.memoryFraction"]),
    ("kv-block-size", {"spec": {"kvCache": {"blockSize": 24}}}, ["spec.kvCache.blockSize"]),
    ("unknown-spec-field", {"spec": {"replicas": 3}}, ['unknown field "spec.replicas"']),
    ("env-bad-name", {"spec": {"runtime": {"env": [{"name": "1 BAD=", "value": "x"}]}}}, ["spec.runtime.env[0].name"]),
    (
        "image-with-whitespace",
        {"spec": {"runtime": {"image": " registry.example/splitserve:1"}}},
        ["spec.runtime.image"],
    ),
    (
        "image-pull-policy",
        {"spec": {"runtime": {"imagePullPolicy": "Sometimes"}}},
        ['spec.runtime.imagePullPolicy: Unsupported value: "Sometimes"'],
    ),
    ("hub-endpoint-not-http", {"spec": {"model": {"hubEndpoint": "ftp://mirror.example"}}}, ["spec.model.hubEndpoint"]),
    (
        "api-key-ref-without-key",
        {"spec": {"runtime": {"apiKeySecretRef": {"name": "keys"}}}},
        ["spec.runtime.apiKeySecretRef.key: Required value"],
    ),
    ("extra-arg-too-long", {"spec": {"runtime": {"extraArgs": ["x" * 1025]}}}, ["spec.runtime.extraArgs[0]"]),
    ("router-replicas-zero", {"spec": {"router": {"replicas": 0}}}, ["spec.router.replicas"]),
    # what the operator renders is not the author's to set again: an empty SPLITSERVE_API_KEY
    # switched the key off, HF_ENDPOINT/HF_TOKEN sent the token elsewhere, --role re-roled a pod
    (
        "env-empty-api-key",
        _runtime_env("SPLITSERVE_API_KEY", ""),
        ["spec.runtime.env", "runtime.env SPLITSERVE_API_KEY is set by the operator", "spec.runtime.apiKeySecretRef"],
    ),
    (
        "env-hub-endpoint",
        _runtime_env("HF_ENDPOINT", "file:///etc"),
        ["spec.runtime.env", "runtime.env HF_ENDPOINT is set by the operator", "spec.model.hubEndpoint"],
    ),
    ("env-hub-token", _runtime_env("HF_TOKEN", "hf_x"), ["runtime.env HF_TOKEN is set by the operator"]),
    (
        "env-reserved-prefix",
        _runtime_env("SPLITSERVE_TERMINATION_LOG", "/tmp/x"),
        ["runtime.env SPLITSERVE_TERMINATION_LOG is set by the operator"],
    ),
    (
        "extra-arg-role",
        {"spec": {"runtime": {"extraArgs": ["--device", "cpu", "--role", "decode"]}}},
        ["spec.runtime.extraArgs", "extraArgs --role sets a flag the operator renders"],
    ),
    (
        "extra-arg-compat-hash-equals",
        {"spec": {"runtime": {"extraArgs": ["--compat-hash=forged"]}}},
        ["extraArgs --compat-hash=forged sets a flag the operator renders"],
    ),
    (
        "extra-arg-port-equals",
        {"spec": {"runtime": {"extraArgs": ["--port=9000"]}}},
        ["extraArgs --port=9000 sets a flag the operator renders"],
    ),
    (
        "extra-arg-no-prefill-headers",
        {"spec": {"runtime": {"extraArgs": ["--no-prefill-headers"]}}},
        ["extraArgs --no-prefill-headers sets a flag"],
    ),
    # hubEndpoint gets the hub token (any key of any Secret of the namespace)
    (
        "hub-endpoint-metadata-service",
        _hub("http://169.254.169.254/latest/meta-data"),
        ["spec.model.hubEndpoint", rules.HUB_ENDPOINT_HOST_RULE_MESSAGE],
    ),
    ("hub-endpoint-kubernetes-api", _hub("https://kubernetes.default.svc"), [rules.HUB_ENDPOINT_HOST_RULE_MESSAGE]),
    (
        "hub-endpoint-cluster-service",
        _hub("http://hub.other-ns.svc.cluster.local:8080"),
        [rules.HUB_ENDPOINT_HOST_RULE_MESSAGE],
    ),
    ("hub-endpoint-loopback-v6", _hub("http://[::1]:8080"), [rules.HUB_ENDPOINT_HOST_RULE_MESSAGE]),
    ("hub-endpoint-octal-ip", _hub("http://0251.0376.0251.0376"), [rules.HUB_ENDPOINT_HOST_RULE_MESSAGE]),
    ("hub-endpoint-port-out-of-range", _hub("https://hub.example:99999"), [rules.HUB_ENDPOINT_AUTHORITY_RULE_MESSAGE]),
    ("hub-endpoint-userinfo", _hub("https://user:pw@hub.example"), ["spec.model.hubEndpoint"]),
    ("hub-endpoint-nul", _hub("https://hub.example/a\u0000b"), ["spec.model.hubEndpoint"]),
    ("hub-endpoint-ansi-escape", _hub("https://hub.example/\u001b[31mred"), ["spec.model.hubEndpoint"]),
    # a revision or a path is read as a file path: nothing that climbs out
    (
        "revision-dot-dot",
        {"spec": {"model": {"uri": "hf://org/model", "revision": "../../../../proc/self/environ"}}},
        ["spec.model.revision"],
    ),
    (
        "revision-absolute",
        {"spec": {"model": {"uri": "hf://org/model", "revision": "/etc/passwd"}}},
        ["spec.model.revision"],
    ),
    ("model-uri-pvc-traversal", {"spec": {"model": {"uri": "pvc://claim/../.."}}}, ["spec.model.uri"]),
    ("model-uri-file-control-character", {"spec": {"model": {"uri": "file:///models/a\u0007b"}}}, ["spec.model.uri"]),
    ("session-header", {"spec": {"router": {"sessionHeader": "x session"}}}, ["spec.router.sessionHeader"]),
    # admitted, then failing when the Deployment is applied or the pod starts
    (
        "toleration-bad-key",
        _prefill(tolerations=[{"key": "bad key!", "operator": "Exists"}]),
        ["spec.prefill.tolerations[0]", rules.TOLERATION_KEY_PATTERN_RULE_MESSAGE],
    ),
    (
        "affinity-in-without-values",
        _prefill(
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
                    }
                }
            }
        ),
        ["nodeSelectorTerms[0].matchExpressions[0]", rules.SELECTOR_VALUES_RULE_MESSAGE],
    ),
    (
        "affinity-exists-with-values",
        _prefill(
            affinity={
                "podAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "topologyKey": "zone",
                            "labelSelector": {
                                "matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]
                            },
                        }
                    ]
                }
            }
        ),
        ["labelSelector.matchExpressions[0]", rules.SELECTOR_VALUES_RULE_MESSAGE],
    ),
    (
        "affinity-empty-topology-key",
        _prefill(
            affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": ""}]}}
        ),
        ["requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey", "at least 1 chars long"],
    ),
    (
        "extra-arg-nul",
        {"spec": {"runtime": {"extraArgs": ["--seed", "1\u0000"]}}},
        ["spec.runtime.extraArgs[1]", rules.ARG_CONTROL_RULE_MESSAGE],
    ),
    (
        "env-value-nul",
        _runtime_env("FOO", "a\u0000b"),
        ["spec.runtime.env[0].value", rules.ENV_VALUE_CONTROL_RULE_MESSAGE],
    ),
    ("env-value-too-long", _runtime_env("FOO", "x" * 4097), ["spec.runtime.env[0].value"]),
    (
        "env-values-total",
        {"spec": {"runtime": {"env": [{"name": f"V{i}", "value": "x" * 4096} for i in range(5)]}}},
        ["spec.runtime.env", rules.ENV_TOTAL_RULE_MESSAGE],
    ),
    ("memory-huge", _prefill(resources={"memory": "1e30"}), ["spec.prefill.resources.memory", "at most 16Ti"]),
    ("memory-zero", _prefill(resources={"memory": "0"}), ["spec.prefill.resources.memory", "must be above 0"]),
    ("cpu-huge", _prefill(resources={"cpu": 100000}), ["spec.prefill.resources.cpu", "at most 1024"]),
    (
        "autoscaling-interval-overflows",
        {"spec": {"autoscaling": {"interval": "99999999999999h"}}},
        ["spec.autoscaling.interval"],
    ),
    ("autoscaling-interval-above-a-day", {"spec": {"autoscaling": {"interval": "25h"}}}, [rules.INTERVAL_RULE_MESSAGE]),
    # admitted and silently ignored
    (
        "inference-pool-router-replicas",
        {"spec": {"router": {"mode": "InferencePool", "replicas": 3}}},
        [rules.ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE],
    ),
    (
        "inference-pool-router-policy",
        {"spec": {"router": {"mode": "InferencePool", "policy": "RoundRobin"}}},
        [rules.ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE],
    ),
    (
        "aggregated-prefill-overflow",
        {"spec": {"mode": "Aggregated", "aggregated": {}, "router": {"prefillOverflowTokens": 512}}},
        [rules.PREFILL_OVERFLOW_AGGREGATED_RULE_MESSAGE],
    ),
]


@pytest.mark.parametrize(
    ("patch", "expected"), [(p, e) for _, p, e in ADMISSION_CASES], ids=[case_id for case_id, _, _ in ADMISSION_CASES]
)
def test_refused_at_admission_with_the_field_path(
    cluster: LocalCluster, ns: str, patch: dict[str, Any], expected: list[str | tuple[str, ...]]
) -> None:
    obj = _merge(_minimal(), patch)
    obj["metadata"]["namespace"] = ns
    result = cluster.kubectl("apply", "-f", "-", input_text=json.dumps(obj), check=False)
    if result.returncode == 0:  # leave nothing behind for the other cases
        cluster.kubectl("delete", ISVC_PLURAL, obj["metadata"]["name"], "-n", ns, "--wait=false", check=False)
    assert result.returncode != 0, f"accepted: {json.dumps(obj)}"
    for words in expected:
        choices = (words,) if isinstance(words, str) else words
        assert any(w in result.stderr for w in choices), f"{choices} not in: {result.stderr}"
    # The models refuse it too: an object that slipped past an older CRD is never acted on.
    with pytest.raises(api.InvalidSpecError):
        api.InferenceService.parse(obj)


def test_the_embedded_core_v1_schemas_are_this_api_servers(cluster: LocalCluster) -> None:
    served = json.loads(cluster.kubectl("get", "--raw", "/openapi/v3/api/v1").stdout)
    assert corev1gen.extract(served) == SNAPSHOT, "refresh: python operator/tools/corev1gen.py"


# --------------------------------------------------------------------------- status
def _kwok_pool(**extra: Any) -> dict[str, Any]:
    return {
        "replicas": {"min": 1, "max": 1},
        "resources": {"gpus": 1},
        "tolerations": [kwok_toleration()],
        "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE},
        **extra,
    }


def _node_pool(**extra: Any) -> dict[str, Any]:
    """A CPU pool: its pods run on the kubelet node (the kwok nodes are tainted)."""
    return {"replicas": {"min": 1, "max": 1}, "resources": {"gpus": 0, "cpu": POOL_CPU}, **extra}


def _admitted(
    name: str, ns: str, hub: ModelHub, *, pools: dict[str, Any], runtime: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A manifest the API server admits: the tiny model from the hub (the router really
    loads its tokenizer on the kubelet node), autoscaling off, and ``pools``."""
    mode = "Aggregated" if "aggregated" in pools else "Disaggregated"
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
            "runtime": {"extraArgs": ["--device", "cpu", "--num-kv-blocks", "64"], **(runtime or {})},
            "mode": mode,
            **pools,
            "autoscaling": {"enabled": False},
        },
    }


def _label_selector_with_bad_key() -> dict[str, Any]:
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"bad key!": "x"}}}
            ]
        }
    }


@dataclass(frozen=True)
class StatusCase:
    """A manifest the API server admits and the condition it must end up with."""

    id: str
    pools: dict[str, Any]
    reason: str
    message: tuple[str, ...]
    runtime: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    """Replaces spec.model when set."""
    absent: tuple[str, ...] = ()
    """Words the message must not hold."""


STATUS_CASES = [
    # issue 12 #13: child failures propagate (kstatus), with the child's reason and message
    StatusCase(
        "priority-class-missing",
        {"prefill": _kwok_pool(priorityClassName="does-not-exist"), "decode": _kwok_pool()},
        Reason.FAILED_CREATE,
        ("Deployment", "-prefill", "no PriorityClass with name does-not-exist"),
    ),
    StatusCase(
        "gpus-beyond-the-cluster",  # two kwok nodes of 8 GPUs: three 8-GPU pods do not fit
        {"prefill": _kwok_pool(), "decode": _kwok_pool(replicas={"min": 3, "max": 3}, resources={"gpus": 8})},
        Reason.INSUFFICIENT_GPU_CAPACITY,
        ("nvidia.com/gpu",),
    ),
    StatusCase(
        "api-key-secret-missing",
        {"aggregated": _node_pool()},
        Reason.CREATE_CONTAINER_CONFIG_ERROR,
        ('secret "no-such-secret" not found',),
        runtime={"apiKeySecretRef": {"name": "no-such-secret", "key": "key"}},
    ),
    StatusCase(
        "runtime-crash-loop",
        {"aggregated": _node_pool()},
        Reason.POD_START_FAILED,
        ("exited with code", "--no-such-flag"),
        runtime={"extraArgs": ["--device", "cpu", "--no-such-flag"]},
    ),
    # issue 12 #12: admitted, but the API server refuses the Deployment for good
    # (an `In` term without values and a toleration key that is no label key were here: both are
    # refused at admission now, see the admission cases)
    StatusCase(
        "label-selector-bad-key",
        {"prefill": _kwok_pool(), "decode": _kwok_pool(affinity=_label_selector_with_bad_key())},
        Reason.INVALID_SPEC,
        ("Deployment/", "-decode", "bad key!"),
    ),
    # hostile review: a pod the scheduler cannot place for another cause than GPUs is Stalled
    # with the scheduler's words (not InsufficientGPUCapacity, not an endless rollout)
    StatusCase(
        "memory-beyond-the-nodes",  # the kwok nodes have 1024Gi each, and GPUs to spare
        {"prefill": _kwok_pool(resources={"gpus": 1, "memory": "15Ti"}), "decode": _kwok_pool()},
        Reason.UNSCHEDULABLE,
        ("pod ", "-prefill-", "Insufficient memory"),
        absent=("nvidia.com/gpu",),
    ),
    StatusCase(
        "node-selector-matching-nothing",
        {
            "prefill": _kwok_pool(),
            "decode": _kwok_pool(nodeSelector={KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE, "no-such-label": "x"}),
        },
        Reason.UNSCHEDULABLE,
        ("-decode-", "didn't match Pod's node affinity/selector"),
    ),
    StatusCase(
        "model-claim-missing",
        {"prefill": _kwok_pool(), "decode": _kwok_pool()},
        Reason.UNSCHEDULABLE,
        ('persistentvolumeclaim "no-such-claim" not found',),
        model={"uri": "pvc://no-such-claim/model", "dtype": "float32", "maxModelLen": 1024},
    ),
]


def _stalled_for(
    cluster: LocalCluster, ns: str, name: str, reason: str, words: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    obj = get_isvc(cluster=cluster, namespace=ns, name=name)
    stalled = condition(obj, ConditionType.STALLED) or {}
    if (
        stalled.get("reason") == reason
        and stalled.get("observedGeneration") == obj["metadata"]["generation"]
        and all(w in str(stalled.get("message", "")) for w in words)
    ):
        return obj
    return None


def _wait_stalled(
    cluster: LocalCluster, ns: str, name: str, reason: str, words: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The InferenceService once Stalled with ``reason`` and a message holding ``words``.

    Why wait for the words too: the operator relays the kubelet's own words, and the kubelet's
    first attempt may fail for a passing cause on a loaded node (``failed to sync secret cache:
    timed out waiting for the condition``) before a retry names the real one (``secret ... not
    found``); the relayed message follows the pod's."""
    try:
        obj = cluster.wait_for(
            lambda: _stalled_for(cluster, ns, name, reason, words),
            timeout_seconds=STATUS_TIMEOUT_SECONDS,
            interval_seconds=1.0,
            what=f"{name}: Stalled/{reason}",
        )
    except TimeoutError as error:
        status = (get_isvc(cluster=cluster, namespace=ns, name=name).get("status") or {}).get("conditions")
        raise TimeoutError(
            f"{error}\nconditions: {json.dumps(status)}\npods: {pod_summary(cluster=cluster, namespace=ns)}"
        ) from None
    assert obj is not None
    return obj


def _warnings(cluster: LocalCluster, ns: str, name: str, reason: str) -> int:
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
    return sum(int(e.get("count") or 1) for e in json.loads(result.stdout)["items"] if e.get("type") == "Warning")


def _delete(cluster: LocalCluster, ns: str, name: str) -> None:
    """Delete and wait (bounded) for its pods to go, so the kubelet node is free for the next case."""
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


def _apply(cluster: LocalCluster, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "--server-side", "-f", "-", input_text=json.dumps(obj))


@pytest.mark.parametrize("case", STATUS_CASES, ids=[c.id for c in STATUS_CASES])
def test_admitted_but_hopeless_is_stalled_with_the_reason(
    cluster: LocalCluster, ns: str, model_hub: ModelHub, case: StatusCase
) -> None:
    name = f"h-{case.id[:24].strip('-')}-{uuid.uuid4().hex[:4]}"
    try:
        manifest = _admitted(name, ns, model_hub, pools=case.pools, runtime=case.runtime)
        if case.model:
            manifest["spec"]["model"] = case.model
        _apply(cluster, manifest)  # admitted
        obj = _wait_stalled(cluster, ns, name, case.reason, case.message)
        stalled = condition(obj, ConditionType.STALLED) or {}
        assert stalled["status"] == "True"
        for words in case.message:
            assert words in stalled["message"], stalled
        for words in case.absent:
            assert words not in stalled["message"], stalled
        # kstatus: a stalled object is not also "reconciling" (Flux, kubectl wait, Argo CD).
        reconciling = condition(obj, ConditionType.RECONCILING) or {}
        assert reconciling.get("status") == "False", reconciling
        ready = condition(obj, ConditionType.READY) or {}
        assert (ready.get("status"), ready.get("reason")) == ("False", case.reason)
        cluster.wait_for(
            lambda: _warnings(cluster, ns, name, case.reason) >= 1,
            timeout_seconds=20,
            what=f"a {case.reason} Warning Event",
        )
        cluster.kubectl("wait", f"{ISVC_PLURAL}/{name}", "-n", ns, "--for=condition=Stalled", "--timeout=10s")
    finally:
        _delete(cluster, ns, name)


def test_hub_off_the_operators_list_is_stalled_and_nothing_is_rendered(
    cluster: LocalCluster, ns: str, model_hub: ModelHub
) -> None:
    """The chart's hub.allowedEndpoints (the harness allows huggingface.co and its own hubs):
    an endpoint the CRD admits but the operator does not serve is Stalled/InvalidSpec naming
    it, and no child is created, so the hub token is never sent there."""
    name = f"h-hub-{uuid.uuid4().hex[:4]}"
    manifest = _admitted(name, ns, model_hub, pools={"prefill": _kwok_pool(), "decode": _kwok_pool()})
    manifest["spec"]["model"]["hubEndpoint"] = "https://hub.not-allowed.example"
    try:
        _apply(cluster, manifest)
        _wait_stalled(
            cluster,
            ns,
            name,
            Reason.INVALID_SPEC,
            ("https://hub.not-allowed.example is not on this operator's list of allowed hubs",),
        )
        for kind in ("deployment", "configmap", "service"):
            listed = json.loads(
                cluster.kubectl("get", kind, "-n", ns, "-l", f"{contract.LABEL_INSTANCE}={name}", "-o", "json").stdout
            )["items"]
            assert listed == [], (kind, [o["metadata"]["name"] for o in listed])
    finally:
        _delete(cluster, ns, name)


def test_invalid_spec_is_not_retried_until_the_spec_changes(
    cluster: LocalCluster, ns: str, model_hub: ModelHub
) -> None:
    """Issue 12 #12: no back-off loop (an Event every few minutes, Reconciling=True forever);
    the next generation is applied at once."""
    name = f"h-retry-{uuid.uuid4().hex[:4]}"
    pools = {"prefill": _kwok_pool(affinity=_label_selector_with_bad_key()), "decode": _kwok_pool()}
    manifest = _admitted(name, ns, model_hub, pools=pools)
    try:
        _apply(cluster, manifest)
        first = _wait_stalled(cluster, ns, name, Reason.INVALID_SPEC)
        stalled = condition(first, ConditionType.STALLED) or {}
        cluster.wait_for(
            lambda: _warnings(cluster, ns, name, Reason.INVALID_SPEC) >= 1,
            timeout_seconds=20,
            what="the InvalidSpec Warning Event",
        )
        # Child events (the decode Deployment's status, kwok's pods) keep arriving meanwhile.
        time.sleep(QUIET_SECONDS)  # nothing to wait for: the behaviour under test is "nothing happens"
        later = get_isvc(cluster=cluster, namespace=ns, name=name)
        assert condition(later, ConditionType.STALLED) == stalled
        assert _warnings(cluster, ns, name, Reason.INVALID_SPEC) == 1
        # The user fixes the spec: a new generation, applied and no longer stalled.
        fixed = _admitted(name, ns, model_hub, pools={"prefill": _kwok_pool(), "decode": _kwok_pool()})
        _apply(cluster, fixed)
        generation = get_isvc(cluster=cluster, namespace=ns, name=name)["metadata"]["generation"]
        assert generation > first["metadata"]["generation"]

        def recovered() -> dict[str, Any] | None:
            obj = get_isvc(cluster=cluster, namespace=ns, name=name)
            cond = condition(obj, ConditionType.STALLED) or {}
            return obj if cond.get("observedGeneration") == generation and cond.get("status") == "False" else None

        cluster.wait_for(recovered, timeout_seconds=STATUS_TIMEOUT_SECONDS, what=f"{name} not stalled at {generation}")
        deployment = json.loads(cluster.kubectl("get", "deployment", f"{name}-prefill", "-n", ns, "-o", "json").stdout)
        assert "affinity" not in deployment["spec"]["template"]["spec"]
    finally:
        _delete(cluster, ns, name)


def test_disaggregated_service_gets_its_handoff_key_secret(cluster: LocalCluster, ns: str, model_hub: ModelHub) -> None:
    """Issue 12 #4 (operator side): created once, owned, never rotated; mounted by prefill and
    decode only. The operator may create, list and watch Secrets (it asks for metadata only),
    never get one (its RBAC)."""
    name = f"h-key-{uuid.uuid4().hex[:4]}"
    manifest = _admitted(name, ns, model_hub, pools={"prefill": _kwok_pool(), "decode": _kwok_pool()})
    secret_name = f"{name}{contract.HANDOFF_KEY_SECRET_SUFFIX}"
    try:
        _apply(cluster, manifest)
        secret = cluster.wait_for(
            lambda: _get_json(cluster, ns, "secret", secret_name), timeout_seconds=60, what=f"Secret {secret_name}"
        )
        uid = get_isvc(cluster=cluster, namespace=ns, name=name)["metadata"]["uid"]
        assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [uid]
        assert secret["immutable"] is True and len(secret["data"][contract.HANDOFF_KEY_SECRET_KEY]) == 44
        for role in ("prefill", "decode", "router"):
            dep = cluster.wait_for(
                functools.partial(_get_json, cluster, ns, "deployment", f"{name}-{role}"),
                timeout_seconds=60,
                what=f"{role} Deployment",
            )
            volumes = [v.get("secret", {}).get("secretName") for v in dep["spec"]["template"]["spec"]["volumes"]]
            assert (secret_name in volumes) == (role != "router"), (role, volumes)
        # A spec change reconciles again; the key stays the same.
        _apply(cluster, _merge(manifest, {"spec": {"scheduling": {"maxNumSeqs": 32}}}))
        cluster.wait_for(lambda: _observed(cluster, ns, name), timeout_seconds=60, what="the new generation observed")
        again = _get_json(cluster, ns, "secret", secret_name)
        assert again is not None and again["data"] == secret["data"]
        operator_sa = f"system:serviceaccount:{ns}:splitserve"
        can = {
            verb: cluster.kubectl(
                "auth", "can-i", verb, "secrets", "-n", ns, f"--as={operator_sa}", check=False
            ).stdout.strip()
            for verb in ("create", "get", "list", "watch")
        }
        assert can == {"create": "yes", "get": "no", "list": "yes", "watch": "yes"}  # list/watch: metadata only
    finally:
        _delete(cluster, ns, name)


def _get_json(cluster: LocalCluster, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _observed(cluster: LocalCluster, ns: str, name: str) -> bool:
    obj = get_isvc(cluster=cluster, namespace=ns, name=name)
    return bool((obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"])
