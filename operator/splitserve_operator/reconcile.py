"""One level-based reconcile of one InferenceService: render, apply, observe, report.

:func:`reconcile` is synchronous and self-contained (kopf calls it from a worker thread):
given the live object it renders the desired children (:mod:`render`), applies each one
(:mod:`apply`), reads back the Deployments and pods it needs for status, checks GPU capacity
(:mod:`capacity`) and writes status (:mod:`status`). It is idempotent: running it twice, or
after a crash half-way, converges on the same children, one per role, because every write is
a server-side apply of a fixed name.

Conditions are kstatus-compatible (Ready / Reconciling / Stalled) with CamelCase reasons;
problems become conditions and Events, never exceptions out of the operator. The only
exception that escapes is :class:`RetryableError`, for API failures worth retrying with
backoff (the handler turns it into ``kopf.TemporaryError``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Final

from kubernetes.client.exceptions import ApiException

import splitserve_contract as contract
from splitserve_contract import Role

from . import apply, capacity, events, kube, naming, render, status
from .api import InferenceService, InvalidSpecError
from .status import ConditionUpdate

logger = logging.getLogger(__name__)

READY: Final = "Ready"
RECONCILING: Final = "Reconciling"
STALLED: Final = "Stalled"

REASON_RECONCILED: Final = "Reconciled"
REASON_CHILDREN_CREATED: Final = "ChildrenCreated"
REASON_ROLLOUT: Final = "RolloutInProgress"
REASON_NAME_CONFLICT: Final = "NameConflict"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_API_ERROR: Final = "ApiError"
REASON_NO_GPU: Final = "InsufficientGPUCapacity"
REASON_PROGRESSING: Final = "Progressing"

NODE_CACHE_SECONDS: Final = 10.0
APPLY_CONCURRENCY: Final = 8


class RetryableError(Exception):
    """A reconcile failed for a reason that may go away (API errors): retry with backoff."""


@dataclasses.dataclass(frozen=True)
class ReconcileSettings:
    runtime_image: str
    router_service_account: str = ""


@dataclasses.dataclass(frozen=True)
class PoolObservation:
    role: Role
    replicas: int
    ready: int
    desired: int
    pending: int
    rolled_out: bool


@dataclasses.dataclass(frozen=True)
class Result:
    """What one reconcile did (returned for tests, metrics and logs)."""

    outcome: str  # Reconciled | Progressing | NameConflict | InvalidSpec | InsufficientGPUCapacity
    created: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    ready: bool = False


class NodeCache:
    """Nodes listed at most every few seconds (shared by all reconciles): 200 services on
    200 nodes must not list all nodes 200 times a second. ``None`` when listing is forbidden."""

    def __init__(self, *, ttl_seconds: float = NODE_CACHE_SECONDS) -> None:
        self._ttl = ttl_seconds
        self._lock = threading.Lock()
        self._at = -1e9
        self._nodes: list[dict[str, Any]] | None = None
        self._warned = False

    def nodes(self, *, api: kube.Kube) -> list[dict[str, Any]] | None:
        with self._lock:
            if time.monotonic() - self._at < self._ttl:
                return self._nodes
            try:
                self._nodes = api.list(kind=kube.NODE, namespace=None)
            except ApiException as exc:
                if exc.status in (401, 403):
                    if not self._warned:  # a namespace-scoped install has no node access
                        logger.warning("Cannot list nodes (%s): only Pending pods reveal missing GPUs",
                                       exc.status)
                        self._warned = True
                    self._nodes = None
                else:
                    raise
            self._at = time.monotonic()
            return self._nodes


def is_paused(obj: Mapping[str, Any]) -> bool:
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(contract.ANNOTATION_PAUSED, "")).lower() == "true"


def endpoint_of(*, name: str, namespace: str) -> str:
    return f"http://{naming.child_name(name, Role.ROUTER)}.{namespace}.svc:{contract.HTTP_PORT}"


def observe_deployment(*, role: Role, deployment: Mapping[str, Any], pods: list[dict[str, Any]]) -> PoolObservation:
    spec = deployment.get("spec") or {}
    st = deployment.get("status") or {}
    generation = int(deployment.get("metadata", {}).get("generation") or 0)
    desired = int(spec["replicas"]) if spec.get("replicas") is not None else 1
    replicas = int(st.get("replicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    rolled_out = (
        int(st.get("observedGeneration") or 0) >= generation
        and updated >= desired and replicas <= desired and available >= desired
    )
    role_pods = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(contract.LABEL_ROLE) == role.value]
    pending = sum(1 for p in role_pods if (p.get("status") or {}).get("phase") == "Pending"
                  and not p.get("metadata", {}).get("deletionTimestamp"))
    return PoolObservation(role=role, replicas=replicas, ready=int(st.get("readyReplicas") or 0),
                           desired=desired, pending=pending, rolled_out=rolled_out)


def _status_key(role: Role) -> str:
    return role.value  # prefill | decode | aggregated | router


def _previous_reason(obj: Mapping[str, Any], type_: str) -> str | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return str(cond.get("reason"))
    return None


def _write_status(*, api: kube.Kube, obj: Mapping[str, Any], fields: Mapping[str, Any],
                  conditions: list[ConditionUpdate]) -> None:
    meta = obj["metadata"]
    try:
        status.patch_status(api=api, namespace=meta["namespace"], name=meta["name"], fields=fields,
                            conditions=conditions, observed_generation=meta.get("generation"))
    except ApiException as exc:
        raise RetryableError(f"status write failed: {kube.error_message(exc)}") from exc


Observation = tuple[status.ConditionStatusValue, str, str]
"""(status, reason, message) of one condition."""


def _conditions(*, ready: Observation, reconciling: Observation, stalled: Observation) -> list[ConditionUpdate]:
    return [ConditionUpdate(READY, *ready), ConditionUpdate(RECONCILING, *reconciling),
            ConditionUpdate(STALLED, *stalled)]


def reconcile(*, api: kube.Kube, obj: Mapping[str, Any], settings: ReconcileSettings,
              nodes: NodeCache | None = None) -> Result:
    """Converge the children of ``obj`` (a live InferenceService) and write its status.
    A paused object is not touched at all (the caller should not even call this)."""
    if is_paused(obj):
        return Result(outcome="Paused")
    meta = obj["metadata"]
    name, namespace = str(meta["name"]), str(meta["namespace"])

    try:
        isvc = InferenceService.parse(obj)
    except InvalidSpecError as exc:
        message = str(exc)
        if _previous_reason(obj, STALLED) != REASON_INVALID_SPEC:
            events.warning(obj=obj, reason=REASON_INVALID_SPEC, message=message)
        _write_status(api=api, obj=obj, fields={"observedGeneration": meta.get("generation")},
                      conditions=_conditions(ready=("False", REASON_INVALID_SPEC, message),
                                             reconciling=("False", REASON_INVALID_SPEC, message),
                                             stalled=("True", REASON_INVALID_SPEC, message)))
        return Result(outcome=REASON_INVALID_SPEC)

    owner = apply.Owner(name=name, uid=str(meta["uid"]))
    children = render.render_children(isvc=isvc, runtime_image=settings.runtime_image,
                                      router_service_account=settings.router_service_account)
    comps = render.components(isvc.spec)
    created: list[str] = []
    updated: list[str] = []
    conflicts: list[str] = []
    conflict_messages: list[str] = []
    deployments: dict[Role, dict[str, Any]] = {}
    def apply_one(child: dict[str, Any]) -> apply.Applied | BaseException:
        role_value = (child["metadata"].get("labels") or {}).get(contract.LABEL_ROLE)
        initial = render.initial_replicas(isvc=isvc, role=Role(role_value)) if child["kind"] == "Deployment" else None
        try:
            return apply.apply_child(api=api, desired=child, owner=owner, initial_replicas=initial)
        except (apply.NameConflict, ApiException) as exc:
            return exc

    # Children are independent objects: apply them concurrently (one GET + PATCH each).
    with concurrent.futures.ThreadPoolExecutor(max_workers=APPLY_CONCURRENCY) as pool:
        applied_list = list(pool.map(apply_one, children))
    api_errors: list[str] = []
    for child, result in zip(children, applied_list, strict=True):
        label = f"{child['kind']}/{child['metadata']['name']}"
        if isinstance(result, apply.NameConflict):
            conflicts.append(label)
            conflict_messages.append(str(result))
        elif isinstance(result, BaseException):
            api_errors.append(f"applying {label} failed: {kube.error_message(result)}")
        elif isinstance(result, apply.Applied):
            if result.outcome is apply.Outcome.CREATED:
                created.append(label)
            elif result.outcome is apply.Outcome.UPDATED:
                updated.append(label)
            role_value = (child["metadata"].get("labels") or {}).get(contract.LABEL_ROLE)
            if child["kind"] == "Deployment" and role_value:
                deployments[Role(role_value)] = result.obj
    if api_errors:
        message = "; ".join(api_errors)
        events.warning(obj=obj, reason=REASON_API_ERROR, message=message)
        _write_status(api=api, obj=obj, fields={}, conditions=_conditions(
            ready=("False", REASON_API_ERROR, message), reconciling=("True", REASON_API_ERROR, message),
            stalled=("False", REASON_API_ERROR, message)))
        raise RetryableError(message)

    if created:
        events.normal(obj=obj, reason=REASON_CHILDREN_CREATED, message="Created " + ", ".join(created))
    if updated:
        events.normal(obj=obj, reason="ChildrenUpdated", message="Updated " + ", ".join(updated))
    if conflicts and _previous_reason(obj, STALLED) != REASON_NAME_CONFLICT:
        events.warning(obj=obj, reason=REASON_NAME_CONFLICT, message="; ".join(conflict_messages))

    try:
        pods = api.list(kind=kube.POD, namespace=namespace,
                        label_selector=f"{contract.LABEL_INSTANCE}={name},{contract.LABEL_NAME}={contract.LABEL_NAME_VALUE}")
    except ApiException as exc:
        raise RetryableError(f"listing pods failed: {kube.error_message(exc)}") from exc
    observations = {role: observe_deployment(role=role, deployment=dep, pods=pods) for role, dep in deployments.items()}

    shortfalls: list[str] = []
    node_list = (nodes or NodeCache()).nodes(api=api)
    for comp in comps:
        if comp.pool is None or comp.role not in observations:
            continue
        if node_list is not None:
            gap = capacity.gpu_shortfall(
                pool=comp.role.value, pods=observations[comp.role].desired,
                gpus_per_pod=comp.pool.resources.gpus, node_selector=comp.pool.node_selector,
                tolerations=comp.pool.tolerations, nodes=node_list)
            if gap is not None:
                shortfalls.append(gap.message())
    stuck = capacity.unschedulable_gpu_pods(pods)
    if stuck and not shortfalls:
        shortfalls.append(f"pods pending for lack of {capacity.GPU_RESOURCE}: {', '.join(sorted(stuck)[:5])}")
    if shortfalls and _previous_reason(obj, STALLED) != REASON_NO_GPU:
        events.warning(obj=obj, reason=REASON_NO_GPU, message="; ".join(shortfalls))

    all_present = len(observations) == len(comps)
    ready = all_present and not conflicts and all(o.ready >= 1 and o.rolled_out for o in observations.values())
    waiting = ", ".join(
        f"{o.role.value} {o.ready}/{o.desired} ready" for o in observations.values() if not (o.ready >= 1 and o.rolled_out)
    )
    if conflicts:
        msg = "; ".join(conflict_messages)
        conds = _conditions(ready=("False", REASON_NAME_CONFLICT, msg), reconciling=("False", REASON_NAME_CONFLICT, msg),
                            stalled=("True", REASON_NAME_CONFLICT, msg))
        outcome = REASON_NAME_CONFLICT
    elif ready:
        msg = "All pools are ready and rolled out"
        conds = _conditions(ready=("True", REASON_RECONCILED, msg), reconciling=("False", REASON_RECONCILED, msg),
                            stalled=("False", REASON_RECONCILED, msg))
        outcome = REASON_RECONCILED
    elif shortfalls:
        msg = "; ".join(shortfalls)
        conds = _conditions(ready=("False", REASON_NO_GPU, msg), reconciling=("True", REASON_ROLLOUT, waiting or msg),
                            stalled=("True", REASON_NO_GPU, msg))
        outcome = REASON_NO_GPU
    else:
        reason = REASON_CHILDREN_CREATED if created else REASON_ROLLOUT
        msg = f"Waiting for {waiting}" if waiting else "Waiting for rollouts"
        conds = _conditions(ready=("False", reason, msg), reconciling=("True", reason, msg),
                            stalled=("False", REASON_PROGRESSING, "Rollout is progressing"))
        outcome = REASON_PROGRESSING

    fields: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "endpoint": endpoint_of(name=name, namespace=namespace),
        "compatHash": render.compat_hash_of(isvc=isvc, runtime_image=settings.runtime_image),
    }
    for role, o in observations.items():
        fields[_status_key(role)] = {"replicas": o.replicas, "readyReplicas": o.ready,
                                     "desiredReplicas": o.desired, "pendingReplicas": o.pending,
                                     "summary": f"{o.ready}/{o.desired}"}
    _write_status(api=api, obj=obj, fields=fields, conditions=conds)
    if ready and _previous_reason(obj, READY) != REASON_RECONCILED:
        events.normal(obj=obj, reason="Ready", message=msg)
    return Result(outcome=outcome, created=tuple(created), updated=tuple(updated),
                  conflicts=tuple(conflicts), ready=ready)
