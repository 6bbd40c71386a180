"""Cross-field rules of the API, written once as CEL for the API server (with the messages the
pydantic validators in :mod:`.spec` and :mod:`.resource` raise too) and generated from the
capabilities table for settings this version does not serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from splitserve_contract import capabilities as caps

from ..naming import MAX_NAME_LENGTH, NAME_PATTERN

# =========================================================================== CEL rules
# Messages are shared with the pydantic validators above so both paths read the same.
REPLICAS_RULE_MESSAGE: Final = "replicas.min must be less than or equal to replicas.max"
PARALLELISM_RULE_MESSAGE: Final = (
    "resources.gpus must be a multiple of parallelism.tensor * parallelism.pipeline"
)
CPU_PARALLELISM_RULE_MESSAGE: Final = (
    "resources.gpus 0 (CPU) requires parallelism.tensor 1 and parallelism.pipeline 1"
)
MAX_REPLICA_GPUS: Final = 64
"""Most GPUs of one replica (and of one pod): parallelism.tensor (<= 8) x parallelism.pipeline (<= 8)."""
GPUS_PER_NODE_RULE_MESSAGE: Final = "resources.gpus must be a positive multiple of resources.gpusPerNode"
MULTI_NODE_PARALLELISM_RULE_MESSAGE: Final = (
    "resources.gpusPerNode below resources.gpus requires parallelism.tensor * parallelism.pipeline == resources.gpus"
)
MULTI_NODE_IMMUTABLE_RULE_MESSAGE: Final = (
    "whether resources.gpusPerNode is below resources.gpus (multi-node) cannot change: create a new InferenceService"
)
DISAGGREGATED_RULE_MESSAGE: Final = (
    "mode Disaggregated requires spec.prefill and spec.decode and forbids spec.aggregated"
)
AGGREGATED_RULE_MESSAGE: Final = (
    "mode Aggregated requires spec.aggregated and forbids spec.prefill and spec.decode"
)
GPU_BUDGET_RULE_MESSAGE: Final = (
    "autoscaling.gpuBudget must be at least the sum over pools of replicas.min * resources.gpus"
)
NAME_LENGTH_RULE_MESSAGE: Final = (
    f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
    "(children append suffixes such as -prefill)"
)
NAME_PATTERN_RULE_MESSAGE: Final = (
    "metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', "
    "starting with a letter (children include Services)"
)

DRAFT_TENSOR_PARALLEL_RULE_MESSAGE: Final = (
    "speculative decoding with a draft model (engine.speculative.method draft) is not supported with "
    "tensor or pipeline parallelism yet (ngram is): set parallelism.tensor and parallelism.pipeline 1 "
    "on the decode and aggregated pools, or use method ngram"
)
SPECULATING_POOLS: Final = ("decode", "aggregated")
"""Pools whose pods get the speculative decoding flags (prefill pods never speculate)."""
INFERENCE_POOL_SETTINGS_RULE_MESSAGE: Final = (
    "router.inferencePool is only used with router.mode InferencePool: remove it or set that mode"
)
ROUTER_MODE_IMMUTABLE_RULE_MESSAGE: Final = (
    "router.mode cannot change after creation (the other mode's children would be left "
    "behind): create a new InferenceService with the mode you want, move clients, delete this one"
)

CelRule = dict[str, str]

ROOT_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}", "message": NAME_LENGTH_RULE_MESSAGE},
    {"rule": f"self.metadata.name.matches('{NAME_PATTERN}')", "message": NAME_PATTERN_RULE_MESSAGE},
)
_POOL_GPUS = "(has(self.{p}) ? self.{p}.replicas.min * self.{p}.resources.gpus : 0)"
_POOL_TENSOR_ONE = ("(!has(self.{p}) || !has(self.{p}.parallelism) || ("
                    "(!has(self.{p}.parallelism.tensor) || self.{p}.parallelism.tensor == 1) && "
                    "(!has(self.{p}.parallelism.pipeline) || self.{p}.parallelism.pipeline == 1)))")
_ROUTER_MODE = "((has({o}.router) && has({o}.router.mode)) ? {o}.router.mode : 'Builtin')"
MIN_AUTOSCALING_INTERVAL_SECONDS: Final = 1.0
INTERVAL_RULE_MESSAGE: Final = "autoscaling.interval must be at least 1s"
SLO_TARGETS_RULE_MESSAGE: Final = "autoscaling.slo.ttftP99 and itlP99 must be above 0s"
AUTOSCALING_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": "!has(self.interval) || duration(self.interval) >= duration('1s')",
     "message": INTERVAL_RULE_MESSAGE},
    {"rule": "!has(self.slo) || (duration(self.slo.ttftP99) > duration('0s')"
             " && duration(self.slo.itlP99) > duration('0s'))",
     "message": SLO_TARGETS_RULE_MESSAGE},
)
SPEC_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": "self.mode != 'Disaggregated' || (has(self.prefill) && has(self.decode) && !has(self.aggregated))",
        "message": DISAGGREGATED_RULE_MESSAGE,
    },
    {
        "rule": "self.mode != 'Aggregated' || (has(self.aggregated) && !has(self.prefill) && !has(self.decode))",
        "message": AGGREGATED_RULE_MESSAGE,
    },
    {
        "rule": "!has(self.autoscaling) || !has(self.autoscaling.gpuBudget) || self.autoscaling.gpuBudget >= "
        + " + ".join(_POOL_GPUS.format(p=p) for p in ("prefill", "decode", "aggregated")),
        "message": GPU_BUDGET_RULE_MESSAGE,
    },
    {
        # The runtime refuses --speculative-method draft with --tensor-parallel-size > 1 at start-up;
        # refusing it here shows the reason at kubectl apply instead of in a crash-looping pod.
        "rule": "!has(self.engine) || !has(self.engine.speculative) || !has(self.engine.speculative.method)"
                " || self.engine.speculative.method != 'draft' || ("
        + " && ".join(_POOL_TENSOR_ONE.format(p=p) for p in SPECULATING_POOLS) + ")",
        "message": DRAFT_TENSOR_PARALLEL_RULE_MESSAGE,
    },
    {
        "rule": "!has(self.router) || !has(self.router.inferencePool)"
                " || (has(self.router.mode) && self.router.mode == 'InferencePool')",
        "message": INFERENCE_POOL_SETTINGS_RULE_MESSAGE,
    },
    {
        # A transition rule (oldSelf): checked on updates only. The pydantic models cannot see
        # the old object, so this one is the API server's alone.
        "rule": _ROUTER_MODE.format(o="self") + " == " + _ROUTER_MODE.format(o="oldSelf"),
        "message": ROUTER_MODE_IMMUTABLE_RULE_MESSAGE,
    },
)


def _capability_rules(*capabilities: caps.Capability) -> tuple[CelRule, ...]:
    return tuple(caps.cel_rule(c) for c in capabilities if c.supported != c.known)


MODEL_CEL_RULES: Final[tuple[CelRule, ...]] = _capability_rules(caps.DTYPE, caps.QUANTIZATION)
"""Generated from the capabilities table: known-but-unsupported values are refused with
"... is not supported by this version of splitserve"."""
PARALLELISM_CEL_RULES: Final[tuple[CelRule, ...]] = _capability_rules(
    caps.TENSOR_PARALLEL_SIZE, caps.PIPELINE_PARALLEL_SIZE)
DRAFT_MODEL_RULE_MESSAGE: Final = (
    "engine.speculative.draftModel is only used with engine.speculative.method draft: "
    "remove it or set method draft"
)
DRAFT_METHOD_RULE_MESSAGE: Final = "engine.speculative.method draft requires engine.speculative.draftModel"
SPECULATIVE_CEL_RULES: Final[tuple[CelRule, ...]] = (
    *_capability_rules(caps.SPECULATIVE_METHOD),
    {"rule": "!has(self.draftModel) || (has(self.method) && self.method == 'draft')",
     "message": DRAFT_MODEL_RULE_MESSAGE},
    {"rule": "!has(self.method) || self.method != 'draft' || has(self.draftModel)",
     "message": DRAFT_METHOD_RULE_MESSAGE},
)
"""Known-but-unsupported methods (from the capabilities table), and a draft model exactly
when the method is draft."""
REPLICAS_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": "self.min <= self.max", "message": REPLICAS_RULE_MESSAGE},
)
LABEL_KEY_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
MAX_LABEL_KEY_LENGTH: Final = 317
"""A label key: an optional DNS-subdomain prefix (<= 253) and '/', then a name (<= 63)."""
_MULTI_NODE = "(has({o}.resources.gpusPerNode) && {o}.resources.gpusPerNode < {o}.resources.gpus)"
NODE_SELECTOR_RULE_MESSAGE: Final = (
    "nodeSelector keys must be label keys: an optional DNS subdomain prefix and '/', then a name "
    "of alphanumerics, '-', '_' or '.' starting and ending with an alphanumeric"
)
POOL_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": f"!has(self.nodeSelector) || self.nodeSelector.all(k, size(k) <= {MAX_LABEL_KEY_LENGTH}"
                f" && k.matches('{LABEL_KEY_PATTERN}'))",
        "message": NODE_SELECTOR_RULE_MESSAGE,
        "fieldPath": ".nodeSelector",
    },
    {
        "rule": "self.resources.gpus != 0 || (self.parallelism.tensor == 1 && self.parallelism.pipeline == 1)",
        "message": CPU_PARALLELISM_RULE_MESSAGE,
    },
    {
        "rule": "self.resources.gpus == 0 || self.resources.gpus % (self.parallelism.tensor * self.parallelism.pipeline) == 0",
        "message": PARALLELISM_RULE_MESSAGE,
    },
    {"rule": "!has(self.resources.gpusPerNode) || (self.resources.gpus > 0"
             " && self.resources.gpus % self.resources.gpusPerNode == 0)",
     "message": GPUS_PER_NODE_RULE_MESSAGE},
    {
        # With tensor x pipeline == gpus, (tensor x pipeline) % (gpus / gpusPerNode) == 0 follows
        # from the rule above: every pod of the group holds the same number of ranks.
        "rule": "!has(self.resources.gpusPerNode) || self.resources.gpusPerNode >= self.resources.gpus"
                " || self.parallelism.tensor * self.parallelism.pipeline == self.resources.gpus",
        "message": MULTI_NODE_PARALLELISM_RULE_MESSAGE,
    },
    {
        # A transition rule (oldSelf): checked on updates of an existing pool only; the API
        # server's alone, like the router mode's. Its Deployment or LeaderWorkerSet would be
        # left behind otherwise.
        "rule": _MULTI_NODE.format(o="self") + " == " + _MULTI_NODE.format(o="oldSelf"),
        "message": MULTI_NODE_IMMUTABLE_RULE_MESSAGE,
    },
)


# The pairings Kubernetes checks in Go for a Toleration (ValidateTolerations), which its
# OpenAPI schema cannot say; without them such a toleration passes admission and the
# Deployment apply fails. `size()` keeps the CEL cost independent of string lengths.
TOLERATION_KEY_RULE_MESSAGE: Final = (
    "operator must be Exists when key is empty, which means \"match all values and all keys\""
)
TOLERATION_VALUE_RULE_MESSAGE: Final = "value must be empty when operator is Exists"
TOLERATION_SECONDS_RULE_MESSAGE: Final = "effect must be NoExecute when tolerationSeconds is set"
TOLERATION_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": "(has(self.key) && size(self.key) > 0) || (has(self.operator) && self.operator == 'Exists')",
     "message": TOLERATION_KEY_RULE_MESSAGE},
    {"rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || size(self.value) == 0",
     "message": TOLERATION_VALUE_RULE_MESSAGE},
    {"rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
     "message": TOLERATION_SECONDS_RULE_MESSAGE},
)


def toleration_problems(toleration: Mapping[str, Any]) -> list[str]:
    """:data:`TOLERATION_CEL_RULES` in Python (same messages)."""
    out = []
    if not toleration.get("key") and toleration.get("operator") != "Exists":
        out.append(TOLERATION_KEY_RULE_MESSAGE)
    if toleration.get("operator") == "Exists" and toleration.get("value"):
        out.append(TOLERATION_VALUE_RULE_MESSAGE)
    if toleration.get("tolerationSeconds") is not None and toleration.get("effect") != "NoExecute":
        out.append(TOLERATION_SECONDS_RULE_MESSAGE)
    return out
