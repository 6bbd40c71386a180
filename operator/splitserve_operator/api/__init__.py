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

The package is split by concern: :mod:`.fields` (patterns, base model, capability-bound
fields, core/v1 pod fields), :mod:`.corev1` (Kubernetes' own schemas for those, from
:mod:`.corev1_snapshot`), :mod:`.spec`, :mod:`.status`, :mod:`.resource` (the whole object, parsing, pool
helpers) and :mod:`.rules` (CEL rules and their messages); everything is importable from here.

Replica ownership: the spec holds only ``replicas.min``/``replicas.max``. The current
replica count lives on the child Deployments, written by the autoscaler's field manager.
"""

from __future__ import annotations

from splitserve_contract import ConditionType, Reason

from ..naming import child_name
from .fields import (
    API_VERSION_STRING,
    DURATION_PATTERN,
    ENV_NAME_PATTERN,
    IMAGE_PATTERN,
    K8S_NAME_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_SCALING_HISTORY,
    MODEL_URI_PATTERN,
    QUANTITY_PATTERN,
    Affinity,
    ApiModel,
    BlockSize,
    DtypeName,
    FreeFormObject,
    PipelineParallelSize,
    Quantity,
    QuantizationName,
    TensorParallelSize,
    Toleration,
    parse_duration_seconds,
    utc_now,
)
from .resource import (
    InferenceService,
    InvalidSpecError,
    ObjectMeta,
    pool_names,
    pool_spec,
)
from .rules import (
    AGGREGATED_RULE_MESSAGE,
    AUTOSCALING_CEL_RULES,
    CPU_PARALLELISM_RULE_MESSAGE,
    DISAGGREGATED_RULE_MESSAGE,
    GPU_BUDGET_RULE_MESSAGE,
    INTERVAL_RULE_MESSAGE,
    LABEL_KEY_PATTERN,
    MIN_AUTOSCALING_INTERVAL_SECONDS,
    MODEL_CEL_RULES,
    NAME_LENGTH_RULE_MESSAGE,
    NAME_PATTERN_RULE_MESSAGE,
    NODE_SELECTOR_RULE_MESSAGE,
    PARALLELISM_CEL_RULES,
    PARALLELISM_RULE_MESSAGE,
    POOL_CEL_RULES,
    REPLICAS_CEL_RULES,
    REPLICAS_RULE_MESSAGE,
    ROOT_CEL_RULES,
    SPEC_CEL_RULES,
    TOLERATION_CEL_RULES,
    TOLERATION_KEY_RULE_MESSAGE,
    TOLERATION_SECONDS_RULE_MESSAGE,
    TOLERATION_VALUE_RULE_MESSAGE,
    CelRule,
)
from .spec import (
    ApiKeySecretRef,
    AutoscalingSpec,
    DecodeScalingSpec,
    EngineSpec,
    EnvVar,
    InferenceServiceSpec,
    KVCacheSpec,
    Mode,
    ModelSpec,
    ParallelismSpec,
    PoolSpec,
    PrefillScalingSpec,
    ReplicasSpec,
    ResourcesSpec,
    RouterSpec,
    RuntimeSpec,
    ScaleDownBehavior,
    ScaleUpBehavior,
    ScalingBehavior,
    SecretKeyRef,
)
from .status import (
    Condition,
    ConditionStatus,
    InferenceServiceStatus,
    PoolStatus,
    ScalingDecision,
    ScalingEvent,
)

__all__ = [
    "Affinity",
    "IMAGE_PATTERN",
    "LABEL_KEY_PATTERN",
    "LABEL_VALUE_PATTERN",
    "NODE_SELECTOR_RULE_MESSAGE",
    "TOLERATION_CEL_RULES",
    "TOLERATION_KEY_RULE_MESSAGE",
    "TOLERATION_SECONDS_RULE_MESSAGE",
    "TOLERATION_VALUE_RULE_MESSAGE",
    "Toleration",
    "AUTOSCALING_CEL_RULES",
    "INTERVAL_RULE_MESSAGE",
    "MIN_AUTOSCALING_INTERVAL_SECONDS",
    "AGGREGATED_RULE_MESSAGE",
    "API_VERSION_STRING",
    "ApiKeySecretRef",
    "ApiModel",
    "AutoscalingSpec",
    "BlockSize",
    "CPU_PARALLELISM_RULE_MESSAGE",
    "CelRule",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "DISAGGREGATED_RULE_MESSAGE",
    "DURATION_PATTERN",
    "DecodeScalingSpec",
    "DtypeName",
    "ENV_NAME_PATTERN",
    "EngineSpec",
    "EnvVar",
    "FreeFormObject",
    "GPU_BUDGET_RULE_MESSAGE",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "InvalidSpecError",
    "K8S_NAME_PATTERN",
    "KVCacheSpec",
    "MAX_SCALING_HISTORY",
    "MODEL_CEL_RULES",
    "MODEL_URI_PATTERN",
    "Mode",
    "ModelSpec",
    "NAME_LENGTH_RULE_MESSAGE",
    "NAME_PATTERN_RULE_MESSAGE",
    "ObjectMeta",
    "PARALLELISM_CEL_RULES",
    "PARALLELISM_RULE_MESSAGE",
    "POOL_CEL_RULES",
    "ParallelismSpec",
    "PipelineParallelSize",
    "PoolSpec",
    "PoolStatus",
    "PrefillScalingSpec",
    "QUANTITY_PATTERN",
    "Quantity",
    "QuantizationName",
    "REPLICAS_CEL_RULES",
    "REPLICAS_RULE_MESSAGE",
    "ROOT_CEL_RULES",
    "Reason",
    "ReplicasSpec",
    "ResourcesSpec",
    "RouterSpec",
    "RuntimeSpec",
    "SPEC_CEL_RULES",
    "ScaleDownBehavior",
    "ScaleUpBehavior",
    "ScalingBehavior",
    "ScalingDecision",
    "ScalingEvent",
    "SecretKeyRef",
    "TensorParallelSize",
    "child_name",
    "parse_duration_seconds",
    "pool_names",
    "pool_spec",
    "utc_now",
]
