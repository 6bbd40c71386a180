"""What this version of the runtime serves: the one table the API, the planner and the
runtime agree on.

Each :class:`Capability` names a setting, every value the API *knows* (so a typo is a plain
"unsupported value") and the values this version *supports*. The CRD generator turns a
capability with an API field into an enum of the known values plus a CEL rule that refuses
the unsupported ones with "... is not supported by this version of splitserve"; the
planner refuses to propose them; the runtime refuses them at start-up with the same words.
When a feature lands (quantization, tensor parallelism, speculative decoding, ...), its
issue widens ``supported`` here and the CRD, the planner and the docs follow on the next
``make crds``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Final

SUPPORT_NOTE: Final = "is not supported by this version of splitserve"
ENGINE_SUPPORT_NOTE: Final = "is not supported by engine {engine}"


@dataclasses.dataclass(frozen=True)
class Capability:
    """One setting: what the API knows, what the runtime serves."""

    name: str
    """Human name used in messages, e.g. ``quantization``."""
    known: tuple[str | int, ...]
    supported: tuple[str | int, ...]
    api_field: str = ""
    """camelCase field inside its API object (``quantization``, ``tensor``); empty when the
    setting is not in the CRD."""
    by_engine: tuple[tuple[str, tuple[str | int, ...]], ...] = ()
    """``(engine, values)`` for each engine that serves fewer values than ``supported`` (the
    bundled runtime's): what the operator renders and tests for that engine."""

    def __post_init__(self) -> None:
        missing = [v for v in self.supported if v not in self.known]
        missing += [v for _, values in self.by_engine for v in values if v not in self.supported]
        if missing:
            raise ValueError(f"{self.name}: supported values {missing} are not known values")

    def supported_by(self, engine: str) -> tuple[str | int, ...]:
        """The values ``engine`` serves."""
        return dict(self.by_engine).get(engine, self.supported)

    def engine_message(self, value: str | int, engine: str) -> str:
        """The one sentence every side uses to refuse ``value`` for pools of ``engine``."""
        note = ENGINE_SUPPORT_NOTE.format(engine=engine)
        return f"{self.name} {value!s} {note} (supported: {', '.join(str(v) for v in self.supported_by(engine))})"

    def is_supported(self, value: str | int) -> bool:
        return value in self.supported

    def unsupported_message(self, value: str | int) -> str:
        """The one sentence every side uses to refuse ``value``."""
        return f"{self.name} {value!s} {SUPPORT_NOTE} (supported: {', '.join(str(v) for v in self.supported)})"

    def check(self, value: str | int) -> None:
        """Raise :class:`UnsupportedError` unless ``value`` is supported."""
        if not self.is_supported(value):
            raise UnsupportedError(self.unsupported_message(value))


class UnsupportedError(ValueError):
    """A setting the API knows but this version does not serve yet."""


QUANTIZATION: Final = Capability(
    name="quantization",
    api_field="quantization",
    known=("none", "fp8", "int8", "int4"),
    supported=("none", "fp8", "int8", "int4"),
    # vLLM serves a pre-quantized checkpoint by its own quantization_config (none) and
    # quantizes a dense one at load time only to fp8 (--quantization fp8).
    by_engine=(("vllm", ("none", "fp8")),),
)
TENSOR_PARALLEL_SIZE: Final = Capability(
    name="parallelism.tensor", api_field="tensor", known=(1, 2, 4, 8), supported=(1, 2, 4, 8)
)
PIPELINE_PARALLEL_SIZE: Final = Capability(
    name="parallelism.pipeline",
    api_field="pipeline",
    known=(1, 2, 3, 4, 5, 6, 7, 8),
    supported=(1, 2, 3, 4, 5, 6, 7, 8),
)
SPECULATIVE_METHOD: Final = Capability(
    name="speculative decoding method",
    api_field="method",
    known=("none", "ngram", "draft"),
    supported=("none", "ngram", "draft"),
)
"""ngram: prompt-lookup proposals (no extra model); draft: a smaller draft model with the same
vocabulary (``engine.speculative.draftModel`` names it)."""
MODEL_URI_SCHEME: Final = Capability(
    name="model URI scheme", known=("hf", "file", "pvc"), supported=("hf", "file", "pvc")
)
ARCHITECTURE: Final = Capability(
    name="model architecture",
    known=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    supported=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
)
DTYPE: Final = Capability(
    name="dtype",
    api_field="dtype",
    known=("auto", "bfloat16", "float16", "float32"),
    supported=("auto", "bfloat16", "float16", "float32"),
)
KV_CACHE_DTYPE: Final = Capability(
    name="kvCache.dtype", api_field="dtype", known=("auto", "fp8"), supported=("auto", "fp8")
)
"""auto: the activation dtype; fp8: e4m3 with per-tensor scales (half the bytes of bf16)."""
REPLICA_LAYOUT: Final = Capability(
    name="replica layout",
    known=("single-node", "multi-node"),
    supported=("single-node", "multi-node"),
    by_engine=(("vllm", ("single-node",)),),  # vLLM spans nodes with Ray, which is not rendered
)
"""single-node: one pod holds all ranks of a replica; multi-node: a replica is a group of
``resources.gpus / resources.gpusPerNode`` pods (a LeaderWorkerSet), each holding its share of
the tensor x pipeline ranks (``--nnodes``)."""

SERVING_MODE: Final = Capability(
    name="mode",
    api_field="mode",
    known=("Disaggregated", "Aggregated"),
    supported=("Disaggregated", "Aggregated"),
)
"""Both engines: vLLM's prefill and decode pools hand off with its NixlConnector."""
ROUTER_MODE: Final = Capability(
    name="router.mode",
    known=("Builtin", "InferencePool"),
    supported=("Builtin", "InferencePool"),
    by_engine=(("vllm", ("Builtin",)),),
)
"""vLLM pools behind a Gateway's endpoint picker are not tested yet."""

ALL: Final[tuple[Capability, ...]] = (
    QUANTIZATION,
    TENSOR_PARALLEL_SIZE,
    PIPELINE_PARALLEL_SIZE,
    SPECULATIVE_METHOD,
    MODEL_URI_SCHEME,
    ARCHITECTURE,
    DTYPE,
    KV_CACHE_DTYPE,
    REPLICA_LAYOUT,
    SERVING_MODE,
    ROUTER_MODE,
)


def engine_unsupported(engine: str, pairs: Iterable[tuple[Capability, str | int]]) -> list[str]:
    """Messages for every (capability, value) pair that pools of ``engine`` cannot serve."""
    return [cap.engine_message(value, engine) for cap, value in pairs if value not in cap.supported_by(engine)]


def unsupported(pairs: Iterable[tuple[Capability, str | int]]) -> list[str]:
    """Messages for every (capability, value) pair that this version does not serve."""
    return [cap.unsupported_message(value) for cap, value in pairs if not cap.is_supported(value)]


def cel_rule(capability: Capability, *, path: str = "self") -> dict[str, str]:
    """A CEL validation for the object that holds ``capability.api_field``: refuses known but
    unsupported values with the capability's message (``messageExpression`` names the value)."""
    if not capability.api_field:
        raise ValueError(f"{capability.name} has no API field")
    field = f"{path}.{capability.api_field}"
    literals = ", ".join(_cel_literal(v) for v in capability.supported)
    supported = ", ".join(str(v) for v in capability.supported)
    value = field if isinstance(capability.supported[0], str) else _int_text(field, capability)
    prefix = f"{capability.name} "
    suffix = f" {SUPPORT_NOTE} (supported: {supported})"
    return {
        "rule": f"!has({field}) || {field} in [{literals}]",
        "message": f"{capability.name}: this value {SUPPORT_NOTE} (supported: {supported})",
        "messageExpression": f"'{prefix}' + {value} + '{suffix}'",
    }


def _int_text(field: str, capability: Capability) -> str:
    """The text of an int field in a messageExpression. kube-apiserver's cost estimate for
    ``string(int)`` exceeds the CRD budget, so spell out the refused known values instead."""
    refused = [v for v in capability.known if v not in capability.supported]
    expression = f"'{refused[-1]}'"
    for value in reversed(refused[:-1]):
        expression = f"{field} == {value} ? '{value}' : {expression}"
    return f"({expression})"


def _cel_literal(value: str | int) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value)
