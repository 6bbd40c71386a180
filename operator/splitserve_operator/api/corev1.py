"""Kubernetes' own core/v1 schemas for the pod fields a pool passes through, in CRD form.

``tolerations`` and ``affinity`` go into the pods unchanged. Typed loosely (a free-form
object), a bad value such as ``tolerations: [{"foo": "bar"}]`` passed admission and failed
only later, when the Deployment was applied. So the CRD embeds the API server's schemas for
them, snapshotted verbatim (by ``operator/tools/corev1gen.py``, a build-time tool outside the
package) into the package data file ``corev1_snapshot.json`` (:data:`SNAPSHOT`, read once at
import: it is data, not code), and :func:`crd_schema` converts a snapshot schema to the
structural form a CRD needs:

* ``$ref`` and ``allOf: [{$ref}]`` are inlined (the referring node's description wins);
* ``default`` is dropped: Kubernetes documents Go zero values (``""``, ``0``, ``{}``) for
  omitted fields; in a CRD a default is written into the stored object and would satisfy
  ``required``, so a Toleration would gain ``effect: ""`` and a missing ``topologyKey`` would
  pass;
* an optional string with an ``enum`` also accepts ``""``, as the API server does (Go's
  ``omitempty``: ``Toleration.operator: ""`` means Equal, ``effect: ""`` means all effects);
* descriptions keep their first sentence, enough for ``kubectl explain``: Affinity is large
  and every pool embeds it, so full descriptions would double the CRD; the fields of a
  definition that appears again (LabelSelector, PodAffinityTerm) are described at its first
  place only;
* keys a CRD schema cannot carry (``x-kubernetes-patch-*`` of strategic merge patches) go.

:func:`problems` checks a value against the same converted schema in Python, so
:meth:`InferenceService.parse` refuses what the CRD refuses (types, unknown fields, required
fields, enums) without a cluster; the rules Kubernetes checks in Go rather than in its
schema (a Toleration's key/operator pairing, say) are CEL in :mod:`.rules`, and whatever is
left the API server reports when the Deployment is applied (the reconciler's ``InvalidSpec``).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any, Final

SNAPSHOT_FILE: Final = "corev1_snapshot.json"
"""The snapshot, next to this module (package data; regenerate, do not edit)."""
SNAPSHOT: Final[dict[str, Any]] = json.loads(
    resources.files(__package__ or "").joinpath(SNAPSHOT_FILE).read_text(encoding="utf-8")
)

TOLERATION: Final = "io.k8s.api.core.v1.Toleration"
AFFINITY: Final = "io.k8s.api.core.v1.Affinity"
_REF_PREFIX: Final = "#/components/schemas/"
_KEPT_KEYS: Final = frozenset(
    {
        "description",
        "type",
        "format",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "items",
        "properties",
        "additionalProperties",
        "required",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
    }
)


_SENTENCE_END: Final = re.compile(r"(?<=[a-z0-9)\]`]\.)\s+(?=[A-Z])")


def _first_sentence(text: str) -> str:
    paragraph = text.split("\n\n", 1)[0].strip()
    return _SENTENCE_END.split(paragraph, 1)[0]


def _convert(
    node: Mapping[str, Any], *, required: bool = True, seen: set[str] | None = None, brief: bool = False
) -> dict[str, Any]:
    """``seen``: the definitions inlined so far. A definition inlined again (Affinity holds
    LabelSelector eight times, in each of the three pools) is ``brief``: it keeps its own first
    sentence but its fields' descriptions go (``kubectl explain`` shows them at the first place
    the definition appears), which keeps the CRD within its size budget."""
    seen = set() if seen is None else seen
    node = dict(node)
    ref = node.pop("$ref", None)
    all_of = node.pop("allOf", None)
    if all_of is not None:
        if len(all_of) != 1 or set(all_of[0]) != {"$ref"}:
            raise ValueError(f"unsupported allOf {all_of!r}")
        ref = all_of[0]["$ref"]
    if ref is not None:
        name = str(ref).removeprefix(_REF_PREFIX)
        target = dict(SNAPSHOT["schemas"][name])
        if "description" in node:
            target["description"] = node["description"]
        again = name in seen
        seen.add(name)
        out_ref = _convert(target, required=required, seen=seen, brief=brief or again)
        if again and "description" in target:
            out_ref["description"] = _first_sentence(str(target["description"]))
        return out_ref
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEPT_KEYS:
            continue
        if key == "description":
            out[key] = _first_sentence(str(value))
        elif key == "properties":
            names = set(node.get("required", []))
            out[key] = {
                name: _convert(sub, required=name in names, seen=seen, brief=brief) for name, sub in value.items()
            }
            if brief:
                for sub in out[key].values():
                    sub.pop("description", None)
        elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
            out[key] = _convert(value, seen=seen, brief=brief)
        else:
            out[key] = copy.deepcopy(value)
    if "enum" in out and out.get("type") == "string" and not required and "" not in out["enum"]:
        out["enum"] = [*out["enum"], ""]
    return out


@functools.cache
def _definition(name: str) -> dict[str, Any]:
    return _convert({"$ref": _REF_PREFIX + name})


def crd_schema(name: str) -> dict[str, Any]:
    """The structural CRD schema of the snapshot's component schema ``name`` (a fresh copy)."""
    return copy.deepcopy(_definition(name))


def pod_spec_description(field: str) -> str:
    """The first sentence of PodSpec's own description of ``field``."""
    return _first_sentence(str(SNAPSHOT["podSpecFields"][field].get("description", "")))


def kubernetes_version() -> str:
    """The Kubernetes version whose API server the snapshot was taken from."""
    return str(SNAPSHOT["kubernetesVersion"])


_JSON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


def _type_ok(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def problems(value: Any, schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Where ``value`` breaks ``schema`` (a converted schema): ``path: problem`` lines, in the
    API server's words where it has them. Checks type, unknown and required fields, enums,
    bounds and patterns; not CEL rules."""
    where = path or "<value>"
    kind = schema.get("type")
    if kind and not _type_ok(value, str(kind)):
        return [f"{where}: must be of type {kind}, got {type(value).__name__}"]
    out: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' for v in schema["enum"])
        out.append(f"{where}: Unsupported value: {value!r}: supported values: {allowed}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < int(schema["minLength"]):
            out.append(f"{where}: should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > int(schema["maxLength"]):
            out.append(f"{where}: may not be longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(str(schema["pattern"]), value):
            out.append(f"{where}: should match {schema['pattern']!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{where}: should be greater than or equal to {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{where}: should be less than or equal to {schema['maximum']}")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > int(schema["maxItems"]):
            out.append(f"{where}: must have at most {schema['maxItems']} items")
        item_schema = schema.get("items")
        if isinstance(item_schema, Mapping):
            for i, item in enumerate(value):
                out += problems(item, item_schema, f"{path}[{i}]")
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name in schema.get("required", []):
            if name not in value:
                out.append(f"{path}.{name}: Required value" if path else f"{name}: Required value")
        for name, sub in value.items():
            sub_path = f"{path}.{name}" if path else str(name)
            if name in properties:
                out += problems(sub, properties[name], sub_path)
            elif isinstance(extra, Mapping):
                out += problems(sub, extra, sub_path)
            elif properties or extra is not None:
                out.append(f"{sub_path}: field not declared in schema")
    return out
