"""Condition types and CamelCase reasons: the words the operator writes into
``status.conditions``, ``lastDecision.reason`` and Events. One definition each; the
reconciler, the autoscaler, the planner's simulator, the docs and the tests all use these.
"""

from __future__ import annotations

import enum
from typing import Final


class ConditionType(enum.StrEnum):
    """Condition types (kstatus-compatible Ready/Reconciling/Stalled plus our own)."""

    READY = "Ready"
    RECONCILING = "Reconciling"
    STALLED = "Stalled"
    METRICS_HEALTHY = "MetricsHealthy"
    SCALING_ACTIVE = "ScalingActive"


class Reason:
    """CamelCase reasons of conditions, scaling decisions and Events."""

    # reconciler
    RECONCILED: Final = "Reconciled"
    PROGRESSING: Final = "Progressing"
    CHILDREN_CREATED: Final = "ChildrenCreated"
    CHILDREN_UPDATED: Final = "ChildrenUpdated"
    READY: Final = "Ready"
    """Event reason when the InferenceService becomes Ready."""
    ROLLOUT_IN_PROGRESS: Final = "RolloutInProgress"
    PODS_NOT_READY: Final = "PodsNotReady"
    NAME_CONFLICT: Final = "NameConflict"
    INVALID_SPEC: Final = "InvalidSpec"
    API_ERROR: Final = "ApiError"
    PAUSED: Final = "Paused"
    INSUFFICIENT_GPU_CAPACITY: Final = "InsufficientGPUCapacity"
    UNSCHEDULABLE: Final = "Unschedulable"
    """The scheduler cannot place a pod for another cause than GPUs (memory, CPU, a
    nodeSelector or affinity no node matches, a missing PersistentVolumeClaim); the message is
    the scheduler's."""
    MODEL_UNAVAILABLE: Final = "ModelUnavailable"
    """A runtime pod exited because its model could not be loaded (message from the pod)."""
    POD_START_FAILED: Final = "PodStartFailed"
    """A runtime pod keeps exiting at start-up for another reason (message from the pod)."""
    # children's own reasons, passed into Stalled (kstatus) with the child's message
    FAILED_CREATE: Final = "FailedCreate"
    """A pool's pods cannot be created (Deployment ReplicaFailure: a missing PriorityClass,
    an exceeded quota, an admission policy)."""
    PROGRESS_DEADLINE_EXCEEDED: Final = "ProgressDeadlineExceeded"
    """A pool's rollout made no progress within the Deployment's progress deadline."""
    IMAGE_PULL_BACK_OFF: Final = "ImagePullBackOff"
    ERR_IMAGE_PULL: Final = "ErrImagePull"
    CREATE_CONTAINER_CONFIG_ERROR: Final = "CreateContainerConfigError"
    """A container cannot be configured (e.g. a referenced Secret or key does not exist)."""
    OOM_KILLED: Final = "OOMKilled"
    CHILD_FAILED: Final = "ChildFailed"
    """A child failed with a reason that is not a valid condition reason (its text is in the message)."""
    INFERENCE_POOL_CRD_MISSING: Final = "InferencePoolCRDMissing"
    """spec.router.mode InferencePool, but the cluster has no InferencePool CRD
    (inference.networking.k8s.io/v1, the Gateway API Inference Extension's): nothing can be
    routed until it is installed; the operator retries."""
    INFERENCE_POOL_DISABLED: Final = "InferencePoolDisabled"
    """spec.router.mode InferencePool, but this operator was installed without that mode (the
    chart's ``inferencePool.enabled``, off by default): it holds no permission to create the
    endpoint picker's ServiceAccount, Role and RoleBinding, so it renders and applies nothing
    for the InferenceService until it is reinstalled with the mode on."""
    LEADER_WORKER_SET_CRD_MISSING: Final = "LeaderWorkerSetCRDMissing"
    """A pool spans several nodes (resources.gpusPerNode smaller than resources.gpus), but the
    cluster has no LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1): the pool cannot be
    created until LWS is installed; the operator retries."""
    # autoscaler: conditions and Events
    ACTIVE: Final = "Active"
    METRICS_AVAILABLE: Final = "MetricsAvailable"
    METRICS_UNAVAILABLE: Final = "MetricsUnavailable"
    METRICS_HEALTHY: Final = "MetricsHealthy"
    METRICS_UNHEALTHY: Final = "MetricsUnhealthy"
    SCALING_DISABLED: Final = "ScalingDisabled"
    SCALE_FAILED: Final = "ScaleFailed"
    ROUND_FAILED: Final = "RoundFailed"
    """ScalingActive=False: an autoscaling round failed before it could report a decision (a
    number the status cannot hold, an unexpected error); the message says what failed. An API
    server's refusal is ``ApiError`` instead."""
    DRY_RUN: Final = "DryRun"
    # autoscaler: decisions (lastDecision.reason)
    WITHIN_TOLERANCE: Final = "WithinTolerance"
    SCALED_UP: Final = "ScaledUp"
    SCALED_DOWN: Final = "ScaledDown"
    AT_MIN_REPLICAS: Final = "AtMinReplicas"
    AT_MAX_REPLICAS: Final = "AtMaxReplicas"
    GPU_BUDGET_LIMITED: Final = "GpuBudgetLimited"
    PENDING_PODS: Final = "PendingPods"
    NO_READY_REPLICAS: Final = "NoReadyReplicas"
    REPLICAS_STARTING: Final = "ReplicasStarting"
    STABILIZING: Final = "Stabilizing"
    STEADY: Final = "Steady"
    QUERY_FAILED: Final = "QueryFailed"
    NO_DATA: Final = "NoData"
    STALE: Final = "Stale"
    # autoscaler: SLO controller decisions (lastDecision.reason with spec.autoscaling.slo)
    SLO_MET: Final = "SloMet"
    """The fewest replicas whose estimated p99 TTFT/ITL meet the targets at load ÷ headroom: no change needed."""
    SLO_VIOLATED: Final = "SloViolated"
    """Measured p99 TTFT or ITL exceeds the target: scaled up from the measurement (reactive)."""
    SLO_FORECAST: Final = "SloForecast"
    """The forecast load at the pod start horizon needs more replicas than the current load."""
    SLO_PREDICTED: Final = "SloPredicted"
    """The fitted model says the current (planned) load misses the SLO at the current count,
    before the measured p99 does: scaled up ahead of the miss."""
    SLO_MODEL_UNAVAILABLE: Final = "SloModelUnavailable"
    """No fitted step model yet (no prior and too few data points) or no load: hold."""
    SLO_LOW_CONFIDENCE: Final = "SloLowConfidence"
    """The model would scale down but its confidence is too low to rely on: hold."""
    SLO_SCALE_DOWN_UNSAFE: Final = "SloScaleDownUnsafe"
    """One replica fewer would miss the targets at load ÷ headroom (the N-1 check): hold."""
    SLO_UNATTAINABLE: Final = "SloUnattainable"
    """Even maxReplicas is estimated to miss the SLO: scaled to the most allowed."""
