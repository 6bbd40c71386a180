"""Status writes that several writers can share without losing each other's conditions.

The reconciler and the autoscaler both write ``status`` of the same InferenceService. A
merge patch replaces lists whole, so a naive writer that sends its own ``conditions`` erases
the other's. :func:`patch_status` therefore does read-modify-write:

1. GET the object (fresh, not a possibly stale kopf body), unless the caller passes the copy
   it read a moment ago (``live``: the reconciler's, read at the start of the reconcile): the
   first attempt then costs no read, and a stale copy only costs the 409 of step 4;
2. merge the caller's conditions into the live list *by type* (other types are kept as
   they are), keeping ``lastTransitionTime`` unless the condition's ``status`` changed;
3. deep-merge the caller's other fields into the live status;
4. if nothing changed, write nothing; else send a merge patch to the ``status``
   subresource carrying ``metadata.resourceVersion``, which the API server treats as a
   precondition: a concurrent write makes it fail with 409, and we start over at 1.

Conflicts are retried a bounded number of times; the last error is raised to the caller
(kopf then retries the handler with backoff).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

from . import kube

MAX_ATTEMPTS: Final = 8
ConditionStatusValue = Literal["True", "False", "Unknown"]


@dataclasses.dataclass(frozen=True)
class ConditionUpdate:
    """A condition a writer wants set; the time and generation are filled in on write."""

    type: str
    status: ConditionStatusValue
    reason: str
    message: str = ""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _timestamp(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(
    *,
    live: Sequence[Mapping[str, Any]],
    updates: Sequence[ConditionUpdate],
    observed_generation: int | None,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Live conditions with ``updates`` merged in by type (order: live order, new ones last)."""
    by_type: dict[str, dict[str, Any]] = {str(c.get("type")): dict(c) for c in live if c.get("type")}
    order = [str(c.get("type")) for c in live if c.get("type")]
    for update in updates:
        old = by_type.get(update.type)
        changed = old is None or old.get("status") != update.status
        new: dict[str, Any] = {
            "type": update.type,
            "status": update.status,
            "reason": update.reason,
            "message": update.message,
            "lastTransitionTime": _timestamp(now)
            if changed or old is None or not old.get("lastTransitionTime")
            else old["lastTransitionTime"],
        }
        if observed_generation is not None:
            new["observedGeneration"] = observed_generation
        if update.type not in by_type:
            order.append(update.type)
        by_type[update.type] = new
    return [by_type[t] for t in order]


def merge_patch(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 semantics: dicts merge recursively, None deletes, anything else replaces."""
    out = dict(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def patch_status(
    *,
    api: kube.StatusAPI,
    namespace: str,
    name: str,
    fields: Mapping[str, Any] | None = None,
    conditions: Sequence[ConditionUpdate] = (),
    observed_generation: int | None = None,
    clock: Callable[[], datetime.datetime] = _now,
    kind: kube.Kind = kube.INFERENCE_SERVICE,
    live: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Merge ``fields`` and ``conditions`` into the object's status (see the module docstring).

    Returns the status as written (or as found, when nothing changed), or None when the
    object no longer exists. ``observed_generation`` goes on each updated condition. ``live``:
    the object as just read, used instead of a GET for the first attempt.
    Raises the API error after :data:`MAX_ATTEMPTS` conflicts."""
    last_error: kube.ApiException | None = None
    first = live if live is not None and (live.get("metadata") or {}).get("resourceVersion") else None
    for attempt in range(MAX_ATTEMPTS):
        live_obj = first if attempt == 0 and first is not None else api.get(kind=kind, namespace=namespace, name=name)
        if live_obj is None:
            return None
        live_status: dict[str, Any] = dict(live_obj.get("status") or {})
        new_status = merge_patch(live_status, fields or {})
        if conditions:
            new_status["conditions"] = merge_conditions(
                live=live_status.get("conditions") or [],
                updates=conditions,
                observed_generation=observed_generation,
                now=clock(),
            )
        if new_status == live_status:
            return live_status
        patch: dict[str, Any] = {
            "metadata": {"resourceVersion": live_obj["metadata"]["resourceVersion"]},
            "status": _merge_patch_of(live_status, new_status),
        }
        try:
            written = api.merge_patch(kind=kind, namespace=namespace, name=name, patch=patch, subresource="status")
        except kube.ApiException as exc:
            if exc.status == 409:
                last_error = exc
                continue
            if exc.status == 404:
                return None
            raise
        return dict(written.get("status") or {})
    assert last_error is not None
    raise last_error


def _merge_patch_of(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns ``old`` into ``new`` (keys gone from new become None)."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = _merge_patch_of(before, value)
            if sub:
                patch[key] = sub
        elif before != value or key not in old:
            patch[key] = copy.deepcopy(value)
    return patch
