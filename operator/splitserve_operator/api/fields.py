"""Building blocks of the API models: patterns, durations, quantities, the camelCase base
model, nested-object defaults and fields bound to the capabilities table.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
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
from .rules import (
    MAX_LABEL_KEY_LENGTH,
    SELECTOR_REQUIREMENT_CEL_RULES,
    TOLERATION_CEL_RULES,
    affinity_problems,
    toleration_problems,
)

API_VERSION_STRING: Final = f"{API_GROUP}/{API_VERSION}"
MAX_SCALING_HISTORY: Final = 20
"""status.scalingHistory keeps the most recent N scaling events."""

DURATION_PATTERN: Final = r"^([0-9]{1,5}(\.[0-9]{1,9})?(ms|s|m|h))+$"
"""A Go-style duration whose parts have at most 5 digits (and 9 after the point): with the
fields' 32 characters that stays far below Go's (and CEL's) 290-year limit, past which the API
server's rules fail with a type conversion error instead of saying what is wrong."""
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _segment(chars: str) -> str:
    """A path segment of ``chars`` (a character class body without '.') that is not ``.`` or
    ``..``: no path traversal, whatever the segment's neighbours. RE2- and Python-compatible."""
    one = f"[{chars}]"
    any_ = f"[{chars}.]"
    return f"({one}{any_}*|[.]{one}{any_}*|[.][.]{any_}+)"


_HF_SEGMENT: Final = _segment("-A-Za-z0-9_")
_PATH_SEGMENT: Final = _segment("-A-Za-z0-9_~+@=,%:")
"""A segment of a pvc:// or file:// path: printable ASCII without '/', '\\', spaces or
quotes; never a control character."""
MODEL_URI_PATTERN: Final = (
    rf"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(/({_HF_SEGMENT}/)*[A-Za-z0-9._-]+[.]gguf)?"
    rf"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/{_PATH_SEGMENT})*/?"
    rf"|file://((/{_PATH_SEGMENT})+/?|/))$"
)
"""hf://org/name[/path/file.gguf], pvc://claim[/path] or file:///path: no '.' or '..' segment
(the path is joined under the claim's mount), no empty segment, no control character."""
HUB_ENDPOINT_PATTERN: Final = (
    r"^https?://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?"
    r"(/[-A-Za-z0-9._~!$&'()*+,;=:@%/]*)?$"
)
"""A model hub base URL: http(s), a host name or [IPv6], an optional port and path (RFC 3986
path characters: no control character, space, backslash or non-ASCII); no user information,
query or fragment. Which hosts are refused: :func:`.rules.hub_endpoint_problems`."""
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

_QUANTITY_PART = re.compile(r"^\+?([0-9.]+)(([KMGTPE]i)|[numkMGTPE]|[eE][-+]?[0-9.]+)?$")
_QUANTITY_SUFFIX: Final[dict[str, int | Decimal]] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def parse_quantity(value: str) -> Decimal:
    """The value of a quantity that matches :data:`QUANTITY_PATTERN`, e.g. ``16Gi``, ``500m``, ``1e3``."""
    match = _QUANTITY_PART.match(value)
    if match is None:
        raise ValueError(f"invalid quantity {value!r}")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** Decimal(suffix[1:])
    return number * Decimal(_QUANTITY_SUFFIX[suffix])


def _quantity_bound(field: str, most: str) -> tuple[AfterValidator, WithJsonSchema]:
    """The model's check and the CRD's schema of a :data:`Quantity` above 0 and at most
    ``most`` (a CEL rule with the API server's quantity library)."""
    message = f"resources.{field} must be above 0 and at most {most}"
    rule = (
        f"quantity(string(self)).isGreaterThan(quantity('0')) && "
        f"!quantity(string(self)).isGreaterThan(quantity('{most}'))"
    )

    def check(value: str) -> str:
        if not 0 < parse_quantity(value) <= parse_quantity(most):
            raise ValueError(message)
        return value

    return AfterValidator(check), WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "minimum": 0,
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [{"rule": rule, "message": message}],
        }
    )


MAX_CPU: Final = "1024"
MAX_MEMORY: Final = "16Ti"
_CPU_BOUND: Final = _quantity_bound("cpu", MAX_CPU)
_MEMORY_BOUND: Final = _quantity_bound("memory", MAX_MEMORY)
CpuQuantity = Annotated[
    str, BeforeValidator(_quantity), Field(pattern=QUANTITY_PATTERN, max_length=64), _CPU_BOUND[0], _CPU_BOUND[1]
]
"""A CPU request: above 0 and at most :data:`MAX_CPU` (a pod no node can hold is Pending forever)."""
MemoryQuantity = Annotated[
    str, BeforeValidator(_quantity), Field(pattern=QUANTITY_PATTERN, max_length=64), _MEMORY_BOUND[0], _MEMORY_BOUND[1]
]
"""A memory request and limit: above 0 (a 0 limit kills the container at once) and at most
:data:`MAX_MEMORY` (``1e30`` is a valid quantity no node has)."""

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


def _toleration_schema() -> dict[str, Any]:
    schema = corev1.crd_schema(corev1.TOLERATION)
    # Bounds Kubernetes checks in Go (a label key, a label value), which also bound the size of
    # the spec: kopf keeps the last handled spec in an annotation.
    schema["properties"]["key"]["maxLength"] = MAX_LABEL_KEY_LENGTH
    schema["properties"]["value"]["maxLength"] = 63
    schema["x-kubernetes-validations"] = [dict(rule) for rule in TOLERATION_CEL_RULES]
    return schema


MAX_AFFINITY_LIST_ITEMS: Final = 32
"""Most items of each list in a pool's affinity (terms, requirements, values, ...)."""


def _affinity_schema() -> dict[str, Any]:
    """Kubernetes' Affinity schema with the checks its Go code makes (:mod:`.rules`): each
    selector requirement's values against its operator, a non-empty topologyKey."""
    schema = corev1.crd_schema(corev1.AFFINITY)

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        props = node.get("properties", {})
        if {"key", "operator", "values"} <= set(props):
            node["x-kubernetes-validations"] = [dict(rule) for rule in SELECTOR_REQUIREMENT_CEL_RULES]
        if "topologyKey" in props:
            props["topologyKey"]["minLength"] = 1
        if node.get("type") == "array":
            # Bounds what the API server's CEL cost estimate multiplies the rules above by
            # (unbounded nested lists put the CRD over its budget), and the spec's size.
            node["maxItems"] = MAX_AFFINITY_LIST_ITEMS
        for sub in (*props.values(), node.get("items"), node.get("additionalProperties")):
            walk(sub)

    walk(schema)
    return schema


_TOLERATION_SCHEMA: Final = _toleration_schema()
_AFFINITY_SCHEMA: Final = _affinity_schema()
Toleration = Annotated[
    dict[str, Any], _core_v1_check(_TOLERATION_SCHEMA, toleration_problems), WithJsonSchema(_TOLERATION_SCHEMA)
]
"""A core/v1 Toleration, validated as the API server validates a Pod's."""
Affinity = Annotated[
    dict[str, Any], _core_v1_check(_AFFINITY_SCHEMA, affinity_problems), WithJsonSchema(_AFFINITY_SCHEMA)
]
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
