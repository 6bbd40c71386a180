"""Cross-field rules of the API, written once as CEL for the API server (with the messages the
pydantic validators in :mod:`.spec` and :mod:`.resource` raise too) and generated from the
capabilities table for settings this version does not serve.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from splitserve_contract import capabilities as caps
from splitserve_contract import operator_owned as owned

from ..naming import MAX_NAME_LENGTH, NAME_PATTERN

# =========================================================================== CEL rules
# Messages are shared with the pydantic validators above so both paths read the same.
REPLICAS_RULE_MESSAGE: Final = "replicas.min must be less than or equal to replicas.max"
PARALLELISM_RULE_MESSAGE: Final = "resources.gpus must be a multiple of parallelism.tensor * parallelism.pipeline"
CPU_PARALLELISM_RULE_MESSAGE: Final = "resources.gpus 0 (CPU) requires parallelism.tensor 1 and parallelism.pipeline 1"
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
AGGREGATED_RULE_MESSAGE: Final = "mode Aggregated requires spec.aggregated and forbids spec.prefill and spec.decode"
GPU_BUDGET_RULE_MESSAGE: Final = (
    "autoscaling.gpuBudget must be at least the sum over pools of replicas.min * resources.gpus"
)
NAME_LENGTH_RULE_MESSAGE: Final = (
    f"metadata.name must be at most {MAX_NAME_LENGTH} characters (children append suffixes such as -prefill)"
)
NAME_PATTERN_RULE_MESSAGE: Final = (
    "metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', "
    "starting with a letter (children include Services)"
)

DRAFT_TENSOR_PARALLEL_RULE_MESSAGE: Final = (
    "speculative decoding with a draft model (scheduling.speculative.method draft) is not supported with "
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
MODE_IMMUTABLE_RULE_MESSAGE: Final = (
    "mode cannot change after creation (the other mode's pools would be left behind): "
    "create a new InferenceService with the mode you want, move clients, delete this one"
)
ROUTER_BUILTIN_DEFAULTS: Final[dict[str, int | str]] = {
    "replicas": 1,
    "policy": "PrefixAffinity",
    "sessionHeader": "x-session-id",
    "shortPromptThreshold": 64,
    "prefillOverflowTokens": 0,
}
"""The router settings only the bundled router (router.mode Builtin) reads, with their defaults
(the models' defaults: test_crd checks they agree)."""
ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE: Final = (
    "router.replicas, policy, sessionHeader, shortPromptThreshold and prefillOverflowTokens apply "
    "to router.mode Builtin only (no router runs with InferencePool): leave them out"
)
PREFILL_OVERFLOW_AGGREGATED_RULE_MESSAGE: Final = (
    "router.prefillOverflowTokens does not apply to mode Aggregated (there are no prefill pods): leave it out"
)

CelRule = dict[str, str]


def cel_string(text: str) -> str:
    """``text`` as a CEL string literal (a regex's backslashes survive CEL's escapes)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


ROOT_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}", "message": NAME_LENGTH_RULE_MESSAGE},
    {"rule": f"self.metadata.name.matches('{NAME_PATTERN}')", "message": NAME_PATTERN_RULE_MESSAGE},
)
_POOL_GPUS = "(has(self.{p}) ? self.{p}.replicas.min * self.{p}.resources.gpus : 0)"
_POOL_TENSOR_ONE = (
    "(!has(self.{p}) || !has(self.{p}.parallelism) || ("
    "(!has(self.{p}.parallelism.tensor) || self.{p}.parallelism.tensor == 1) && "
    "(!has(self.{p}.parallelism.pipeline) || self.{p}.parallelism.pipeline == 1)))"
)
_METHOD_OF = "(has({s}.speculative) && has({s}.speculative.method) ? {s}.speculative.method : 'none')"
_SPECULATIVE_METHOD = (
    "(has(self.scheduling) ? "
    + _METHOD_OF.format(s="self.scheduling")
    + " : (has(self.engine) ? "
    + _METHOD_OF.format(s="self.engine")
    + " : 'none'))"
)
"""The speculative method in effect: spec.scheduling's, else the deprecated spec.engine's."""
_ROUTER_MODE = "((has({o}.router) && has({o}.router.mode)) ? {o}.router.mode : 'Builtin')"
MIN_AUTOSCALING_INTERVAL_SECONDS: Final = 1.0
MAX_AUTOSCALING_INTERVAL_SECONDS: Final = 86_400.0
INTERVAL_RULE_MESSAGE: Final = "autoscaling.interval must be between 1s and 24h"
SLO_TARGETS_RULE_MESSAGE: Final = "autoscaling.slo.ttftP99 and itlP99 must be above 0s"
AUTOSCALING_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": "!has(self.interval) || (duration(self.interval) >= duration('1s')"
        " && duration(self.interval) <= duration('24h'))",
        "message": INTERVAL_RULE_MESSAGE,
    },
    {
        "rule": "!has(self.slo) || (duration(self.slo.ttftP99) > duration('0s')"
        " && duration(self.slo.itlP99) > duration('0s'))",
        "message": SLO_TARGETS_RULE_MESSAGE,
    },
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
        "rule": _SPECULATIVE_METHOD
        + " != 'draft' || ("
        + " && ".join(_POOL_TENSOR_ONE.format(p=p) for p in SPECULATING_POOLS)
        + ")",
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
    # mode has a default, so both objects have it: a transition rule like router.mode's.
    {"rule": "self.mode == oldSelf.mode", "message": MODE_IMMUTABLE_RULE_MESSAGE},
    {
        # The API server fills in the defaults before the rules run: a setting is "set" when
        # it differs from its default.
        "rule": "!has(self.router) || "
        + _ROUTER_MODE.format(o="self")
        + " != 'InferencePool' || ("
        + " && ".join(
            f"(!has(self.router.{k}) || self.router.{k} == {cel_string(v) if isinstance(v, str) else v})"
            for k, v in ROUTER_BUILTIN_DEFAULTS.items()
        )
        + ")",
        "message": ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE,
    },
    {
        "rule": "self.mode != 'Aggregated' || !has(self.router) || !has(self.router.prefillOverflowTokens)"
        " || self.router.prefillOverflowTokens == 0",
        "message": PREFILL_OVERFLOW_AGGREGATED_RULE_MESSAGE,
    },
)


def router_builtin_settings_set(router: Mapping[str, Any]) -> list[str]:
    """The router settings of :data:`ROUTER_BUILTIN_DEFAULTS` that ``router`` (JSON) sets to
    something other than their defaults."""
    return [k for k, v in ROUTER_BUILTIN_DEFAULTS.items() if router.get(k, v) != v]


def _capability_rules(*capabilities: caps.Capability) -> tuple[CelRule, ...]:
    return tuple(caps.cel_rule(c) for c in capabilities if c.supported != c.known)


# --------------------------------------------------------------------------- the model hub
# The runtime sends the hub token (any key of any Secret of the namespace, hubTokenSecretRef)
# as a Bearer token to hubEndpoint. The CRD's pattern (fields.HUB_ENDPOINT_PATTERN) admits only
# an http(s) URL of printable ASCII without user information or query; these rules refuse the
# addresses no model hub has: the pod itself, the node's link-local metadata services and the
# cluster's own Services. (A public name may still resolve to such an address: the operator's
# list of allowed hubs, api.hub_policy, is what decides which hosts get the token.)
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_URL_END = "(:[0-9]*)?(/.*)?$"
HUB_ENDPOINT_AUTHORITY_REGEX: Final = "^[a-z]+://([^/]*@|[^/]*:(0*|6553[6-9]|655[4-9][0-9]|65[6-9][0-9]{2}|6[6-9][0-9]{3}|[7-9][0-9]{4}|[0-9]{6,})(/.*)?$)"
"""Matches an endpoint with user information (``user:password@host``) or a port outside 1-65535."""
_INTERNAL_HOSTS: Final = (
    "[-a-z0-9]+",  # one label: localhost, metadata, a Service name, a number (inet_aton)
    "[-a-z0-9.]*[.](svc|cluster[.]local|localhost)",
    "kubernetes[.]default([.][-a-z0-9.]*)?",
    "metadata[.]google[.]internal",
    "(0|127)[.][0-9.]*",  # this host, loopback
    "169[.]254[.][0-9.]*",  # link-local: cloud metadata services
    r"\[[0:]*(:0*1)?\]",  # [::], [::1] in any spelling
    r"\[fe[89ab][0-9a-f]:[0-9a-f:]*\]",  # link-local fe80::/10
    r"\[[0-9a-f:]*[.][0-9a-f:.]*\]",  # an embedded IPv4 address (::ffff:169.254.169.254)
    r"\[[0:]*:ffff:[0-9a-f:]*\]",  # IPv4-mapped, in hex
)
HUB_ENDPOINT_INTERNAL_REGEX: Final = f"(?i)^https?://({'|'.join(_INTERNAL_HOSTS)}){_URL_END}"
"""Matches an endpoint whose host is loopback, unspecified, link-local or cluster-internal."""
HUB_ENDPOINT_NUMERIC_REGEX: Final = f"(?i)^https?://([-a-z0-9]+[.])*(0x[0-9a-f]*|[0-9]+){_URL_END}"
"""Matches a host whose last label is a number: an IPv4 address in some spelling."""
HUB_ENDPOINT_DOTTED_QUAD_REGEX: Final = f"^https?://{_OCTET}([.]{_OCTET}){{3}}{_URL_END}"
"""Matches a host that is an IPv4 address in dotted decimal without leading zeros (the only
spelling admitted: octal and hex parts, which the resolver also reads, hide what they name)."""
HUB_ENDPOINT_AUTHORITY_RULE_MESSAGE: Final = (
    "model.hubEndpoint must have a port of 1-65535 and no user information (user:password@): "
    "the hub token comes from model.hubTokenSecretRef"
)
HUB_ENDPOINT_HOST_RULE_MESSAGE: Final = (
    "model.hubEndpoint must name a model hub, not this pod, the node or the cluster: it gets the hub "
    "token, so loopback, unspecified and link-local addresses (169.254.0.0/16, fe80::/10), IPv4 "
    "addresses other than dotted decimal, one-label hosts and cluster names (kubernetes.default*, "
    "*.svc, *.cluster.local, *.localhost, metadata.google.internal) are refused"
)


def hub_endpoint_problems(endpoint: str) -> list[str]:
    """The hubEndpoint rules (:data:`MODEL_CEL_RULES`) in Python, for an endpoint that matches
    the field's pattern."""
    out = []
    if re.search(HUB_ENDPOINT_AUTHORITY_REGEX, endpoint):
        out.append(HUB_ENDPOINT_AUTHORITY_RULE_MESSAGE)
    if re.search(HUB_ENDPOINT_INTERNAL_REGEX, endpoint) or (
        re.search(HUB_ENDPOINT_NUMERIC_REGEX, endpoint) and not re.search(HUB_ENDPOINT_DOTTED_QUAD_REGEX, endpoint)
    ):
        out.append(HUB_ENDPOINT_HOST_RULE_MESSAGE)
    return out


_HUB = "self.hubEndpoint"
MODEL_CEL_RULES: Final[tuple[CelRule, ...]] = (
    *_capability_rules(caps.DTYPE, caps.QUANTIZATION),
    {
        "rule": f"!has({_HUB}) || !{_HUB}.matches({cel_string(HUB_ENDPOINT_AUTHORITY_REGEX)})",
        "message": HUB_ENDPOINT_AUTHORITY_RULE_MESSAGE,
        "fieldPath": ".hubEndpoint",
    },
    {
        "rule": f"!has({_HUB}) || !({_HUB}.matches({cel_string(HUB_ENDPOINT_INTERNAL_REGEX)}) || "
        f"({_HUB}.matches({cel_string(HUB_ENDPOINT_NUMERIC_REGEX)}) && "
        f"!{_HUB}.matches({cel_string(HUB_ENDPOINT_DOTTED_QUAD_REGEX)})))",
        "message": HUB_ENDPOINT_HOST_RULE_MESSAGE,
        "fieldPath": ".hubEndpoint",
    },
)
"""Generated from the capabilities table (known-but-unsupported values are refused with "... is
not supported by this version of splitserve"), and the hubEndpoint rules above."""

# --------------------------------------------------------------------------- runtime env and args
# Each rule sits on one list entry (an env var, an argument), so the API server's cost estimate
# is one short entry's times the list's maxItems; a rule over the whole list that filters it
# again for its message was estimated at over 100x the CRD's budget, and refused.
_RESERVED_ENV = f"self.name in [{', '.join(cel_string(n) for n in sorted(owned.RESERVED_ENV_NAMES))}]" + "".join(
    f" || self.name.startsWith({cel_string(p)})" for p in owned.RESERVED_ENV_PREFIXES
)
RESERVED_ENV_RULE_MESSAGE: Final = (
    "runtime.env must not set a variable the operator renders (it would replace the operator's): "
    + owned.owners_in_words(
        {**owned.RESERVED_ENV_NAMES, **{f"{p}*": o for p, o in owned.RESERVED_ENV_PREFIXES.items()}}
    )
)
_FLAG_FORMS = f"[{', '.join(cel_string(f) for f in owned.RESERVED_FLAG_FORMS)}]"
_RESERVED_ARG = f"{_FLAG_FORMS}.exists(f, self == f || self.startsWith(f + '='))"
RESERVED_ARG_RULE_MESSAGE: Final = (
    "runtime.extraArgs must not set a flag the operator renders, alone or as --flag=value (the "
    "last value would win): set its field instead: " + owned.owners_in_words(owned.OPERATOR_SERVE_FLAGS, spell="--{}")
)
RESERVED_ENV_SHORT_MESSAGE: Final = "runtime.env must not set a variable the operator renders"
RESERVED_ARG_SHORT_MESSAGE: Final = "runtime.extraArgs must not set a flag the operator renders"
# The messages in full (each reserved name with the field that sets it) are the rules'
# messageExpressions, which also name the offending entry; `message` is their fallback.
ENV_VALUE_CONTROL_REGEX: Final = r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"
"""A control character other than tab, newline and carriage return: NUL cannot reach a process'
environment or argument list at all (the container fails to start), the others garble logs and
shells."""
ARG_CONTROL_REGEX: Final = ENV_VALUE_CONTROL_REGEX
ENV_VALUE_CONTROL_RULE_MESSAGE: Final = (
    "runtime.env values must not contain control characters (NUL and others; tab, newline and "
    "carriage return are allowed)"
)
ARG_CONTROL_RULE_MESSAGE: Final = (
    "runtime.extraArgs must not contain control characters (NUL and others; tab, newline and "
    "carriage return are allowed)"
)
ENV_VAR_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": f"!({_RESERVED_ENV})",
        "messageExpression": "'runtime.env ' + self.name + ' is set by the operator, not runtime.env: ' + "
        + cel_string(RESERVED_ENV_RULE_MESSAGE.split(": ", 1)[1]),
        "message": RESERVED_ENV_SHORT_MESSAGE,
        "fieldPath": ".name",
    },
    {
        "rule": f"!has(self.value) || !self.value.matches({cel_string(ENV_VALUE_CONTROL_REGEX)})",
        "message": ENV_VALUE_CONTROL_RULE_MESSAGE,
        "fieldPath": ".value",
    },
)
EXTRA_ARG_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": f"!({_RESERVED_ARG})",
        # The owners of each flag are in the models' message and docs/operator.md: spelled out
        # here, on runtime.extraArgs and on each pool's, they were a tenth of the CRD.
        "messageExpression": "'extraArgs ' + self + ' sets a flag the operator renders: set its field "
        "instead (docs/operator.md, runtime.extraArgs)'",
        "message": RESERVED_ARG_SHORT_MESSAGE,
    },
    {"rule": f"!self.matches({cel_string(ARG_CONTROL_REGEX)})", "message": ARG_CONTROL_RULE_MESSAGE},
)
# Sizes: kopf keeps the last handled spec in an annotation (and `kubectl apply` the whole
# object in another), and an object's annotations together may hold 256 KiB; a spec past that
# is never handled, and its object fails forever. runtime.env and extraArgs were the big
# free-form fields (64 values of 32 KiB). The totals are rules on the lists, which the API
# server's cost estimate takes as maxItems times one short step.
MAX_ENV_VARS: Final = 32
MAX_ENV_VALUE_LENGTH: Final = 4096
MAX_ENV_VALUES_TOTAL: Final = 16_384
MAX_EXTRA_ARGS: Final = 64
MAX_EXTRA_ARG_LENGTH: Final = 1024
MAX_EXTRA_ARGS_TOTAL: Final = 8192
ENV_TOTAL_RULE_MESSAGE: Final = (
    f"runtime.env values may hold at most {MAX_ENV_VALUES_TOTAL} characters together "
    "(the spec is kept in an annotation): shorten them"
)
EXTRA_ARGS_TOTAL_RULE_MESSAGE: Final = (
    f"runtime.extraArgs may hold at most {MAX_EXTRA_ARGS_TOTAL} characters together "
    "(the spec is kept in an annotation): shorten them"
)
ENV_LIST_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": f"self.map(e, has(e.value) ? size(e.value) : 0).sum() <= {MAX_ENV_VALUES_TOTAL}",
        "message": ENV_TOTAL_RULE_MESSAGE,
    },
)
EXTRA_ARGS_LIST_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": f"self.map(a, size(a)).sum() <= {MAX_EXTRA_ARGS_TOTAL}", "message": EXTRA_ARGS_TOTAL_RULE_MESSAGE},
)
RUNTIME_CEL_RULES: Final[tuple[CelRule, ...]] = (
    *ENV_VAR_CEL_RULES,
    *EXTRA_ARG_CEL_RULES,
    *ENV_LIST_CEL_RULES,
    *EXTRA_ARGS_LIST_CEL_RULES,
)
"""Generated from :mod:`splitserve_contract.operator_owned`: what the operator renders into the
pods is not the user's to set again (the models apply the same tables). The env rule sits on
each ``runtime.env`` entry, the argument rule on each ``runtime.extraArgs`` entry; the size
totals on the lists."""
PARALLELISM_CEL_RULES: Final[tuple[CelRule, ...]] = _capability_rules(
    caps.TENSOR_PARALLEL_SIZE, caps.PIPELINE_PARALLEL_SIZE
)
DRAFT_MODEL_RULE_MESSAGE: Final = "scheduling.speculative.draftModel is only used with scheduling.speculative.method draft: remove it or set method draft"
DRAFT_METHOD_RULE_MESSAGE: Final = "scheduling.speculative.method draft requires scheduling.speculative.draftModel"
SPECULATIVE_CEL_RULES: Final[tuple[CelRule, ...]] = (
    *_capability_rules(caps.SPECULATIVE_METHOD),
    {
        "rule": "!has(self.draftModel) || (has(self.method) && self.method == 'draft')",
        "message": DRAFT_MODEL_RULE_MESSAGE,
    },
    {
        "rule": "!has(self.method) || self.method != 'draft' || has(self.draftModel)",
        "message": DRAFT_METHOD_RULE_MESSAGE,
    },
)
"""Known-but-unsupported methods (from the capabilities table), and a draft model exactly
when the method is draft."""
REPLICAS_CEL_RULES: Final[tuple[CelRule, ...]] = ({"rule": "self.min <= self.max", "message": REPLICAS_RULE_MESSAGE},)
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
    {
        "rule": "!has(self.resources.gpusPerNode) || (self.resources.gpus > 0"
        " && self.resources.gpus % self.resources.gpusPerNode == 0)",
        "message": GPUS_PER_NODE_RULE_MESSAGE,
    },
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
    'operator must be Exists when key is empty, which means "match all values and all keys"'
)
TOLERATION_VALUE_RULE_MESSAGE: Final = "value must be empty when operator is Exists"
TOLERATION_SECONDS_RULE_MESSAGE: Final = "effect must be NoExecute when tolerationSeconds is set"
TOLERATION_KEY_PATTERN_RULE_MESSAGE: Final = (
    "key must be empty or a label key: an optional DNS subdomain prefix and '/', then a name of "
    "alphanumerics, '-', '_' or '.' starting and ending with an alphanumeric"
)
TOLERATION_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": f"!has(self.key) || size(self.key) == 0 || self.key.matches('{LABEL_KEY_PATTERN}')",
        "message": TOLERATION_KEY_PATTERN_RULE_MESSAGE,
    },
    {
        "rule": "(has(self.key) && size(self.key) > 0) || (has(self.operator) && self.operator == 'Exists')",
        "message": TOLERATION_KEY_RULE_MESSAGE,
    },
    {
        "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || size(self.value) == 0",
        "message": TOLERATION_VALUE_RULE_MESSAGE,
    },
    {
        "rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "message": TOLERATION_SECONDS_RULE_MESSAGE,
    },
)


def toleration_problems(toleration: Mapping[str, Any]) -> list[str]:
    """:data:`TOLERATION_CEL_RULES` in Python (same messages)."""
    out = []
    if toleration.get("key") and not re.search(LABEL_KEY_PATTERN, str(toleration["key"])):
        out.append(TOLERATION_KEY_PATTERN_RULE_MESSAGE)
    if not toleration.get("key") and toleration.get("operator") != "Exists":
        out.append(TOLERATION_KEY_RULE_MESSAGE)
    if toleration.get("operator") == "Exists" and toleration.get("value"):
        out.append(TOLERATION_VALUE_RULE_MESSAGE)
    if toleration.get("tolerationSeconds") is not None and toleration.get("effect") != "NoExecute":
        out.append(TOLERATION_SECONDS_RULE_MESSAGE)
    return out


# The pairings Kubernetes checks in Go for the affinity's selector requirements and pod
# affinity terms (ValidateNodeSelectorRequirement, ValidateLabelSelectorRequirement,
# validatePodAffinityTerm). The values rule sits on each requirement (a short rule: the
# Affinity schema is embedded twelve times per pool); an empty topologyKey is refused by the
# schema (minLength, :func:`.fields`).
SELECTOR_VALUES_RULE_MESSAGE: Final = "operator In, NotIn, Gt or Lt needs values; Exists or DoesNotExist takes none"
SELECTOR_REQUIREMENT_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": "self.operator in ['In','NotIn','Gt','Lt'] == (has(self.values) && size(self.values) > 0)",
        "message": SELECTOR_VALUES_RULE_MESSAGE,
    },
)
TOPOLOGY_KEY_RULE_MESSAGE: Final = "topologyKey must not be empty"


def affinity_problems(affinity: Mapping[str, Any]) -> list[str]:
    """:data:`SELECTOR_REQUIREMENT_CEL_RULES` and the topologyKey bound in Python, over every
    selector requirement and pod affinity term of ``affinity`` (same messages)."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            if (
                "operator" in node
                and "key" in node
                and (node["operator"] in ("In", "NotIn", "Gt", "Lt")) != bool(node.get("values"))
            ):
                out.append(SELECTOR_VALUES_RULE_MESSAGE)
            if node.get("topologyKey") == "":
                out.append(TOPOLOGY_KEY_RULE_MESSAGE)
            for sub in node.values():
                walk(sub)
        elif isinstance(node, list):
            for sub in node:
                walk(sub)

    walk(affinity)
    return sorted(set(out))
