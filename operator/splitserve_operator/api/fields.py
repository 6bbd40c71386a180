"""Building blocks of the API models: patterns, durations, quantities, the camelCase base
model, nested-object defaults and fields bound to the capabilities table.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

from splitserve_contract import (
    API_GROUP,
    API_VERSION,
    defaults,
)
from splitserve_contract import capabilities as caps

from . import corev1
from .rules import TOLERATION_CEL_RULES, toleration_problems

API_VERSION_STRING: Final = f"{API_GROUP}/{API_VERSION}"
MAX_SCALING_HISTORY: Final = 20
"""status.scalingHistory keeps the most recent N scaling events."""

DURATION_PATTERN: Final = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

MODEL_URI_PATTERN: Final = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(/([A-Za-z0-9._-]+/)*[A-Za-z0-9._-]+[.]gguf)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?"
    r"|file:///[^\s]*)$"
)
HUB_ENDPOINT_PATTERN: Final = (
    r"^https?://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[^\s?#]*)?$"
)
"""A model hub base URL: http(s), a host name or [IPv6], an optional port and path; no query."""
QUANTITY_PATTERN: Final = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""Kubernetes' quantity syntax without the minus sign: requests and limits must be >= 0
(the API server says so only when the Deployment is applied)."""
LABEL_VALUE_PATTERN: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
IMAGE_PATTERN: Final = r"^\S+$"
"""A container image reference has no whitespace (leading or trailing whitespace is refused
when the Deployment is applied, inner whitespace by the kubelet: InvalidImageName)."""
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
            "minimum": 0,
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
"""A non-negative Kubernetes resource quantity (``2``, ``"500m"``, ``"16Gi"``): ``minimum``
bounds the integer form, ``pattern`` the string form."""

FreeFormObject = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""An object passed through unchecked. Pod fields use :data:`Toleration` and :data:`Affinity`,
which carry Kubernetes' own schemas."""


def _core_v1_check(schema: Mapping[str, Any], *checks: Callable[[Mapping[str, Any]], list[str]]) -> AfterValidator:
    """The model's side of a core/v1 object field whose CRD schema is ``schema`` (from
    :mod:`.corev1`): the same schema, plus ``checks`` (the Python side of its CEL rules)."""

    def check(value: dict[str, Any]) -> dict[str, Any]:
        errors = corev1.problems(value, schema) + [e for c in checks for e in c(value)]
        if errors:
            raise ValueError("; ".join(errors))
        return value

    return AfterValidator(check)


_TOLERATION_SCHEMA: Final = {
    **corev1.crd_schema(corev1.TOLERATION),
    "x-kubernetes-validations": [dict(rule) for rule in TOLERATION_CEL_RULES],
}
_AFFINITY_SCHEMA: Final = corev1.crd_schema(corev1.AFFINITY)
Toleration = Annotated[dict[str, Any], _core_v1_check(_TOLERATION_SCHEMA, toleration_problems),
                       WithJsonSchema(_TOLERATION_SCHEMA)]
"""A core/v1 Toleration, validated as the API server validates a Pod's."""
Affinity = Annotated[dict[str, Any], _core_v1_check(_AFFINITY_SCHEMA), WithJsonSchema(_AFFINITY_SCHEMA)]
"""A core/v1 Affinity, validated with the API server's schema."""


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
SpeculativeMethodName = Annotated[str, _capability(caps.SPECULATIVE_METHOD)]


def _block_size(value: int) -> int:
    if value not in defaults.BLOCK_SIZES:
        *head, last = (str(b) for b in defaults.BLOCK_SIZES)
        raise ValueError(f"Input should be {', '.join(head)} or {last}")
    return value


BlockSize = Annotated[int, AfterValidator(_block_size)]


