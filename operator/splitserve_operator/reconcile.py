"""One level-based reconcile of one InferenceService: render, apply, observe, report.

:func:`reconcile` is synchronous and self-contained (kopf calls it from a worker thread):
given the live object it renders the desired children (:mod:`render`), applies each one
(:mod:`apply`), reads back the Deployments and pods it needs for status, checks GPU capacity
(:mod:`capacity`) and writes status (:mod:`status`). It is idempotent: running it twice, or
after a crash half-way, converges on the same children, one per role, because every write is
a server-side apply of a fixed name.

The stages, each a small function passing a typed value to the next::

    parse -> render -> apply -> observe -> decide (conditions) -> write status
    obj      _Parsed   _Rendered _ApplyReport _Observed _Verdict

Observation covers the Deployments, the pods (pending ones, and pods whose containers keep
exiting at start-up: :func:`pod_start_failure`), and GPU capacity.

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
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kubernetes.client.exceptions import ApiException

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason, Role

from . import apply, capacity, events, kube, naming, render, status
from .api import InferenceService, InvalidSpecError
from .render import Component
from .status import ConditionUpdate

logger = logging.getLogger(__name__)

NODE_CACHE_SECONDS: Final = 10.0
APPLY_CONCURRENCY: Final = 8
MAX_POD_MESSAGE_CHARS: Final = 1024
"""A pod's termination message is trimmed to this in conditions and Events."""
MODEL_FAILURE_MARKERS: Final = ("is not in the local cache", "ModelLoadError", "model '")
"""Text of a termination message that says the model could not be loaded (most specific first)."""


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

    outcome: str
    """Reconciled | Progressing | NameConflict | InvalidSpec | InsufficientGPUCapacity |
    ModelUnavailable | PodStartFailed | Paused (a :class:`~splitserve_contract.Reason`)."""
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

    def nodes(self, *, api: kube.KubeAPI) -> list[dict[str, Any]] | None:
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




@dataclasses.dataclass(frozen=True)
class PodStartFailure:
    """A container of a pod that keeps exiting at start-up (crash loop)."""

    pod: str
    role: str
    container: str
    exit_code: int
    model_unavailable: bool
    message: str
    """The container's termination message (the runtime's load error, or the log tail)."""

    @property
    def reason(self) -> str:
        return Reason.MODEL_UNAVAILABLE if self.model_unavailable else Reason.POD_START_FAILED

    def describe(self) -> str:
        head = f"pod {self.pod} (container {self.container}) exited with code {self.exit_code}"
        return f"{head}: {self.message}" if self.message else head


def _relevant_text(message: str) -> tuple[bool, str]:
    """(mentions a model load failure, the part worth showing, at most ~1 KiB)."""
    text = message.strip()
    for marker in MODEL_FAILURE_MARKERS:
        lines = [line.strip() for line in text.splitlines() if marker in line]
        if lines:
            return True, lines[-1][-MAX_POD_MESSAGE_CHARS:]
    if len(text) > MAX_POD_MESSAGE_CHARS:  # the end of a log tail says most
        text = "..." + text[-(MAX_POD_MESSAGE_CHARS - 3):]
    return False, text


def _failed_termination(container_status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The failed termination of a container that keeps failing at start-up, else None."""
    if container_status.get("ready"):
        return None
    state = container_status.get("state") or {}
    current = state.get("terminated") or {}
    last = (container_status.get("lastState") or {}).get("terminated") or {}
    crash_loop = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
    restarted_after_failure = int(container_status.get("restartCount") or 0) >= 1 and \
        int(last.get("exitCode") or 0) != 0
    if not (crash_loop or restarted_after_failure):
        return None
    if int(current.get("exitCode") or 0) != 0:
        return dict(current)
    return dict(last)


def pod_start_failure(pod: Mapping[str, Any]) -> PodStartFailure | None:
    """The first container of ``pod`` that keeps failing at start-up (restartCount >= 1 after
    a non-zero exit, or CrashLoopBackOff), with its termination message; None otherwise."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = _failed_termination(cs)
        if term is None:
            continue
        model_unavailable, message = _relevant_text(str(term.get("message") or ""))
        return PodStartFailure(
            pod=str(meta.get("name", "")), role=str((meta.get("labels") or {}).get(contract.LABEL_ROLE, "")),
            container=str(cs.get("name", "")), exit_code=int(term.get("exitCode") or 0),
            model_unavailable=model_unavailable, message=message)
    return None


def _status_key(role: Role) -> str:
    return role.value  # prefill | decode | aggregated | router


def _previous_reason(obj: Mapping[str, Any], type_: str) -> str | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return str(cond.get("reason"))
    return None


def _write_status(*, api: kube.KubeAPI, obj: Mapping[str, Any], fields: Mapping[str, Any],
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
    return [ConditionUpdate(ConditionType.READY, *ready), ConditionUpdate(ConditionType.RECONCILING, *reconciling),
            ConditionUpdate(ConditionType.STALLED, *stalled)]


def _stalled(reason: str, message: str) -> list[ConditionUpdate]:
    """Ready=False, Reconciling=False, Stalled=True, all for ``reason``."""
    return _conditions(ready=("False", reason, message), reconciling=("False", reason, message),
                       stalled=("True", reason, message))


# ---------------------------------------------------------------------------- stages


@dataclasses.dataclass(frozen=True)
class _Parsed:
    obj: Mapping[str, Any]
    name: str
    namespace: str
    isvc: InferenceService


@dataclasses.dataclass(frozen=True)
class _Rendered:
    children: list[dict[str, Any]]
    comps: list[Component]


@dataclasses.dataclass(frozen=True)
class _ApplyReport:
    created: list[str]
    updated: list[str]
    conflicts: list[str]
    conflict_messages: list[str]
    deployments: dict[Role, dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class _Observed:
    pools: dict[Role, PoolObservation]
    shortfalls: list[str]
    start_failures: list[PodStartFailure]
    """Failing pods of pools without a ready replica (one per pool)."""


@dataclasses.dataclass(frozen=True)
class _Verdict:
    conditions: list[ConditionUpdate]
    outcome: str
    ready: bool
    message: str


def _parse(*, api: kube.KubeAPI, obj: Mapping[str, Any]) -> _Parsed | None:
    """The parsed spec; None after reporting an invalid one (Event on transition, status)."""
    meta = obj["metadata"]
    try:
        isvc = InferenceService.parse(obj)
    except InvalidSpecError as exc:
        message = str(exc)
        if _previous_reason(obj, ConditionType.STALLED) != Reason.INVALID_SPEC:
            events.warning(obj=obj, reason=Reason.INVALID_SPEC, message=message)
        _write_status(api=api, obj=obj, fields={"observedGeneration": meta.get("generation")},
                      conditions=_stalled(Reason.INVALID_SPEC, message))
        return None
    return _Parsed(obj=obj, name=str(meta["name"]), namespace=str(meta["namespace"]), isvc=isvc)


def _render(*, parsed: _Parsed, settings: ReconcileSettings) -> _Rendered:
    children = render.render_children(isvc=parsed.isvc, runtime_image=settings.runtime_image,
                                      router_service_account=settings.router_service_account)
    return _Rendered(children=children, comps=render.components(parsed.isvc.spec))


def _role_of(child: Mapping[str, Any]) -> str | None:
    role = (child["metadata"].get("labels") or {}).get(contract.LABEL_ROLE)
    return str(role) if role else None


def _apply_all(*, api: kube.KubeAPI, parsed: _Parsed, rendered: _Rendered) -> list[apply.Applied | BaseException]:
    """Apply every child; children are independent objects, so concurrently (a GET + PATCH each)."""
    owner = apply.Owner(name=parsed.name, uid=str(parsed.obj["metadata"]["uid"]))

    def apply_one(child: dict[str, Any]) -> apply.Applied | BaseException:
        role_value = _role_of(child)
        initial = (render.initial_replicas(isvc=parsed.isvc, role=Role(str(role_value)))
                   if child["kind"] == "Deployment" else None)
        try:
            return apply.apply_child(api=api, desired=child, owner=owner, initial_replicas=initial)
        except (apply.NameConflict, ApiException) as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(max_workers=APPLY_CONCURRENCY) as pool:
        return list(pool.map(apply_one, rendered.children))


def _apply(*, api: kube.KubeAPI, parsed: _Parsed, rendered: _Rendered) -> _ApplyReport:
    """Apply the children and report what happened (Events); API errors are written to
    status and raised as :class:`RetryableError`."""
    obj = parsed.obj
    report = _ApplyReport(created=[], updated=[], conflicts=[], conflict_messages=[], deployments={})
    api_errors: list[str] = []
    results = _apply_all(api=api, parsed=parsed, rendered=rendered)
    for child, result in zip(rendered.children, results, strict=True):
        label = f"{child['kind']}/{child['metadata']['name']}"
        if isinstance(result, apply.NameConflict):
            report.conflicts.append(label)
            report.conflict_messages.append(str(result))
        elif isinstance(result, BaseException):
            api_errors.append(f"applying {label} failed: {kube.error_message(result)}")
        else:
            if result.outcome is apply.Outcome.CREATED:
                report.created.append(label)
            elif result.outcome is apply.Outcome.UPDATED:
                report.updated.append(label)
            role_value = _role_of(child)
            if child["kind"] == "Deployment" and role_value:
                report.deployments[Role(role_value)] = result.obj
    if api_errors:
        message = "; ".join(api_errors)
        events.warning(obj=obj, reason=Reason.API_ERROR, message=message)
        _write_status(api=api, obj=obj, fields={}, conditions=_conditions(
            ready=("False", Reason.API_ERROR, message), reconciling=("True", Reason.API_ERROR, message),
            stalled=("False", Reason.API_ERROR, message)))
        raise RetryableError(message)
    if report.created:
        events.normal(obj=obj, reason=Reason.CHILDREN_CREATED, message="Created " + ", ".join(report.created))
    if report.updated:
        events.normal(obj=obj, reason=Reason.CHILDREN_UPDATED, message="Updated " + ", ".join(report.updated))
    if report.conflicts and _previous_reason(obj, ConditionType.STALLED) != Reason.NAME_CONFLICT:
        events.warning(obj=obj, reason=Reason.NAME_CONFLICT, message="; ".join(report.conflict_messages))
    return report


def _list_pods(*, api: kube.KubeAPI, parsed: _Parsed) -> list[dict[str, Any]]:
    selector = f"{contract.LABEL_INSTANCE}={parsed.name},{contract.LABEL_NAME}={contract.LABEL_NAME_VALUE}"
    try:
        return api.list(kind=kube.POD, namespace=parsed.namespace, label_selector=selector)
    except ApiException as exc:
        raise RetryableError(f"listing pods failed: {kube.error_message(exc)}") from exc


def _gpu_shortfalls(*, comps: Sequence[Component], pools: Mapping[Role, PoolObservation],
                    pods: Sequence[Mapping[str, Any]], node_list: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Pools whose GPU pods do not fit the eligible nodes, else pods stuck Pending for GPUs."""
    shortfalls: list[str] = []
    for comp in comps:
        if comp.pool is None or comp.role not in pools or node_list is None:
            continue
        gap = capacity.gpu_shortfall(
            pool=comp.role.value, pods=pools[comp.role].desired,
            gpus_per_pod=comp.pool.resources.gpus, node_selector=comp.pool.node_selector,
            tolerations=comp.pool.tolerations, nodes=node_list)
        if gap is not None:
            shortfalls.append(gap.message())
    stuck = capacity.unschedulable_gpu_pods(pods)
    if stuck and not shortfalls:
        shortfalls.append(f"pods pending for lack of {capacity.GPU_RESOURCE}: {', '.join(sorted(stuck)[:5])}")
    return shortfalls


def start_failures(*, pools: Mapping[Role, PoolObservation],
                   pods: Sequence[Mapping[str, Any]]) -> list[PodStartFailure]:
    """One failing pod per pool that has no ready replica (a pool still serving from another
    replica is not reported: its rollout or the Deployment's own status says enough)."""
    out: list[PodStartFailure] = []
    for role, pool in pools.items():
        if pool.ready >= 1:
            continue
        failures = [f for f in map(pod_start_failure, pods) if f is not None and f.role == role.value]
        if failures:  # a model failure says the most, then any other
            out.append(sorted(failures, key=lambda f: (not f.model_unavailable, f.pod))[0])
    return out


def _observe(*, api: kube.KubeAPI, parsed: _Parsed, rendered: _Rendered, report: _ApplyReport,
             nodes: NodeCache | None) -> _Observed:
    pods = _list_pods(api=api, parsed=parsed)
    pools = {role: observe_deployment(role=role, deployment=dep, pods=pods)
             for role, dep in report.deployments.items()}
    node_list = (nodes or NodeCache()).nodes(api=api)
    shortfalls = _gpu_shortfalls(comps=rendered.comps, pools=pools, pods=pods, node_list=node_list)
    if shortfalls and _previous_reason(parsed.obj, ConditionType.STALLED) != Reason.INSUFFICIENT_GPU_CAPACITY:
        events.warning(obj=parsed.obj, reason=Reason.INSUFFICIENT_GPU_CAPACITY, message="; ".join(shortfalls))
    return _Observed(pools=pools, shortfalls=shortfalls, start_failures=start_failures(pools=pools, pods=pods))


def _decide(*, parsed: _Parsed, rendered: _Rendered, report: _ApplyReport, observed: _Observed) -> _Verdict:
    """The three conditions, by precedence: name conflict, ready, GPU shortfall, pods failing
    at start-up, progressing. A newly reported start failure gets one Warning Event."""
    pools = observed.pools
    all_present = len(pools) == len(rendered.comps)
    ready = all_present and not report.conflicts and all(o.ready >= 1 and o.rolled_out for o in pools.values())
    waiting = ", ".join(
        f"{o.role.value} {o.ready}/{o.desired} ready" for o in pools.values() if not (o.ready >= 1 and o.rolled_out)
    )
    if report.conflicts:
        msg = "; ".join(report.conflict_messages)
        return _Verdict(_stalled(Reason.NAME_CONFLICT, msg), Reason.NAME_CONFLICT, False, msg)
    if ready:
        msg = "All pools are ready and rolled out"
        conds = _conditions(ready=("True", Reason.RECONCILED, msg), reconciling=("False", Reason.RECONCILED, msg),
                            stalled=("False", Reason.RECONCILED, msg))
        return _Verdict(conds, Reason.RECONCILED, True, msg)
    if observed.shortfalls or observed.start_failures:
        if observed.shortfalls:
            reason, msg = Reason.INSUFFICIENT_GPU_CAPACITY, "; ".join(observed.shortfalls)
        else:
            reason = observed.start_failures[0].reason
            msg = "; ".join(f.describe() for f in observed.start_failures)
            if _previous_reason(parsed.obj, ConditionType.STALLED) != reason:
                events.warning(obj=parsed.obj, reason=reason, message=msg)
        conds = _conditions(ready=("False", reason, msg),
                            reconciling=("True", Reason.ROLLOUT_IN_PROGRESS, waiting or msg),
                            stalled=("True", reason, msg))
        return _Verdict(conds, reason, False, msg)
    reason = Reason.CHILDREN_CREATED if report.created else Reason.ROLLOUT_IN_PROGRESS
    msg = f"Waiting for {waiting}" if waiting else "Waiting for rollouts"
    conds = _conditions(ready=("False", reason, msg), reconciling=("True", reason, msg),
                        stalled=("False", Reason.PROGRESSING, "Rollout is progressing"))
    return _Verdict(conds, Reason.PROGRESSING, False, msg)


def _status_fields(*, parsed: _Parsed, settings: ReconcileSettings, observed: _Observed) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "observedGeneration": parsed.obj["metadata"].get("generation"),
        "endpoint": endpoint_of(name=parsed.name, namespace=parsed.namespace),
        "compatHash": render.compat_hash_of(isvc=parsed.isvc, runtime_image=settings.runtime_image),
    }
    for role, o in observed.pools.items():
        fields[_status_key(role)] = {"replicas": o.replicas, "readyReplicas": o.ready,
                                     "desiredReplicas": o.desired, "pendingReplicas": o.pending,
                                     "summary": f"{o.ready}/{o.desired}"}
    return fields


def reconcile(*, api: kube.KubeAPI, obj: Mapping[str, Any], settings: ReconcileSettings,
              nodes: NodeCache | None = None) -> Result:
    """Converge the children of ``obj`` (a live InferenceService) and write its status.
    A paused object is not touched at all (the caller should not even call this)."""
    if is_paused(obj):
        return Result(outcome=Reason.PAUSED)
    parsed = _parse(api=api, obj=obj)
    if parsed is None:
        return Result(outcome=Reason.INVALID_SPEC)
    rendered = _render(parsed=parsed, settings=settings)
    report = _apply(api=api, parsed=parsed, rendered=rendered)
    observed = _observe(api=api, parsed=parsed, rendered=rendered, report=report, nodes=nodes)
    verdict = _decide(parsed=parsed, rendered=rendered, report=report, observed=observed)
    _write_status(api=api, obj=obj, fields=_status_fields(parsed=parsed, settings=settings, observed=observed),
                  conditions=verdict.conditions)
    if verdict.ready and _previous_reason(obj, ConditionType.READY) != Reason.RECONCILED:
        events.normal(obj=obj, reason=Reason.READY, message=verdict.message)
    return Result(outcome=verdict.outcome, created=tuple(report.created), updated=tuple(report.updated),
                  conflicts=tuple(report.conflicts), ready=verdict.ready)
