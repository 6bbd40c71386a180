"""The InferenceService status: what the operator and the autoscaler observed and decided."""

from __future__ import annotations

import datetime
import enum
from typing import Final, Literal

from pydantic import (
    Field,
    model_validator,
)

from splitserve_contract import (
    ConditionType,
)

from .fields import MAX_SCALING_HISTORY, _StatusModel

MAX_RECENT_DECISIONS: Final = 5
"""status.<pool>.recentDecisions keeps this many distinct decisions, newest first."""


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
    last_transition_time: datetime.datetime = Field(description="When status last changed (RFC 3339).")
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
    model: dict[str, float] = Field(
        default_factory=dict, max_length=32, description="SLO decisions: the model and estimates."
    )


class RecentDecision(_StatusModel):
    """One distinct decision of the autoscaler for a pool. A decision that repeats round after
    round (same reason, same from and to, same outcome) is kept once, with the time it was
    first made, so the list says what happened and why even while nothing changes."""

    time: datetime.datetime = Field(description="When the autoscaler first made this decision.")
    from_replicas: int = Field(
        validation_alias="from", serialization_alias="from", ge=0, description="Replicas the Deployment had."
    )
    to_replicas: int = Field(
        validation_alias="to", serialization_alias="to", ge=0, description="Replicas the decision asked for."
    )
    reason: str = Field(
        max_length=1024, description="CamelCase reason, e.g. ScaledUp, AtMaxReplicas or MetricsUnavailable."
    )
    applied: bool = Field(
        default=False,
        description="Whether the replica count was written (false: no change, a dry run or a failed write).",
    )
    formula: str = Field(default="", max_length=1024, description="The formula, with values substituted.")


class PickerStatus(_StatusModel):
    """Observed state of the endpoint picker's Deployment: counts only, it is not autoscaled."""

    replicas: int = Field(default=0, ge=0, description="Pods that exist.")
    ready_replicas: int = Field(default=0, ge=0, description="Pods that are ready.")
    desired_replicas: int | None = Field(default=None, ge=0, description="Replicas asked for.")
    summary: str = Field(default="", max_length=32, description="readyReplicas/desiredReplicas. Derived.")

    @model_validator(mode="after")
    def _derive_summary(self) -> PickerStatus:
        desired = self.desired_replicas if self.desired_replicas is not None else self.replicas
        object.__setattr__(self, "summary", f"{self.ready_replicas}/{desired}")
        return self


class PoolStatus(_StatusModel):
    """Observed state of one pool's Deployment."""

    replicas: int = Field(default=0, ge=0, description="Pods that exist.")
    ready_replicas: int = Field(default=0, ge=0, description="Pods that are ready.")
    desired_replicas: int | None = Field(
        default=None, ge=0, description="Replicas the autoscaler (or replicas.min) asks for."
    )
    pending_replicas: int = Field(default=0, ge=0, description="Pods not yet scheduled or started.")
    last_scale_time: datetime.datetime | None = Field(default=None, description="When the replica count last changed.")
    last_decision: ScalingDecision | None = Field(
        default=None, description="The autoscaler's last decision for this pool."
    )
    recent_decisions: list[RecentDecision] = Field(
        default_factory=list,
        max_length=MAX_RECENT_DECISIONS,
        description=f"The last {MAX_RECENT_DECISIONS} distinct autoscaler decisions for this pool, newest first; "
        "the newest applied replica change stays as the last item while newer decisions change nothing.",
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
    from_replicas: int = Field(
        validation_alias="from", serialization_alias="from", ge=0, description="Replicas before."
    )
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
    router: PoolStatus | None = Field(default=None, description="The bundled router (router.mode Builtin).")
    endpoint_picker: PickerStatus | None = Field(
        default=None, description="The endpoint picker (router.mode InferencePool), where the router would be."
    )
    scaling_history: list[ScalingEvent] = Field(
        default_factory=list,
        max_length=MAX_SCALING_HISTORY,
        description=f"The last {MAX_SCALING_HISTORY} scaling events, oldest first.",
    )

    def condition(self, type_: ConditionType | str) -> Condition | None:
        """The condition of this type, if set."""
        wanted = ConditionType(type_).value if isinstance(type_, ConditionType) else type_
        return next((c for c in self.conditions if c.type == wanted), None)
