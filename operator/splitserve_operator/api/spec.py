"""The InferenceService spec: what the user asks for."""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    Field,
    model_validator,
)

from splitserve_contract import (
    RoutingPolicy,
    ServeArgs,
    defaults,
    operator_owned,
)
from splitserve_contract import capabilities as caps
from splitserve_contract.engines import DEFAULT_ENGINE, VLLM_IMAGE, Engine
from splitserve_contract.model_revision import MAX_REVISION_LENGTH, REVISION_PATTERN

from . import engine_rules, hub_policy
from .fields import (
    DURATION_PATTERN,
    ENV_NAME_PATTERN,
    HUB_ENDPOINT_PATTERN,
    IMAGE_PATTERN,
    K8S_NAME_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_CPU,
    MAX_MEMORY,
    MODEL_URI_PATTERN,
    Affinity,
    ApiModel,
    BlockSize,
    CpuQuantity,
    DtypeName,
    MemoryQuantity,
    PipelineParallelSize,
    QuantizationName,
    SpeculativeMethodName,
    TensorParallelSize,
    Toleration,
    _capability,
    _capability_field,
    _object,
    parse_duration_seconds,
)
from .rules import (
    AGGREGATED_RULE_MESSAGE,
    ARG_CONTROL_REGEX,
    ARG_CONTROL_RULE_MESSAGE,
    CPU_PARALLELISM_RULE_MESSAGE,
    DISAGGREGATED_RULE_MESSAGE,
    DRAFT_METHOD_RULE_MESSAGE,
    DRAFT_MODEL_RULE_MESSAGE,
    DRAFT_TENSOR_PARALLEL_RULE_MESSAGE,
    ENV_LIST_CEL_RULES,
    ENV_TOTAL_RULE_MESSAGE,
    ENV_VALUE_CONTROL_REGEX,
    ENV_VALUE_CONTROL_RULE_MESSAGE,
    EXTRA_ARG_CEL_RULES,
    EXTRA_ARGS_LIST_CEL_RULES,
    EXTRA_ARGS_TOTAL_RULE_MESSAGE,
    GPU_BUDGET_RULE_MESSAGE,
    GPUS_PER_NODE_RULE_MESSAGE,
    INFERENCE_POOL_SETTINGS_RULE_MESSAGE,
    INTERVAL_RULE_MESSAGE,
    LABEL_KEY_PATTERN,
    MAX_AUTOSCALING_INTERVAL_SECONDS,
    MAX_ENV_VALUE_LENGTH,
    MAX_ENV_VALUES_TOTAL,
    MAX_ENV_VARS,
    MAX_EXTRA_ARG_LENGTH,
    MAX_EXTRA_ARGS,
    MAX_EXTRA_ARGS_TOTAL,
    MAX_LABEL_KEY_LENGTH,
    MAX_REPLICA_GPUS,
    MIN_AUTOSCALING_INTERVAL_SECONDS,
    MULTI_NODE_PARALLELISM_RULE_MESSAGE,
    NODE_SELECTOR_RULE_MESSAGE,
    PARALLELISM_RULE_MESSAGE,
    PREFILL_OVERFLOW_AGGREGATED_RULE_MESSAGE,
    REPLICAS_RULE_MESSAGE,
    ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE,
    SLO_TARGETS_RULE_MESSAGE,
    SPECULATING_POOLS,
    hub_endpoint_problems,
    router_builtin_settings_set,
)


def _hub_endpoint(value: str) -> str:
    problems = hub_endpoint_problems(value) or hub_policy.problems(value)
    if problems:
        raise ValueError("; ".join(problems))
    return value


def _env_name(value: str) -> str:
    problem = operator_owned.env_name_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _extra_arg(value: str) -> str:
    if re.search(ARG_CONTROL_REGEX, value):
        raise ValueError(ARG_CONTROL_RULE_MESSAGE)
    problem = operator_owned.extra_arg_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _env_value(value: str) -> str:
    if re.search(ENV_VALUE_CONTROL_REGEX, value):
        raise ValueError(ENV_VALUE_CONTROL_RULE_MESSAGE)
    return value


ExtraArg = Annotated[
    str,
    Field(
        max_length=MAX_EXTRA_ARG_LENGTH,
        json_schema_extra={"x-kubernetes-validations": [dict(rule) for rule in EXTRA_ARG_CEL_RULES]},
    ),
    AfterValidator(_extra_arg),
]
"""One extra argument of the engine's command line (``runtime.extraArgs``, a pool's ``extraArgs``)."""


def _extra_args_field(description: str) -> Any:
    return Field(
        default_factory=list,
        max_length=MAX_EXTRA_ARGS,
        json_schema_extra={"x-kubernetes-validations": [dict(rule) for rule in EXTRA_ARGS_LIST_CEL_RULES]},
        description=(
            f"{description} Not an option the operator renders from another field (--port, --model, "
            f"...). At most {MAX_EXTRA_ARGS} of at most {MAX_EXTRA_ARG_LENGTH} characters, "
            f"{MAX_EXTRA_ARGS_TOTAL} together; no control characters but tab, newline and carriage return."
        ),
    )


def _check_extra_args_total(args: list[str]) -> None:
    if sum(len(a) for a in args) > MAX_EXTRA_ARGS_TOTAL:
        raise ValueError(EXTRA_ARGS_TOTAL_RULE_MESSAGE)


# =========================================================================== spec
class Mode(enum.StrEnum):
    """How the model is served."""

    DISAGGREGATED = "Disaggregated"
    AGGREGATED = "Aggregated"


class SecretKeyRef(ApiModel):
    """A key in a Secret in the InferenceService's namespace. The operator references
    it in pod specs and never reads it."""

    name: str = Field(pattern=K8S_NAME_PATTERN, max_length=253, description="Name of the Secret.")
    key: str = Field(
        default="HF_TOKEN",
        pattern=r"^[-._a-zA-Z0-9]+$",
        max_length=253,
        description="Key inside the Secret that holds the token.",
    )


class ModelSpec(ApiModel):
    """Which model to serve and how to load it."""

    uri: str = Field(
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
        description=(
            "Model location: hf://org/name (looked up in the runtime's model cache, "
            "SPLITSERVE_MODEL_CACHE, and downloaded from the hub into it when missing: only "
            "config, tokenizer and *.safetensors files), hf://org/name/path/file.gguf (that one "
            "GGUF file), pvc://claim/path (mounted read-only) or file:///absolute/path (a path on "
            "the node). A path may name a .gguf file: its config and tokenizer come from its "
            "metadata, Q4_0/Q4_1 tensors are served as int4, other types dequantized."
        ),
    )
    revision: str | None = Field(
        default=None,
        max_length=MAX_REVISION_LENGTH,
        pattern=REVISION_PATTERN,
        description=(
            "Model revision (branch, tag or commit) for hf:// URIs: '/'-separated parts of letters, "
            "digits, '_', '-', '+' and single '.' between them (no '..', no leading '/'). Empty: the "
            "default revision."
        ),
    )
    served_name: str | None = Field(
        default=None,
        max_length=255,
        pattern=r"^[A-Za-z0-9._/:-]+$",
        description="Name clients put in the OpenAI `model` field. Empty: the InferenceService name.",
    )
    dtype: DtypeName = _capability_field(
        caps.DTYPE,
        default="auto",
        description="Weight and activation dtype. auto: bfloat16 on GPUs that support it, else the model's dtype.",
    )
    quantization: QuantizationName = _capability_field(
        caps.QUANTIZATION,
        default="none",
        description=(
            "Weight quantization. none: the checkpoint as stored (a pre-quantized checkpoint, "
            "compressed-tensors FP8/INT8/INT4, fp8, AWQ or GPTQ, is served by its own "
            "quantization_config). fp8 (W8A8 e4m3), int8 (W8A8) or int4 (W4A16, group 128): "
            "quantize a dense checkpoint at load time; with a pre-quantized checkpoint the value "
            "must name its method."
        ),
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description="Longest prompt plus completion in tokens. Empty: from the model's config.json.",
    )
    hub_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Secret with a model hub token for private or gated hf:// models, passed to the "
            "runtime as HF_TOKEN (a secretKeyRef: the operator never reads it). Empty: no token "
            "is sent. A token the hub refuses shows in the Ready condition (ModelUnavailable, "
            "HTTP 401/403 and this Secret's name)."
        ),
    )
    hub_endpoint: (
        Annotated[str, Field(max_length=2048, pattern=HUB_ENDPOINT_PATTERN), AfterValidator(_hub_endpoint)] | None
    ) = Field(
        default=None,
        description=(
            "Model hub that hf:// models are downloaded from, e.g. a private hub mirror such as "
            "https://hf-mirror.internal.example (anything that speaks the Hugging Face hub API); "
            "passed to the runtime as HF_ENDPOINT, with the hub token. Loopback, link-local and "
            "cluster-internal hosts are refused, and the operator serves only the hubs it is "
            "configured to allow (--allowed-hub-endpoints; others are Stalled). Empty: "
            "https://huggingface.co."
        ),
    )


class ApiKeySecretRef(ApiModel):
    """A key in a Secret in the InferenceService's namespace that holds the API key clients
    must present. The Secret is referenced in the pod spec, never read by the operator."""

    name: str = Field(pattern=K8S_NAME_PATTERN, max_length=253, description="Name of the Secret.")
    key: str = Field(
        pattern=r"^[-._a-zA-Z0-9]+$", max_length=253, description="Key inside the Secret that holds the API key."
    )


class EnvVar(ApiModel):
    """A plain environment variable for the runtime container."""

    name: Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=256), AfterValidator(_env_name)] = Field(
        description="Variable name (not one the operator sets: SPLITSERVE_*, LWS_*, HF_TOKEN, HF_ENDPOINT, POD_*)."
    )
    value: Annotated[str, AfterValidator(_env_value)] = Field(
        default="",
        max_length=MAX_ENV_VALUE_LENGTH,
        description=f"Variable value: at most {MAX_ENV_VALUE_LENGTH} characters, no control characters "
        "but tab, newline and carriage return.",
    )


class RuntimeSpec(ApiModel):
    """The serving engine and its container, shared by all pools."""

    engine: Engine = Field(
        default=DEFAULT_ENGINE,
        description=(
            "The serving engine every pool runs. splitserve: the bundled runtime (splitserve serve). "
            "vllm: vLLM's OpenAI server (vllm serve), Aggregated mode with the built-in router; the "
            "settings it serves are in docs/operator.md. Fixed at creation."
        ),
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description=(
            "Engine image. Empty: the operator's default for the engine: the bundled runtime's "
            f"(--runtime-image) for splitserve, {VLLM_IMAGE} (--vllm-image) for vllm. The router "
            "always runs the operator's runtime image."
        ),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy. Empty: the Kubernetes default."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV_VARS,
        description=(
            f"Extra environment variables for every runtime and router container: at most {MAX_ENV_VARS}, "
            f"values of at most {MAX_ENV_VALUES_TOTAL} characters together."
        ),
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [dict(rule) for rule in ENV_LIST_CEL_RULES],
        },
    )
    extra_args: list[ExtraArg] = _extra_args_field(
        "Extra engine arguments for every pool (splitserve serve or vllm serve), after the rendered ones "
        "and before the pool's own extraArgs."
    )
    api_key_secret_ref: ApiKeySecretRef | None = Field(
        default=None,
        description="Secret with the API key the router and runtime require from clients, passed to "
        "them as an environment variable. The Secret is referenced in the pod spec, never "
        "read by the operator. Empty: no API key is required.",
    )

    @model_validator(mode="after")
    def _totals(self) -> RuntimeSpec:
        if sum(len(e.value) for e in self.env) > MAX_ENV_VALUES_TOTAL:
            raise ValueError(ENV_TOTAL_RULE_MESSAGE)
        _check_extra_args_total(self.extra_args)
        return self


class ReplicasSpec(ApiModel):
    """Bounds for a pool's replica count. The autoscaler picks a count in [min, max];
    without autoscaling the pool runs min replicas."""

    min: int = Field(default=1, ge=1, le=1024, description="Fewest replicas.")
    max: int = Field(default=4, ge=1, le=1024, description="Most replicas.")

    @model_validator(mode="after")
    def _min_le_max(self) -> ReplicasSpec:
        if self.min > self.max:
            raise ValueError(REPLICAS_RULE_MESSAGE)
        return self


class ResourcesSpec(ApiModel):
    """Resources of one replica of the pool: one pod, or a group of pods on several nodes."""

    gpus: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICA_GPUS,
        description="GPUs of one replica (nvidia.com/gpu). 0: run on CPU.",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICA_GPUS,
        description=(
            "GPUs per pod. Empty: gpus. Below gpus: a replica is gpus/gpusPerNode pods on as many "
            "nodes (a LeaderWorkerSet). Fixed at creation."
        ),
    )
    cpu: CpuQuantity | None = Field(
        default=None, description=f'CPU request, e.g. 4 or "500m": above 0, at most {MAX_CPU}.'
    )
    memory: MemoryQuantity | None = Field(
        default=None, description=f'Memory request and limit, e.g. "32Gi": above 0, at most {MAX_MEMORY}.'
    )

    @model_validator(mode="after")
    def _gpus_per_node_fits(self) -> ResourcesSpec:
        if self.gpus_per_node is not None and (self.gpus == 0 or self.gpus % self.gpus_per_node != 0):
            raise ValueError(GPUS_PER_NODE_RULE_MESSAGE)
        return self

    @property
    def multi_node(self) -> bool:
        """Whether a replica is a group of several pods (a LeaderWorkerSet)."""
        return self.gpus_per_node is not None and self.gpus_per_node < self.gpus

    @property
    def gpus_per_pod(self) -> int:
        """GPUs of each pod (gpusPerNode when set, else gpus)."""
        return self.gpus_per_node if self.gpus_per_node is not None and self.gpus > 0 else self.gpus

    @property
    def pods_per_replica(self) -> int:
        """Pods of one replica: gpus / gpusPerNode (1 for a one-pod replica)."""
        return self.gpus // self.gpus_per_pod if self.multi_node else 1


class ParallelismSpec(ApiModel):
    """How one model replica is split across its GPUs (those of one pod, or of a group of pods)."""

    tensor: TensorParallelSize = _capability_field(
        caps.TENSOR_PARALLEL_SIZE, default=1, description="Tensor-parallel size."
    )
    pipeline: PipelineParallelSize = _capability_field(
        caps.PIPELINE_PARALLEL_SIZE, default=1, description="Pipeline-parallel stages."
    )


class PoolSchedulingSpec(ApiModel):
    """A pool's own scheduler limits: each field set here replaces spec.scheduling's for this pool
    (prefill pools usually want a larger token budget, decode pools more sequences per step)."""

    max_num_seqs: int | None = Field(default=None, ge=1, le=4096, description="Most sequences per engine step.")
    max_batched_tokens: int | None = Field(
        default=None, ge=16, le=1_048_576, description="Token budget per engine step."
    )
    chunked_prefill: bool | None = Field(default=None, description="Split long prompts across engine steps.")


class PoolSpec(ApiModel):
    """One pool of identical runtime pods (prefill, decode or aggregated)."""

    replicas: ReplicasSpec = _object(ReplicasSpec, "Replica bounds of the pool.")
    resources: ResourcesSpec = _object(ResourcesSpec, "Resources of a replica.")
    parallelism: ParallelismSpec = _object(ParallelismSpec, "Model parallelism of a replica.")
    node_selector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Node labels the pods must match (label keys and values).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Pod tolerations (core/v1 Toleration objects, validated with Kubernetes' schema).",
    )
    affinity: Affinity | None = Field(
        default=None,
        description="Pod affinity (a core/v1 Affinity object, validated with Kubernetes' schema; "
        "each of its lists holds at most 32 items).",
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        description="PriorityClass of the pods.",
    )
    scheduling: PoolSchedulingSpec | None = Field(
        default=None, description="This pool's scheduler limits, over spec.scheduling's. Empty: spec.scheduling's."
    )
    extra_args: list[ExtraArg] = Field(
        default_factory=list,
        max_length=MAX_EXTRA_ARGS,
        json_schema_extra={"x-kubernetes-validations": [dict(rule) for rule in EXTRA_ARGS_LIST_CEL_RULES]},
        description="Extra engine arguments of this pool, after runtime.extraArgs and bounded like them.",
    )

    @model_validator(mode="after")
    def _extra_args_total(self) -> PoolSpec:
        _check_extra_args_total(self.extra_args)
        return self

    @model_validator(mode="after")
    def _node_selector_keys(self) -> PoolSpec:
        bad = [k for k in self.node_selector if not re.fullmatch(LABEL_KEY_PATTERN, k) or len(k) > MAX_LABEL_KEY_LENGTH]
        if bad:
            raise ValueError(f"{NODE_SELECTOR_RULE_MESSAGE}, got {', '.join(repr(k) for k in bad)}")
        return self

    @model_validator(mode="after")
    def _parallelism_fits(self) -> PoolSpec:
        ranks = self.parallelism.tensor * self.parallelism.pipeline
        if self.resources.gpus == 0:
            if ranks != 1:
                raise ValueError(CPU_PARALLELISM_RULE_MESSAGE)
        elif self.resources.gpus % ranks != 0:
            raise ValueError(PARALLELISM_RULE_MESSAGE)
        elif self.resources.multi_node and ranks != self.resources.gpus:
            raise ValueError(MULTI_NODE_PARALLELISM_RULE_MESSAGE)
        return self


class RouterMode(enum.StrEnum):
    """What routes client requests to the pods."""

    BUILTIN = "Builtin"
    INFERENCE_POOL = "InferencePool"


class EndpointPickerFailureMode(enum.StrEnum):
    """What the Gateway does when the endpoint picker does not answer (the InferencePool's
    ``endpointPickerRef.failureMode``)."""

    FAIL_CLOSE = "FailClose"
    FAIL_OPEN = "FailOpen"


class EndpointPickerSpec(ApiModel):
    """The endpoint picker (the Inference Extension's EPP) the operator runs for the pool."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description=(
            "Endpoint picker image. Empty: registry.k8s.io/gateway-api-inference-extension/epp:v1.2.0, "
            "the picker whose command-line flags the operator renders; another image must take "
            "the same flags."
        ),
    )


class InferencePoolSpec(ApiModel):
    """The InferencePool (``inference.networking.k8s.io/v1``) and endpoint picker that put the
    pods behind a Gateway with the Gateway API Inference Extension (router.mode InferencePool)."""

    failure_mode: EndpointPickerFailureMode = Field(
        default=EndpointPickerFailureMode.FAIL_CLOSE,
        description=(
            "What the Gateway does when the endpoint picker does not answer: FailClose refuses "
            "the request, FailOpen sends it to a pod of the pool that the Gateway picks itself."
        ),
    )
    picker: EndpointPickerSpec = _object(EndpointPickerSpec, "The endpoint picker Deployment.")


class RouterSpec(ApiModel):
    """What routes client requests to the pods: the bundled router (mode Builtin), or a Gateway
    with the Gateway API Inference Extension (mode InferencePool)."""

    mode: RouterMode = Field(
        default=RouterMode.BUILTIN,
        description=(
            "Builtin: the operator runs the OpenAI-compatible router Deployment and Service "
            "(status.endpoint). InferencePool: no router; the operator renders an InferencePool "
            "named like the InferenceService, selecting the aggregated pods (decode pods when "
            "Disaggregated), and its endpoint picker, for an HTTPRoute of your Gateway to send "
            "requests to. Fixed at creation."
        ),
    )
    replicas: int = Field(default=1, ge=1, le=64, description="Router replicas (mode Builtin).")
    policy: RoutingPolicy = Field(
        default=RoutingPolicy.PREFIX_AFFINITY,
        description="How a prefill (or aggregated) pod is chosen for a request (mode Builtin).",
    )
    session_header: str = Field(
        default="x-session-id",
        pattern=r"^[A-Za-z0-9-]+$",
        max_length=128,
        description="Request header that pins a chat session to one pod (mode Builtin).",
    )
    short_prompt_threshold: int = Field(
        default=64,
        ge=0,
        le=1_048_576,
        description=(
            "Prompts with fewer uncached tokens skip prefill and go straight to decode. 0: never (mode Builtin)."
        ),
    )
    prefill_overflow_tokens: int = Field(
        default=0,
        ge=0,
        le=16_777_216,
        description=(
            "When every prefill pod has this many prompt tokens queued, a request prefills on a "
            "decode pod with fewer queued and in flight instead (conditional disaggregation). "
            "0: never (mode Builtin)."
        ),
    )
    inference_pool: InferencePoolSpec | None = Field(
        default=None,
        description=("InferencePool and endpoint picker settings (mode InferencePool only). Empty: the defaults."),
    )

    @model_validator(mode="after")
    def _inference_pool_only_in_its_mode(self) -> RouterSpec:
        if self.inference_pool is not None and self.mode is not RouterMode.INFERENCE_POOL:
            raise ValueError(INFERENCE_POOL_SETTINGS_RULE_MESSAGE)
        if self.mode is RouterMode.INFERENCE_POOL:
            changed = router_builtin_settings_set(self.dump())
            if changed:
                raise ValueError(f"{ROUTER_BUILTIN_SETTINGS_RULE_MESSAGE} (set: {', '.join(changed)})")
        return self

    @property
    def inference_pool_settings(self) -> InferencePoolSpec:
        """``inference_pool``, or its defaults when left out."""
        return self.inference_pool if self.inference_pool is not None else InferencePoolSpec()


KVCacheDtypeName = Annotated[str, _capability(caps.KV_CACHE_DTYPE)]


class KVCacheSpec(ApiModel):
    """Paged KV cache layout and budget. blockSize and dtype are part of the compat hash."""

    block_size: BlockSize = Field(
        default=defaults.BLOCK_SIZE,
        description="Tokens per KV block.",
        json_schema_extra={"enum": list(defaults.BLOCK_SIZES)},
    )
    memory_fraction: float = Field(
        default=defaults.KV_MEMORY_FRACTION,
        gt=0,
        le=0.98,
        description="Fraction of free GPU memory, measured at start-up, given to the KV cache.",
    )
    prefix_caching: bool = Field(default=True, description="Reuse KV blocks of identical prompt prefixes.")
    dtype: KVCacheDtypeName = _capability_field(
        caps.KV_CACHE_DTYPE,
        default="auto",
        description=(
            "KV cache dtype. auto: the model's activation dtype (model.dtype). fp8: e4m3 with "
            "per-tensor K and V scales per layer (the checkpoint's calibrated k_scale/v_scale "
            "when it has them, else 1.0), half the bytes of "
            "bfloat16, so about twice the KV blocks in the same memory; needs GPUs of "
            "compute capability 8.9 or later (L4/L40, H100/H200). Prefill and decode pods with "
            "different KV dtypes are never paired."
        ),
    )


MAX_SPECULATIVE_TOKENS: Final = 16
"""Most proposals per sequence and step the runtime verifies (``--num-speculative-tokens``)."""
_SERVE_DEFAULTS: Final = ServeArgs()


class SpeculativeSpec(ApiModel):
    """Speculative decoding: cheap proposals for each decoding sequence's next tokens, checked
    together in one forward of the model. Decode and aggregated pods only."""

    method: SpeculativeMethodName = _capability_field(
        caps.SPECULATIVE_METHOD,
        default=_SERVE_DEFAULTS.speculative_method,
        description=(
            "How next tokens are proposed. none: no speculation. ngram: prompt lookup, what followed "
            "the latest earlier occurrence of the sequence's last few tokens in its prompt and output "
            "(no extra model; pays off on output that repeats its input: code edits, quoting, "
            "extraction). draft: the greedy continuation of a smaller model with the same vocabulary "
            "(draftModel). A decode step verifies a sequence's "
            "proposals in the same forward as its next token and keeps those the model agrees with: "
            "some extra compute per step for fewer steps per token, so lower inter-token latency while "
            "batches are small. Output does not change: greedy output is token for token the same, "
            "sampled output keeps the model's distribution. Applied by decode and aggregated pods; "
            "prefill pods never speculate, and prefill and decode pods pair whatever the setting."
        ),
    )
    num_tokens: int = Field(
        default=_SERVE_DEFAULTS.num_speculative_tokens,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description=(
            "Most proposals verified per sequence and decode step. More gain more when proposals "
            "are right and waste more compute when they are wrong."
        ),
    )
    max_num_seqs: int = Field(
        default=_SERVE_DEFAULTS.speculative_max_num_seqs,
        ge=1,
        le=4096,
        description=(
            "Speculate only in decode steps with at most this many decoding sequences. In larger "
            "batches the verification rows are no longer nearly free (the step turns compute-bound) "
            "and would slow every sequence, so those steps decode one token per sequence."
        ),
    )
    draft_model: str | None = Field(
        default=None,
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
        description=(
            "The proposing model of method draft (required there, refused with any other method), "
            "in the forms of model.uri: a smaller model with the model's vocabulary, loaded next to "
            "it (same dtype, its own KV cache in the same blocks) by every decode and aggregated pod."
        ),
    )

    @model_validator(mode="after")
    def _draft_model_exactly_for_draft(self) -> SpeculativeSpec:
        if self.draft_model is not None and self.method != "draft":
            raise ValueError(DRAFT_MODEL_RULE_MESSAGE)
        if self.draft_model is None and self.method == "draft":
            raise ValueError(DRAFT_METHOD_RULE_MESSAGE)
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class SchedulingSpec(ApiModel):
    """Scheduler limits of every pool's engine (a pool's own scheduling replaces them field by
    field), and speculative decoding."""

    max_num_seqs: int = Field(
        default=defaults.MAX_NUM_SEQS, ge=1, le=4096, description="Most sequences per engine step."
    )
    max_batched_tokens: int = Field(
        default=defaults.MAX_NUM_BATCHED_TOKENS, ge=16, le=1_048_576, description="Token budget per engine step."
    )
    chunked_prefill: bool = Field(default=True, description="Split long prompts across engine steps.")
    speculative: SpeculativeSpec = _object(
        SpeculativeSpec, "Speculative decoding on decode and aggregated pods (prefill pods never speculate)."
    )


class PrefillScalingSpec(ApiModel):
    """Scaling targets of the prefill (or aggregated) pool, per pod."""

    target_queue_depth: float = Field(default=4, gt=0, le=10_000, description="Waiting requests per pod to aim for.")
    target_prompt_tokens_waiting: int | None = Field(
        default=None,
        ge=1,
        description="Uncached prompt tokens waiting per pod to aim for. Empty: not used.",
    )


class DecodeScalingSpec(ApiModel):
    """Scaling targets of the decode pool, per pod."""

    target_kv_cache_utilization: float = Field(
        default=0.8,
        validation_alias="targetKVCacheUtilization",
        serialization_alias="targetKVCacheUtilization",
        gt=0,
        le=1,
        description="KV cache usage ratio per pod to aim for.",
    )
    target_queue_depth: float = Field(default=2, gt=0, le=10_000, description="Waiting requests per pod to aim for.")


class ScaleUpBehavior(ApiModel):
    """How fast a pool may grow."""

    stabilization_seconds: int = Field(
        default=0, ge=0, le=3600, description="Use the lowest recommendation of this window."
    )
    max_step_percent: int = Field(
        default=100,
        ge=1,
        le=1000,
        description="Largest growth per decision, percent of current replicas (at least one pod).",
    )


class ScaleDownBehavior(ApiModel):
    """How fast a pool may shrink."""

    stabilization_seconds: int = Field(
        default=300, ge=0, le=3600, description="Use the highest recommendation of this window."
    )
    max_step: int = Field(default=1, ge=1, le=1024, description="Most pods removed per decision.")


class ScalingBehavior(ApiModel):
    """Rate limits of scaling decisions."""

    scale_up: ScaleUpBehavior = _object(ScaleUpBehavior, "Scale-up limits.")
    scale_down: ScaleDownBehavior = _object(ScaleDownBehavior, "Scale-down limits.")


_MAX_PRIOR: Final = defaults.SLO_MAX_COEFFICIENT_SECONDS


class SloPriorSpec(ApiModel):
    """Step-model coefficients the online fit starts from, in seconds per unit (``splitserve plan --slo`` prints them)."""

    step: float = Field(ge=0, le=_MAX_PRIOR, allow_inf_nan=False, description="Per engine step.")
    prefill_token: float = Field(ge=0, le=_MAX_PRIOR, allow_inf_nan=False, description="Per uncached prompt token.")
    prefill_pair: float = Field(
        ge=0, le=_MAX_PRIOR, allow_inf_nan=False, description="Per causal pair of prefill attention."
    )
    decode_row: float = Field(ge=0, le=_MAX_PRIOR, allow_inf_nan=False, description="Per decoding sequence in a step.")
    decode_context: float = Field(
        ge=0, le=_MAX_PRIOR, allow_inf_nan=False, description="Per context token a decoding sequence reads."
    )


class SloSpec(ApiModel):
    """Latency objectives the pools are scaled to meet; the per-pool targets become floors."""

    ttft_p99: str = Field(
        validation_alias="ttftP99",
        serialization_alias="ttftP99",
        pattern=DURATION_PATTERN,
        max_length=32,
        description="Time to first token to meet, e.g. 500ms.",
    )
    itl_p99: str = Field(
        validation_alias="itlP99",
        serialization_alias="itlP99",
        pattern=DURATION_PATTERN,
        max_length=32,
        description="Inter-token latency to meet, e.g. 50ms.",
    )
    attainment: float = Field(default=0.99, gt=0.5, lt=1, description="Fraction of requests meeting both.")
    headroom: float = Field(default=0.8, gt=0, le=1, description="Size the pools for the load divided by this.")
    prior: SloPriorSpec | None = Field(default=None, description="Starting model. Empty: measured latency only.")

    @model_validator(mode="after")
    def _targets_are_positive(self) -> SloSpec:
        if parse_duration_seconds(self.ttft_p99) <= 0 or parse_duration_seconds(self.itl_p99) <= 0:
            raise ValueError(SLO_TARGETS_RULE_MESSAGE)
        return self

    @property
    def ttft_p99_seconds(self) -> float:
        return parse_duration_seconds(self.ttft_p99)

    @property
    def itl_p99_seconds(self) -> float:
        return parse_duration_seconds(self.itl_p99)


class AutoscalingSpec(ApiModel):
    """Metric-driven scaling of prefill and decode, decided jointly."""

    enabled: bool = Field(default=True, description="Scale the pools between replicas.min and replicas.max.")
    dry_run: bool = Field(
        default=False,
        description="Compute and record decisions in status without changing replicas.",
    )
    interval: str = Field(
        default=defaults.AUTOSCALING_INTERVAL,
        pattern=DURATION_PATTERN,
        max_length=32,
        description="Time between decisions, e.g. 15s or 1m: 1s to 24h.",
    )
    prefill: PrefillScalingSpec = _object(PrefillScalingSpec, "Targets for the prefill (and aggregated) pool.")
    decode: DecodeScalingSpec = _object(DecodeScalingSpec, "Targets for the decode pool.")
    behavior: ScalingBehavior = _object(ScalingBehavior, "Rate limits.")
    tolerance: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="No change while |observed/target - 1| is within this fraction.",
    )
    gpu_budget: int | None = Field(
        default=None,
        ge=0,
        le=100_000,
        description="Most GPUs all pools may use together. Empty: no joint cap.",
    )
    slo: SloSpec | None = Field(default=None, description="Scale on p99 TTFT and ITL. Empty: targets only.")

    @model_validator(mode="after")
    def _interval_is_long_enough(self) -> AutoscalingSpec:
        if (
            not MIN_AUTOSCALING_INTERVAL_SECONDS
            <= parse_duration_seconds(self.interval)
            <= MAX_AUTOSCALING_INTERVAL_SECONDS
        ):
            raise ValueError(INTERVAL_RULE_MESSAGE)
        return self

    @property
    def interval_seconds(self) -> float:
        """``interval`` in seconds."""
        return parse_duration_seconds(self.interval)


class InferenceServiceSpec(ApiModel):
    """Desired state of an InferenceService."""

    model: ModelSpec = Field(description="The model to serve.")
    runtime: RuntimeSpec = _object(RuntimeSpec, "The runtime container.")
    mode: Mode = Field(
        default=Mode.DISAGGREGATED,
        description="Disaggregated: separate prefill and decode pools. Aggregated: one pool does both. "
        "Fixed at creation.",
    )
    prefill: PoolSpec | None = Field(
        default=None, description="Prefill pool (Disaggregated mode only; required there)."
    )
    decode: PoolSpec | None = Field(default=None, description="Decode pool (Disaggregated mode only; required there).")
    aggregated: PoolSpec | None = Field(
        default=None, description="The single pool (Aggregated mode only; required there)."
    )
    router: RouterSpec = _object(RouterSpec, "The router.")
    kv_cache: KVCacheSpec = _object(KVCacheSpec, "KV cache settings of every pool.")
    scheduling: SchedulingSpec | None = Field(
        default=None,
        description="Scheduler settings of every pool (a pool's scheduling overrides them; speculative "
        "decoding: decode and aggregated pools). Empty: the defaults, or the deprecated spec.engine.",
    )
    engine: SchedulingSpec | None = Field(
        default=None,
        description="Deprecated: the old name of spec.scheduling, still honoured when spec.scheduling is "
        "empty (objects written before the rename keep working); spec.scheduling wins when both are set.",
    )
    autoscaling: AutoscalingSpec = _object(AutoscalingSpec, "Autoscaling of the pools.")

    @model_validator(mode="after")
    def _cross_field(self) -> InferenceServiceSpec:
        if self.mode is Mode.DISAGGREGATED and not (
            self.prefill is not None and self.decode is not None and self.aggregated is None
        ):
            raise ValueError(DISAGGREGATED_RULE_MESSAGE)
        if self.mode is Mode.AGGREGATED and not (
            self.aggregated is not None and self.prefill is None and self.decode is None
        ):
            raise ValueError(AGGREGATED_RULE_MESSAGE)
        if self.mode is Mode.AGGREGATED and self.router.prefill_overflow_tokens != 0:
            raise ValueError(PREFILL_OVERFLOW_AGGREGATED_RULE_MESSAGE)
        budget = self.autoscaling.gpu_budget
        if budget is not None:
            floor = sum(p.replicas.min * p.resources.gpus for p in (self.prefill, self.decode, self.aggregated) if p)
            if budget < floor:
                raise ValueError(f"{GPU_BUDGET_RULE_MESSAGE} (budget {budget}, minimum use {floor})")
        if self.model.hub_endpoint is None:
            downloads = hub_policy.default_endpoint_problems(
                [self.model.uri, self.scheduling_settings.speculative.draft_model or ""]
            )
            if downloads:
                raise ValueError(
                    f"model.hubEndpoint is empty, so hf:// models come from {hub_policy.DEFAULT_HUB_ENDPOINT}: "
                    + "; ".join(downloads)
                )
        if self.scheduling_settings.speculative.method == "draft":
            pools: dict[str, PoolSpec | None] = {name: getattr(self, name) for name in SPECULATING_POOLS}
            split = [
                f"{name}.parallelism.{axis} {size}"
                for name, pool in pools.items()
                if pool is not None
                for axis, size in (("tensor", pool.parallelism.tensor), ("pipeline", pool.parallelism.pipeline))
                if size > 1
            ]
            if split:
                raise ValueError(f"{DRAFT_TENSOR_PARALLEL_RULE_MESSAGE} ({', '.join(split)})")
        engine_problems = engine_rules.problems(self._engine_request())
        if engine_problems:
            raise ValueError("; ".join(engine_problems))
        return self

    @property
    def pools(self) -> dict[str, PoolSpec]:
        """The runtime pools this spec names, by their field name (prefill, decode, aggregated)."""
        named = {"prefill": self.prefill, "decode": self.decode, "aggregated": self.aggregated}
        return {name: pool for name, pool in named.items() if pool is not None}

    @property
    def scheduling_settings(self) -> SchedulingSpec:
        """spec.scheduling, else the deprecated spec.engine, else the defaults."""
        return self.scheduling or self.engine or SchedulingSpec()

    def pool_scheduling(self, pool: PoolSpec) -> PoolScheduling:
        """The scheduler limits ``pool``'s pods run with: its own, else the service's."""
        service = self.scheduling_settings
        own = pool.scheduling or PoolSchedulingSpec()
        return PoolScheduling(
            max_num_seqs=own.max_num_seqs if own.max_num_seqs is not None else service.max_num_seqs,
            max_batched_tokens=(
                own.max_batched_tokens if own.max_batched_tokens is not None else service.max_batched_tokens
            ),
            chunked_prefill=own.chunked_prefill if own.chunked_prefill is not None else service.chunked_prefill,
        )

    def _engine_request(self) -> engine_rules.EngineRequest:
        speculative = self.scheduling_settings.speculative
        return engine_rules.EngineRequest(
            engine=self.runtime.engine,
            quantization=self.model.quantization,
            mode=self.mode.value,
            router_mode=self.router.mode.value,
            multi_node=any(pool.resources.multi_node for pool in self.pools.values()),
            model_uris=[self.model.uri, speculative.draft_model or ""],
            speculative_max_num_seqs_set=speculative.max_num_seqs != _SERVE_DEFAULTS.speculative_max_num_seqs,
            extra_args=[*self.runtime.extra_args, *(a for pool in self.pools.values() for a in pool.extra_args)],
            slo=self.autoscaling.slo is not None,
            prompt_tokens_target=self.autoscaling.prefill.target_prompt_tokens_waiting is not None,
            block_size=self.kv_cache.block_size,
            cpu_pools=any(pool.resources.gpus == 0 for pool in self.pools.values()),
        )


@dataclasses.dataclass(frozen=True)
class PoolScheduling:
    """A pool's resolved scheduler limits (:meth:`InferenceServiceSpec.pool_scheduling`)."""

    max_num_seqs: int
    max_batched_tokens: int
    chunked_prefill: bool
