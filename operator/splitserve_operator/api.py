"""The InferenceService API (``splitserve.dev/v1alpha1``) as pydantic models.

These models are the single source of the API: :mod:`splitserve_operator.crdgen` turns
them into the CRD's structural OpenAPI schema (defaults, enums, bounds, patterns and the
CEL rules in :data:`SPEC_CEL_RULES` and friends), and the controller and the autoscaler
parse objects into them with :meth:`InferenceService.parse`. The cross-field rules are
written twice on purpose: once as CEL (the API server rejects bad objects with the
message) and once as pydantic validators with the *same* messages (so the operator never
acts on an object that slipped past an older CRD, and tests need no cluster).

JSON names are camelCase (``alias``); Python attributes are snake_case
(``populate_by_name`` accepts both). Serialise with :meth:`ApiModel.dump`.

Replica ownership: the spec holds only ``replicas.min``/``replicas.max``. The current
replica count lives on the child Deployments, written by the autoscaler's field manager.
"""

from __future__ import annotations

import datetime
import enum
import re
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from splitserve_contract import (
    API_GROUP,
    API_VERSION,
    KIND,
    ConditionType,
    Reason,
    Role,
    RoutingPolicy,
    defaults,
)
from splitserve_contract import capabilities as caps

from .naming import MAX_NAME_LENGTH, NAME_PATTERN, child_name

__all__ = [
    "API_VERSION_STRING",
    "MAX_SCALING_HISTORY",
    "ApiModel",
    "AutoscalingSpec",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "InvalidSpecError",
    "Mode",
    "PoolSpec",
    "PoolStatus",
    "Reason",
    "ScalingDecision",
    "ScalingEvent",
    "child_name",
    "parse_duration_seconds",
    "pool_names",
    "pool_spec",
    "utc_now",
]

API_VERSION_STRING: Final = f"{API_GROUP}/{API_VERSION}"
MAX_SCALING_HISTORY: Final = 20
"""status.scalingHistory keeps the most recent N scaling events."""

DURATION_PATTERN: Final = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

MODEL_URI_PATTERN: Final = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?"
    r"|file:///[^\s]*)$"
)
QUANTITY_PATTERN: Final = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
ENV_NAME_PATTERN: Final = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
K8S_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def parse_duration_seconds(value: str) -> float:
    """Seconds in a Go-style duration such as ``15s``, ``1m30s`` or ``500ms``."""
    if not re.fullmatch(DURATION_PATTERN, value):
        raise ValueError(f"invalid duration {value!r}: use e.g. 15s, 1m30s, 500ms")
    return sum(float(n) * _DURATION_UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))


def utc_now() -> datetime.datetime:
    """Current time in UTC with whole seconds (Kubernetes timestamps are RFC 3339 seconds)."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _quantity(value: object) -> object:
    # YAML `cpu: 2` arrives as an int; Kubernetes quantities are int-or-string.
    if isinstance(value, bool):
        return value  # rejected by the str type below
    if isinstance(value, int):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
"""A Kubernetes resource quantity (``2``, ``"500m"``, ``"16Gi"``)."""

FreeFormObject = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""A Kubernetes core object passed through to pod specs unchanged (affinity, toleration)."""


class ApiModel(BaseModel):
    """Base of every API model: camelCase JSON names, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )

    def dump(self) -> dict[str, Any]:
        """The object as Kubernetes JSON: camelCase keys, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class _StatusModel(ApiModel):
    """Status is written by the operator; tolerate fields a newer operator added."""

    model_config = ConfigDict(extra="ignore")


def _object(model: type[ApiModel], description: str) -> Any:
    """A nested object field whose CRD default is the model's full default value, so the
    API server fills it in even when the user leaves the whole object out (and CEL rules
    on the object see complete defaults)."""
    return Field(
        default_factory=model,
        description=description,
        json_schema_extra={"default": _without_empty(model().dump())},
    )


def _without_empty(value: Any) -> Any:
    if isinstance(value, dict):
        items = {k: _without_empty(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v not in ([], {})}
    return value


def _capability(capability: caps.Capability) -> AfterValidator:
    """Refuse a value the API knows but this version does not serve, with the capabilities
    table's message (the CRD carries the same rule as CEL, :func:`capability_cel_rule`)."""

    def check(value: Any) -> Any:
        if value not in capability.known:
            *head, last = [str(v) for v in capability.known]
            raise ValueError(f"Input should be {', '.join(head)} or {last}")
        capability.check(value)
        return value

    return AfterValidator(check)


def _capability_field(capability: caps.Capability, *, default: str | int, description: str) -> Any:
    """A field whose enum is every value the API knows (``capability.known``)."""
    supported = ", ".join(str(v) for v in capability.supported)
    return Field(
        default=default,
        description=f"{description} Supported by this version: {supported}.",
        json_schema_extra={"enum": list(capability.known)},
    )


QuantizationName = Annotated[str, _capability(caps.QUANTIZATION)]
DtypeName = Annotated[str, _capability(caps.DTYPE)]
TensorParallelSize = Annotated[int, _capability(caps.TENSOR_PARALLEL_SIZE)]
PipelineParallelSize = Annotated[int, _capability(caps.PIPELINE_PARALLEL_SIZE)]


def _block_size(value: int) -> int:
    if value not in defaults.BLOCK_SIZES:
        *head, last = (str(b) for b in defaults.BLOCK_SIZES)
        raise ValueError(f"Input should be {', '.join(head)} or {last}")
    return value


BlockSize = Annotated[int, AfterValidator(_block_size)]


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
            "Model location: hf://org/name (resolved in the runtime's model cache, "
            "SPLITSERVE_MODEL_CACHE), pvc://claim/path (mounted read-only) or "
            "file:///absolute/path (a path on the node)."
        ),
    )
    revision: str | None = Field(
        default=None,
        max_length=255,
        pattern=r"^[A-Za-z0-9._/-]+$",
        description="Model revision (branch, tag or commit) for hf:// URIs. Empty: the default revision.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=255,
        pattern=r"^[A-Za-z0-9._/:-]+$",
        description="Name clients put in the OpenAI `model` field. Empty: the InferenceService name.",
    )
    dtype: DtypeName = _capability_field(
        caps.DTYPE, default="auto",
        description="Weight and activation dtype. auto: bfloat16 on GPUs that support it, else the model's dtype.",
    )
    quantization: QuantizationName = _capability_field(
        caps.QUANTIZATION, default="none", description="Weight quantization applied at load time."
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
            "Secret with a model hub token, passed to the runtime as an environment variable. "
            "Not supported by this version: hf:// models are read from the runtime's model "
            "cache and never downloaded, so the API refuses this field until downloads land."
        ),
    )

    @model_validator(mode="after")
    def _hub_token_needs_downloads(self) -> ModelSpec:
        if self.hub_token_secret_ref is not None and not caps.HF_DOWNLOAD_SUPPORTED:
            raise ValueError(HUB_TOKEN_RULE_MESSAGE)
        return self


class ApiKeySecretRef(ApiModel):
    """A key in a Secret in the InferenceService's namespace that holds the API key clients
    must present. The Secret is referenced in the pod spec, never read by the operator."""

    name: str = Field(pattern=K8S_NAME_PATTERN, max_length=253, description="Name of the Secret.")
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253,
                     description="Key inside the Secret that holds the API key.")


class EnvVar(ApiModel):
    """A plain environment variable for the runtime container."""

    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=256, description="Variable name.")
    value: str = Field(default="", max_length=32768, description="Variable value.")


class RuntimeSpec(ApiModel):
    """The runtime container shared by all pools."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Runtime image. Empty: the operator's default runtime image (--runtime-image).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy. Empty: the Kubernetes default."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables for every runtime and router container.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra `splitserve serve` arguments appended after the rendered ones.",
    )
    api_key_secret_ref: ApiKeySecretRef | None = Field(
        default=None,
        description="Secret with the API key the router and runtime require from clients, passed to "
                    "them as an environment variable. The Secret is referenced in the pod spec, never "
                    "read by the operator. Empty: no API key is required.",
    )


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
    """Resources of one pod of the pool."""

    gpus: int = Field(
        default=1,
        ge=0,
        le=8,
        description="GPUs per pod (nvidia.com/gpu request and limit). 0: run on CPU.",
    )
    cpu: Quantity | None = Field(default=None, description="CPU request, e.g. 4 or \"500m\".")
    memory: Quantity | None = Field(default=None, description="Memory request and limit, e.g. \"32Gi\".")


class ParallelismSpec(ApiModel):
    """How one model replica is split across the GPUs of a pod."""

    tensor: TensorParallelSize = _capability_field(
        caps.TENSOR_PARALLEL_SIZE, default=1, description="Tensor-parallel size.")
    pipeline: PipelineParallelSize = _capability_field(
        caps.PIPELINE_PARALLEL_SIZE, default=1, description="Pipeline-parallel stages.")


class PoolSpec(ApiModel):
    """One pool of identical runtime pods (prefill, decode or aggregated)."""

    replicas: ReplicasSpec = _object(ReplicasSpec, "Replica bounds of the pool.")
    resources: ResourcesSpec = _object(ResourcesSpec, "Resources of each pod.")
    parallelism: ParallelismSpec = _object(ParallelismSpec, "Model parallelism inside each pod.")
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Node labels the pods must match.",
    )
    tolerations: list[FreeFormObject] = Field(
        default_factory=list,
        max_length=32,
        description="Pod tolerations (core/v1 Toleration objects).",
    )
    affinity: FreeFormObject | None = Field(
        default=None, description="Pod affinity (a core/v1 Affinity object)."
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        description="PriorityClass of the pods.",
    )

    @model_validator(mode="after")
    def _parallelism_fits(self) -> PoolSpec:
        if self.resources.gpus == 0:
            if self.parallelism.tensor * self.parallelism.pipeline != 1:
                raise ValueError(CPU_PARALLELISM_RULE_MESSAGE)
        elif self.resources.gpus % (self.parallelism.tensor * self.parallelism.pipeline) != 0:
            raise ValueError(PARALLELISM_RULE_MESSAGE)
        return self


class RouterSpec(ApiModel):
    """The OpenAI-compatible router in front of the pools."""

    replicas: int = Field(default=1, ge=1, le=64, description="Router replicas.")
    policy: RoutingPolicy = Field(
        default=RoutingPolicy.PREFIX_AFFINITY,
        description="How a prefill (or aggregated) pod is chosen for a request.",
    )
    session_header: str = Field(
        default="x-session-id",
        pattern=r"^[A-Za-z0-9-]+$",
        max_length=128,
        description="Request header that pins a chat session to one pod.",
    )
    short_prompt_threshold: int = Field(
        default=64,
        ge=0,
        le=1_048_576,
        description="Prompts with fewer uncached tokens skip prefill and go straight to decode. 0: never.",
    )


class KVCacheSpec(ApiModel):
    """Paged KV cache layout and budget. blockSize is part of the compat hash."""

    block_size: BlockSize = Field(default=defaults.BLOCK_SIZE, description="Tokens per KV block.",
                            json_schema_extra={"enum": list(defaults.BLOCK_SIZES)})
    memory_fraction: float = Field(
        default=defaults.KV_MEMORY_FRACTION,
        gt=0,
        le=0.98,
        description="Fraction of free GPU memory, measured at start-up, given to the KV cache.",
    )
    prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of identical prompt prefixes."
    )


class EngineSpec(ApiModel):
    """Scheduler limits of each runtime engine."""

    max_num_seqs: int = Field(default=defaults.MAX_NUM_SEQS, ge=1, le=4096, description="Most sequences per engine step.")
    max_batched_tokens: int = Field(
        default=defaults.MAX_NUM_BATCHED_TOKENS, ge=16, le=1_048_576, description="Token budget per engine step."
    )
    chunked_prefill: bool = Field(default=True, description="Split long prompts across engine steps.")


class PrefillScalingSpec(ApiModel):
    """Scaling targets of the prefill (or aggregated) pool, per pod."""

    target_queue_depth: float = Field(
        default=4, gt=0, le=10_000, description="Waiting requests per pod to aim for."
    )
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
    target_queue_depth: float = Field(
        default=2, gt=0, le=10_000, description="Waiting requests per pod to aim for."
    )


class ScaleUpBehavior(ApiModel):
    """How fast a pool may grow."""

    stabilization_seconds: int = Field(
        default=0, ge=0, le=3600, description="Use the lowest recommendation of this window."
    )
    max_step_percent: int = Field(
        default=100, ge=1, le=1000, description="Largest growth per decision, percent of current replicas (at least one pod)."
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
        description="Time between decisions, e.g. 15s or 1m.",
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
        description="Disaggregated: separate prefill and decode pools. Aggregated: one pool does both.",
    )
    prefill: PoolSpec | None = Field(
        default=None, description="Prefill pool (Disaggregated mode only; required there)."
    )
    decode: PoolSpec | None = Field(
        default=None, description="Decode pool (Disaggregated mode only; required there)."
    )
    aggregated: PoolSpec | None = Field(
        default=None, description="The single pool (Aggregated mode only; required there)."
    )
    router: RouterSpec = _object(RouterSpec, "The router.")
    kv_cache: KVCacheSpec = _object(KVCacheSpec, "KV cache settings of every pool.")
    engine: EngineSpec = _object(EngineSpec, "Engine scheduler settings of every pool.")
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
        budget = self.autoscaling.gpu_budget
        if budget is not None:
            floor = sum(p.replicas.min * p.resources.gpus for p in (self.prefill, self.decode, self.aggregated) if p)
            if budget < floor:
                raise ValueError(f"{GPU_BUDGET_RULE_MESSAGE} (budget {budget}, minimum use {floor})")
        return self


# =========================================================================== status
class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_StatusModel):
    """One observation about the object (Kubernetes API conventions)."""

    type: str = Field(max_length=316, pattern=r"^[A-Za-z][A-Za-z0-9]*$", description="Condition type, e.g. Ready.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason for the last transition.",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable details.")
    last_transition_time: datetime.datetime = Field(
        description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was computed from."
    )


class ScalingDecision(_StatusModel):
    """The autoscaler's last computation for one pool, kept so it can be explained."""

    time: datetime.datetime = Field(description="When the decision was made.")
    inputs: dict[str, float] = Field(
        default_factory=dict,
        max_length=32,
        description="Observed values and targets the formula used, by name.",
    )
    formula: str = Field(default="", max_length=1024, description="The formula, with values substituted.")
    result: int = Field(ge=0, description="Replica count the decision asked for.")
    reason: str = Field(max_length=1024, description="CamelCase reason, e.g. ScaledUp or WithinTolerance.")


class PoolStatus(_StatusModel):
    """Observed state of one pool's Deployment."""

    replicas: int = Field(default=0, ge=0, description="Pods that exist.")
    ready_replicas: int = Field(default=0, ge=0, description="Pods that are ready.")
    desired_replicas: int | None = Field(
        default=None, ge=0, description="Replicas the autoscaler (or replicas.min) asks for."
    )
    pending_replicas: int = Field(default=0, ge=0, description="Pods not yet scheduled or started.")
    last_scale_time: datetime.datetime | None = Field(
        default=None, description="When the replica count last changed."
    )
    last_decision: ScalingDecision | None = Field(
        default=None, description="The autoscaler's last decision for this pool."
    )
    summary: str = Field(
        default="",
        max_length=32,
        description="readyReplicas/desiredReplicas, for kubectl get. Derived; do not set.",
    )

    @model_validator(mode="after")
    def _derive_summary(self) -> PoolStatus:
        desired = self.desired_replicas if self.desired_replicas is not None else self.replicas
        object.__setattr__(self, "summary", f"{self.ready_replicas}/{desired}")
        return self


class ScalingEvent(_StatusModel):
    """One replica change (or dry-run recommendation) of a pool."""

    time: datetime.datetime = Field(description="When it happened.")
    pool: Literal["prefill", "decode", "aggregated"] = Field(description="The pool.")
    from_replicas: int = Field(validation_alias="from", serialization_alias="from", ge=0, description="Replicas before.")
    to_replicas: int = Field(validation_alias="to", serialization_alias="to", ge=0, description="Replicas after.")
    reason: str = Field(max_length=1024, description="CamelCase reason.")


class InferenceServiceStatus(_StatusModel):
    """Observed state of an InferenceService."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the status was computed from."
    )
    endpoint: str | None = Field(
        default=None, max_length=1024, description="In-cluster URL of the OpenAI-compatible API."
    )
    compat_hash: str | None = Field(
        default=None,
        max_length=64,
        description="Compatibility hash of the current runtime pods (image, model, KV layout).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Ready, Reconciling, Stalled, MetricsHealthy and ScalingActive.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    prefill: PoolStatus | None = Field(default=None, description="The prefill pool.")
    decode: PoolStatus | None = Field(default=None, description="The decode pool.")
    aggregated: PoolStatus | None = Field(default=None, description="The aggregated pool.")
    router: PoolStatus | None = Field(default=None, description="The router.")
    scaling_history: list[ScalingEvent] = Field(
        default_factory=list,
        max_length=MAX_SCALING_HISTORY,
        description=f"The last {MAX_SCALING_HISTORY} scaling events, oldest first.",
    )

    def condition(self, type_: ConditionType | str) -> Condition | None:
        """The condition of this type, if set."""
        wanted = ConditionType(type_).value if isinstance(type_, ConditionType) else type_
        return next((c for c in self.conditions if c.type == wanted), None)


# =========================================================================== object
class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads; everything else is kept as is."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str = Field(description="Object name.")
    namespace: str | None = Field(default=None, description="Namespace.")
    uid: str | None = Field(default=None, description="Object UID.")
    generation: int | None = Field(default=None, description="Spec generation.")
    resource_version: str | None = Field(default=None, description="Resource version.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


class InvalidSpecError(ValueError):
    """An InferenceService that does not satisfy the API. ``errors`` holds one
    ``path: problem`` line per violation."""

    def __init__(self, subject: str, errors: list[str]) -> None:
        self.errors = errors
        super().__init__(f"{subject} is invalid: " + "; ".join(errors))


_PATTERN_HINTS: Final = {
    MODEL_URI_PATTERN: "must be hf://org/name, pvc://claim/path or file:///absolute/path",
    DURATION_PATTERN: "must be a duration such as 15s, 1m30s or 500ms",
    QUANTITY_PATTERN: "must be a Kubernetes quantity such as 2, 500m or 16Gi",
    ENV_NAME_PATTERN: "must be a valid environment variable name",
    K8S_NAME_PATTERN: "must be a lowercase Kubernetes object name",
}


def _format_errors(exc: ValidationError, prefix: str) -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        path = prefix
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "string_pattern_mismatch":
            pattern = (err.get("ctx") or {}).get("pattern", "")
            msg = f"{_PATTERN_HINTS.get(pattern, f'must match {pattern}')}, got {err['input']!r}"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{path}: {msg}" if path else msg)
    return lines


def _plain(value: Any) -> Any:
    """Deep-copy Mapping/sequence views (kopf bodies) into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class InferenceService(BaseModel):
    """A whole InferenceService object as read from the API server."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: Literal["splitserve.dev/v1alpha1"] = Field(
        default="splitserve.dev/v1alpha1", description="splitserve.dev/v1alpha1"
    )
    kind: Literal["InferenceService"] = Field(default="InferenceService", description=KIND)
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: InferenceServiceSpec = Field(description="Desired state.")
    status: InferenceServiceStatus = Field(
        default_factory=InferenceServiceStatus, description="Observed state."
    )

    @model_validator(mode="after")
    def _name_fits(self) -> InferenceService:
        if len(self.metadata.name) > MAX_NAME_LENGTH:
            raise ValueError(NAME_LENGTH_RULE_MESSAGE)
        if not re.fullmatch(NAME_PATTERN, self.metadata.name):
            raise ValueError(NAME_PATTERN_RULE_MESSAGE)
        return self

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> InferenceService:
        """Validate a full object (dict or kopf body). Raises :class:`InvalidSpecError`
        with readable ``spec.path: problem`` lines."""
        data = _plain(obj)
        meta = data.get("metadata") if isinstance(data, dict) else None
        name = meta.get("name", "?") if isinstance(meta, dict) else "?"
        ns = meta.get("namespace") if isinstance(meta, dict) else None
        subject = f"InferenceService {ns}/{name}" if ns else f"InferenceService {name}"
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise InvalidSpecError(subject, _format_errors(exc, "")) from None

    @staticmethod
    def parse_spec(spec: Mapping[str, Any], *, subject: str = "InferenceService") -> InferenceServiceSpec:
        """Validate only a spec (kopf's ``spec`` argument)."""
        try:
            return InferenceServiceSpec.model_validate(_plain(spec))
        except ValidationError as exc:
            raise InvalidSpecError(subject, _format_errors(exc, "spec")) from None

    def dump(self) -> dict[str, Any]:
        """The object as Kubernetes JSON."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# =========================================================================== helpers
def pool_names(spec: InferenceServiceSpec) -> list[str]:
    """Runtime pools present in this mode, as Role values: ``["prefill", "decode"]``
    or ``["aggregated"]`` (the router is not a pool)."""
    if spec.mode is Mode.AGGREGATED:
        return [Role.AGGREGATED.value]
    return [Role.PREFILL.value, Role.DECODE.value]


def pool_spec(spec: InferenceServiceSpec, role: Role | str) -> PoolSpec:
    """The PoolSpec of one present pool; ValueError if the mode has no such pool."""
    pool = {
        Role.PREFILL: spec.prefill,
        Role.DECODE: spec.decode,
        Role.AGGREGATED: spec.aggregated,
    }.get(Role(role))
    if pool is None:
        raise ValueError(f"mode {spec.mode.value} has no {Role(role).value} pool")
    return pool


# =========================================================================== CEL rules
# Messages are shared with the pydantic validators above so both paths read the same.
REPLICAS_RULE_MESSAGE: Final = "replicas.min must be less than or equal to replicas.max"
PARALLELISM_RULE_MESSAGE: Final = (
    "resources.gpus must be a multiple of parallelism.tensor * parallelism.pipeline"
)
CPU_PARALLELISM_RULE_MESSAGE: Final = (
    "resources.gpus 0 (CPU) requires parallelism.tensor 1 and parallelism.pipeline 1"
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

CelRule = dict[str, str]

ROOT_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}", "message": NAME_LENGTH_RULE_MESSAGE},
    {"rule": f"self.metadata.name.matches('{NAME_PATTERN}')", "message": NAME_PATTERN_RULE_MESSAGE},
)
_POOL_GPUS = "(has(self.{p}) ? self.{p}.replicas.min * self.{p}.resources.gpus : 0)"
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
)
def _capability_rules(*capabilities: caps.Capability) -> tuple[CelRule, ...]:
    return tuple(caps.cel_rule(c) for c in capabilities if c.supported != c.known)


HUB_TOKEN_RULE_MESSAGE: Final = (
    f"model.hubTokenSecretRef {caps.SUPPORT_NOTE}: hf:// models are not downloaded yet "
    "(pre-fill the runtime's model cache, or use pvc:// or file://)"
)
MODEL_CEL_RULES: Final[tuple[CelRule, ...]] = (
    *_capability_rules(caps.DTYPE, caps.QUANTIZATION),
    *(() if caps.HF_DOWNLOAD_SUPPORTED else
      ({"rule": "!has(self.hubTokenSecretRef)", "message": HUB_TOKEN_RULE_MESSAGE},)),
)
"""Generated from the capabilities table: known-but-unsupported values are refused with
"... is not supported by this version of splitserve"."""
PARALLELISM_CEL_RULES: Final[tuple[CelRule, ...]] = _capability_rules(
    caps.TENSOR_PARALLEL_SIZE, caps.PIPELINE_PARALLEL_SIZE)
REPLICAS_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {"rule": "self.min <= self.max", "message": REPLICAS_RULE_MESSAGE},
)
POOL_CEL_RULES: Final[tuple[CelRule, ...]] = (
    {
        "rule": "self.resources.gpus != 0 || (self.parallelism.tensor == 1 && self.parallelism.pipeline == 1)",
        "message": CPU_PARALLELISM_RULE_MESSAGE,
    },
    {
        "rule": "self.resources.gpus == 0 || self.resources.gpus % (self.parallelism.tensor * self.parallelism.pipeline) == 0",
        "message": PARALLELISM_RULE_MESSAGE,
    },
)
