"""What an InferenceService may ask of each engine, checked at admission.

Why one module: ``spec.runtime.engine`` picks the program every pool runs, and an engine other
than the bundled runtime serves a different set of the API's values (the capabilities table's
``by_engine``), parses its own flags (so ``extraArgs`` must not repeat what the operator
renders for it) and reads its own file formats. The API server checks this with the CEL rules
here and the models with :func:`problems`, both from the same tables, so a refusal reads the
same at ``kubectl apply`` and in Python, and always names the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from splitserve_contract import ServeArgs
from splitserve_contract import capabilities as caps
from splitserve_contract import operator_owned as owned
from splitserve_contract.engines import DEFAULT_ENGINE, Engine

from .rules import CelRule, cel_string

POOLS: Final = ("prefill", "decode", "aggregated")

ENGINE_IMMUTABLE_RULE_MESSAGE: Final = "runtime.engine cannot change: create a new InferenceService"
GGUF_RULE_MESSAGE: Final = (
    "a .gguf model file is not supported by engine vllm: name the Hugging Face checkpoint "
    "(config, tokenizer and *.safetensors) instead"
)
VLLM_SPECULATIVE_MAX_NUM_SEQS_RULE_MESSAGE: Final = (
    "scheduling.speculative.maxNumSeqs is not supported by engine vllm (vLLM speculates in every "
    "step): leave it at its default"
)
VLLM_CPU_BLOCK_MULTIPLE: Final = 32
VLLM_CPU_BLOCK_SIZE_RULE_MESSAGE: Final = (
    f"kvCache.blockSize must be a multiple of {VLLM_CPU_BLOCK_MULTIPLE} for engine vllm on CPU pools "
    "(resources.gpus 0): vLLM's CPU attention has no kernel for smaller blocks"
)
VLLM_SLO_RULE_MESSAGE: Final = (
    "autoscaling.slo is not supported by engine vllm yet (its fit reads the bundled runtime's engine-step "
    "counters): scale vllm pools on autoscaling.prefill and autoscaling.decode targets"
)
VLLM_PROMPT_TOKENS_RULE_MESSAGE: Final = (
    "autoscaling.prefill.targetPromptTokensWaiting is not supported by engine vllm (vLLM exports its "
    "backlog in requests, not prompt tokens): use targetQueueDepth"
)
VLLM_EXTRA_ARG_RULE_MESSAGE: Final = (
    "extraArgs of a vllm InferenceService must not set an option the operator renders for engine vllm, "
    "nor an abbreviation, underscore or --option.key spelling of one: set its field instead "
    "(docs/operator.md, choosing an engine)"
)

ENGINE_CAPABILITIES: Final[dict[str, caps.Capability]] = {
    "model.quantization": caps.QUANTIZATION,
    "mode": caps.SERVING_MODE,
    "router.mode": caps.ROUTER_MODE,
    "replica layout": caps.REPLICA_LAYOUT,
}
"""The settings whose support differs by engine, by where the spec holds them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """What a spec asks of its engine, in the words of the capabilities table."""

    engine: str
    quantization: str
    mode: str
    router_mode: str
    multi_node: bool
    model_uris: Sequence[str]
    speculative_max_num_seqs_set: bool
    extra_args: Sequence[str]
    slo: bool
    prompt_tokens_target: bool
    block_size: int
    cpu_pools: bool
    """Whether any pool computes on the CPU (resources.gpus 0)."""


def problems(request: EngineRequest) -> list[str]:
    """Every reason the engine cannot serve ``request``, in the CEL rules' words."""
    if request.engine == DEFAULT_ENGINE:
        return []
    values: dict[str, str] = {
        "model.quantization": request.quantization,
        "mode": request.mode,
        "router.mode": request.router_mode,
        "replica layout": "multi-node" if request.multi_node else "single-node",
    }
    out = caps.engine_unsupported(request.engine, [(ENGINE_CAPABILITIES[k], v) for k, v in values.items()])
    if request.engine == Engine.VLLM:
        if any(uri.endswith(".gguf") for uri in request.model_uris):
            out.append(GGUF_RULE_MESSAGE)
        if request.speculative_max_num_seqs_set:
            out.append(VLLM_SPECULATIVE_MAX_NUM_SEQS_RULE_MESSAGE)
        if request.cpu_pools and request.block_size % VLLM_CPU_BLOCK_MULTIPLE:
            out.append(VLLM_CPU_BLOCK_SIZE_RULE_MESSAGE)
        if request.slo:
            out.append(VLLM_SLO_RULE_MESSAGE)
        if request.prompt_tokens_target:
            out.append(VLLM_PROMPT_TOKENS_RULE_MESSAGE)
        out += [p for arg in request.extra_args if (p := owned.vllm_extra_arg_problem(arg)) is not None]
    return out


# =========================================================================== CEL
def _engine(o: str) -> str:
    return f"((has({o}.runtime) && has({o}.runtime.engine)) ? {o}.runtime.engine : {cel_string(DEFAULT_ENGINE)})"


_IS_VLLM: Final = f"{_engine('self')} == {cel_string(Engine.VLLM)}"
_ROUTER_MODE: Final = "((has(self.router) && has(self.router.mode)) ? self.router.mode : 'Builtin')"
_MULTI_NODE_POOL: Final = (
    "(has(self.{p}) && has(self.{p}.resources) && has(self.{p}.resources.gpusPerNode)"
    " && self.{p}.resources.gpusPerNode < self.{p}.resources.gpus)"
)
_CPU_POOL: Final = (
    "(has(self.{p}) && has(self.{p}.resources) && has(self.{p}.resources.gpus) && self.{p}.resources.gpus == 0)"
)
_VLLM_OPTION_NAMES: Final = f"[{', '.join(cel_string(f) for f in owned.VLLM_OPERATOR_FLAGS)}]"
# The long option an argument spells, as vLLM reads it: the text after "--" up to "=" or ".",
# underscores read as dashes; refused when a rendered option starts with it (an abbreviation).
_VLLM_RESERVED_ARG: Final = (
    f"(a.matches({cel_string(owned.VLLM_SHORT_OPTION_REGEX)}) || (a.startsWith('--') && "
    f"{_VLLM_OPTION_NAMES}.exists(f, f.startsWith(a.find('^--[^=.]*').substring(2).replace('_', '-')))))"
)


def _capability_rule(field: str, value: str, capability: caps.Capability) -> CelRule:
    supported = capability.supported_by(Engine.VLLM)
    literals = ", ".join(cel_string(str(v)) for v in supported)
    note = caps.ENGINE_SUPPORT_NOTE.format(engine=Engine.VLLM)
    words = ", ".join(str(v) for v in supported)
    return {
        "rule": f"!({_IS_VLLM}) || {value} in [{literals}]",
        "message": f"{capability.name}: this value {note} (supported: {words})",
        "messageExpression": f"'{capability.name} ' + {value} + ' {note} (supported: {words})'",
        "fieldPath": field,
    }


_CAPABILITY_FIELDS: Final[tuple[tuple[str, str, caps.Capability], ...]] = (
    (".model.quantization", "((has(self.model.quantization)) ? self.model.quantization : 'none')", caps.QUANTIZATION),
    (".mode", "self.mode", caps.SERVING_MODE),
    (".router", _ROUTER_MODE, caps.ROUTER_MODE),
)
"""Where the spec holds each capability whose support differs by engine (CEL field path, value)."""


def _extra_args_all(path: str) -> str:
    return f"(!has({path}.extraArgs) || {path}.extraArgs.all(a, !{_VLLM_RESERVED_ARG}))"


def _speculative_default(holder: str) -> str:
    default = ServeArgs().speculative_max_num_seqs
    return (
        f"(!has({holder}.speculative) || !has({holder}.speculative.maxNumSeqs)"
        f" || {holder}.speculative.maxNumSeqs == {default})"
    )


ENGINE_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        # A transition rule: pods of another engine are other programs, other images and other
        # metrics; an in-place switch would roll every pool at once.
        "rule": f"{_engine('self')} == {_engine('oldSelf')}",
        "message": ENGINE_IMMUTABLE_RULE_MESSAGE,
    },
    *(
        _capability_rule(field, value, capability)
        for field, value, capability in _CAPABILITY_FIELDS
        if capability.supported_by(Engine.VLLM) != capability.supported  # else nothing to refuse
    ),
    {
        "rule": f"!({_IS_VLLM}) || !(" + " || ".join(_MULTI_NODE_POOL.format(p=p) for p in POOLS) + ")",
        "message": caps.REPLICA_LAYOUT.engine_message("multi-node", Engine.VLLM),
    },
    {
        "rule": f"!({_IS_VLLM}) || !self.model.uri.endsWith('.gguf')",
        "message": GGUF_RULE_MESSAGE,
        "fieldPath": ".model.uri",
    },
    {
        "rule": f"!({_IS_VLLM}) || (has(self.scheduling) ? {_speculative_default('self.scheduling')}"
        f" : (!has(self.engine) || {_speculative_default('self.engine')}))",
        "message": VLLM_SPECULATIVE_MAX_NUM_SEQS_RULE_MESSAGE,
    },
    {
        "rule": f"!({_IS_VLLM}) || !has(self.kvCache) || !has(self.kvCache.blockSize)"
        f" || self.kvCache.blockSize % {VLLM_CPU_BLOCK_MULTIPLE} == 0 || !("
        + " || ".join(_CPU_POOL.format(p=p) for p in POOLS)
        + ")",
        "message": VLLM_CPU_BLOCK_SIZE_RULE_MESSAGE,
        "fieldPath": ".kvCache.blockSize",
    },
    {
        "rule": f"!({_IS_VLLM}) || !has(self.autoscaling) || !has(self.autoscaling.slo)",
        "message": VLLM_SLO_RULE_MESSAGE,
        "fieldPath": ".autoscaling.slo",
    },
    {
        "rule": f"!({_IS_VLLM}) || !has(self.autoscaling) || !has(self.autoscaling.prefill)"
        " || !has(self.autoscaling.prefill.targetPromptTokensWaiting)",
        "message": VLLM_PROMPT_TOKENS_RULE_MESSAGE,
        "fieldPath": ".autoscaling.prefill.targetPromptTokensWaiting",
    },
    # One rule per list: the API server's cost estimate of the four lists in one rule is over budget.
    *(
        {
            "rule": f"!({_IS_VLLM}) || !has({holder}) || {_extra_args_all(holder)}",
            "message": VLLM_EXTRA_ARG_RULE_MESSAGE,
            "fieldPath": f"{holder.removeprefix('self')}.extraArgs",
        }
        for holder in ("self.runtime", *(f"self.{p}" for p in POOLS))
    ),
)
"""Spec-level rules (``self`` is ``spec``): each refusal names engine vllm."""
