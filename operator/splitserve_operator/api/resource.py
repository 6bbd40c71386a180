"""The whole InferenceService object, parsing with readable errors, and pool helpers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from splitserve_contract import (
    KIND,
    Role,
)
from splitserve_contract.model_revision import REVISION_PATTERN, REVISION_RULE

from ..naming import MAX_NAME_LENGTH, NAME_PATTERN
from .fields import (
    DURATION_PATTERN,
    ENV_NAME_PATTERN,
    HUB_ENDPOINT_PATTERN,
    IMAGE_PATTERN,
    K8S_NAME_PATTERN,
    LABEL_VALUE_PATTERN,
    MODEL_URI_PATTERN,
    QUANTITY_PATTERN,
)
from .rules import NAME_LENGTH_RULE_MESSAGE, NAME_PATTERN_RULE_MESSAGE
from .spec import InferenceServiceSpec, Mode, PoolSpec
from .status import InferenceServiceStatus


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
    MODEL_URI_PATTERN: (
        "must be hf://org/name, hf://org/name/file.gguf, pvc://claim/path or file:///absolute/path "
        "(path segments of printable ASCII, none '.', '..' or empty)"
    ),
    HUB_ENDPOINT_PATTERN: (
        "must be an http:// or https:// URL: host[:port][/path] of printable ASCII, no user "
        "information, query or fragment"
    ),
    REVISION_PATTERN: f"must be a git branch, tag or commit: {REVISION_RULE}",
    DURATION_PATTERN: "must be a duration such as 15s, 1m30s or 500ms",
    QUANTITY_PATTERN: "must be a non-negative Kubernetes quantity such as 2, 500m or 16Gi",
    LABEL_VALUE_PATTERN: "must be a label value: alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric",
    IMAGE_PATTERN: "must be an image reference without whitespace",
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
    status: InferenceServiceStatus = Field(default_factory=InferenceServiceStatus, description="Observed state.")

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
