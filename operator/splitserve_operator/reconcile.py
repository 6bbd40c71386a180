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

Apply also creates the KV handoff key Secret of a disaggregated service, once
(:mod:`handoff_key`). Children are applied in waves, each after what it uses
(:mod:`dependencies`), and a child that uses an object this InferenceService does not control
(a ``NameConflict``: a planted ServiceAccount, Role, RoleBinding or handoff key Secret) is not
applied at all. Observation covers the Deployments, the pods (pending ones, and pods
that cannot run: :mod:`failures`), and GPU capacity.

Router mode InferencePool (:mod:`inference_pool`): the endpoint picker stands where the router
stands (its Deployment's counts are ``status.router``, and Ready waits for it); its
ServiceAccount and Role are applied before its RoleBinding and Deployment (the API server
checks a RoleBinding against the Role it names, and neither is applied over a planted
ServiceAccount or Role); and a cluster without the InferencePool CRD is
``Stalled=True``/``InferencePoolCRDMissing`` (the other children are applied, and the reconcile
is retried with back-off until the CRD is there).

A pool whose replicas span several nodes is a LeaderWorkerSet (:mod:`leader_worker_set`): its
counts are groups (a group is ready when all its pods are), and a cluster without the LWS CRD is
``Stalled=True``/``LeaderWorkerSetCRDMissing`` the same way.

Conditions are kstatus-compatible (Ready / Reconciling / Stalled) with CamelCase reasons;
problems become conditions and Events, never exceptions out of the operator. A child that
cannot come up is ``Stalled=True`` with the child's own reason and message (FailedCreate,
ImagePullBackOff, OOMKilled, ModelUnavailable, ProgressDeadlineExceeded, ...). A spec that can
never apply (the models refuse it, or the API server refuses a child for good:
:mod:`apierrors`) is ``Stalled=True``/``InvalidSpec`` and is not touched again until its
generation changes. The only exception that escapes is :class:`RetryableError`, for API
failures worth retrying with backoff (the handler turns it into ``kopf.TemporaryError``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason, Role
from splitserve_contract.engines import VLLM_IMAGE

from . import (
    apierrors,
    apply,
    capacity,
    child_cache,
    dependencies,
    events,
    failures,
    handoff_key,
    inference_pool,
    kube,
    leader_worker_set,
    naming,
    render,
    status,
)
from .api import InferenceService, InvalidSpecError
from .render import Component
from .status import ConditionUpdate

logger = logging.getLogger(__name__)

NODE_CACHE_SECONDS: Final = 10.0
APPLY_CONCURRENCY: Final = 24
"""Threads applying children, shared by all reconciles (:func:`_apply_pool`): one reconcile
applies all of its 14 children in one wave, and with the reconciles' own threads (asyncio's
default executor) the requests in flight stay within the API client's 32 connections, so none
is opened and thrown away (a TLS handshake each) when many services are reconciled at once."""
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _apply_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=APPLY_CONCURRENCY, thread_name_prefix="apply")
        return _pool


class RetryableError(Exception):
    """A reconcile failed for a reason that may go away (API errors): retry with backoff."""


@dataclasses.dataclass(frozen=True)
class ReconcileSettings:
    runtime_image: str
    router_service_account: str = ""
    vllm_image: str = VLLM_IMAGE
    """Image of vLLM pools that set no spec.runtime.image (``--vllm-image``)."""
    inference_pool: bool = True
    """Whether spec.router.mode InferencePool may be reconciled. The operator sets it from its
    flag ``--inference-pool`` (the chart's ``inferencePool.enabled``, off by default): without
    it the operator holds no permission to create the endpoint picker's ServiceAccount, Role and
    RoleBinding, and such a service is Stalled/InferencePoolDisabled
    (:func:`_report_inference_pool_disabled`)."""


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
    Paused, or the reason of a child that cannot come up (ModelUnavailable, PodStartFailed,
    FailedCreate, ImagePullBackOff, ...: :mod:`failures`)."""
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
            except kube.ApiException as exc:
                if exc.status in (401, 403):
                    if not self._warned:  # a namespace-scoped install has no node access
                        logger.warning("Cannot list nodes (%s): only Pending pods reveal missing GPUs", exc.status)
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
    if leader_worker_set.is_leader_worker_set(deployment):  # a multi-node pool: counted in groups
        groups = leader_worker_set.count_groups(lws=deployment, pods=pods)
        return PoolObservation(
            role=role,
            replicas=groups.replicas,
            ready=groups.ready,
            desired=groups.desired,
            pending=groups.pending,
            rolled_out=groups.rolled_out,
        )
    spec = deployment.get("spec") or {}
    st = deployment.get("status") or {}
    generation = int(deployment.get("metadata", {}).get("generation") or 0)
    desired = int(spec["replicas"]) if spec.get("replicas") is not None else 1
    replicas = int(st.get("replicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    rolled_out = (
        int(st.get("observedGeneration") or 0) >= generation
        and updated >= desired
        and replicas <= desired
        and available >= desired
    )
    role_pods = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(contract.LABEL_ROLE) == role.value]
    pending = sum(
        1
        for p in role_pods
        if (p.get("status") or {}).get("phase") == "Pending" and not p.get("metadata", {}).get("deletionTimestamp")
    )
    return PoolObservation(
        role=role,
        replicas=replicas,
        ready=int(st.get("readyReplicas") or 0),
        desired=desired,
        pending=pending,
        rolled_out=rolled_out,
    )


def _status_key(role: Role) -> str:
    return role.value  # prefill | decode | aggregated | router


def _previous(obj: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def _previous_reason(obj: Mapping[str, Any], type_: str) -> str | None:
    reason = _previous(obj, type_).get("reason")
    return None if reason is None else str(reason)


def _already_stalled(obj: Mapping[str, Any], reason: str) -> bool:
    """Whether ``obj`` was reported Stalled for ``reason`` at its current generation."""
    cond = _previous(obj, ConditionType.STALLED)
    generation = (obj.get("metadata") or {}).get("generation")
    return (
        cond.get("status") == "True" and cond.get("reason") == reason and cond.get("observedGeneration") == generation
    )


API_REFUSED_PREFIX = "The API server refused a child for good: "
"""How a Stalled/InvalidSpec message starts when the API server, not the models, refused."""


def spec_never_applies(obj: Mapping[str, Any]) -> bool:
    """An InferenceService whose current generation the API server refused (a child refused for
    good): nothing is sent again until the spec changes. A spec the *models* refused is parsed
    again instead (cheap, no API call): the verdict may come from another operator version, e.g.
    one that read the object through a newer CRD, and must not outlive an operator upgrade."""
    return _already_stalled(obj, Reason.INVALID_SPEC) and str(
        _previous(obj, ConditionType.STALLED).get("message", "")
    ).startswith(API_REFUSED_PREFIX)


def _write_status(
    *, api: kube.KubeAPI, obj: Mapping[str, Any], fields: Mapping[str, Any], conditions: list[ConditionUpdate]
) -> None:
    meta = obj["metadata"]
    try:
        status.patch_status(
            api=api,
            namespace=meta["namespace"],
            name=meta["name"],
            fields=fields,
            conditions=conditions,
            observed_generation=meta.get("generation"),
            live=obj,
        )
    except kube.ApiException as exc:
        raise RetryableError(f"status write failed: {kube.error_message(exc)}") from exc


Observation = tuple[status.ConditionStatusValue, str, str]
"""(status, reason, message) of one condition."""


def _conditions(*, ready: Observation, reconciling: Observation, stalled: Observation) -> list[ConditionUpdate]:
    return [
        ConditionUpdate(ConditionType.READY, *ready),
        ConditionUpdate(ConditionType.RECONCILING, *reconciling),
        ConditionUpdate(ConditionType.STALLED, *stalled),
    ]


def _stalled(reason: str, message: str) -> list[ConditionUpdate]:
    """Ready=False, Reconciling=False, Stalled=True, all for ``reason``. Reconciling is False:
    kstatus reads the first of Reconciling/Stalled that is True, and a stalled object is not
    making progress."""
    return _conditions(
        ready=("False", reason, message), reconciling=("False", reason, message), stalled=("True", reason, message)
    )


def _report_invalid_spec(*, api: kube.KubeAPI, obj: Mapping[str, Any], message: str) -> None:
    """Stalled/InvalidSpec at the current generation, and one Warning Event per generation."""
    if not _already_stalled(obj, Reason.INVALID_SPEC):
        events.warning(obj=obj, reason=Reason.INVALID_SPEC, message=message)
    _write_status(
        api=api,
        obj=obj,
        fields={"observedGeneration": obj["metadata"].get("generation")},
        conditions=_stalled(Reason.INVALID_SPEC, message),
    )


def _report_inference_pool_disabled(*, api: kube.KubeAPI, parsed: _Parsed) -> None:
    """Stalled/InferencePoolDisabled, and one Warning Event per generation; nothing is applied
    and nothing retried: an operator restarted with the mode on reconciles every service again."""
    obj, reason, message = parsed.obj, Reason.INFERENCE_POOL_DISABLED, inference_pool.disabled_message(parsed.name)
    if not _already_stalled(obj, reason):
        events.warning(obj=obj, reason=reason, message=message)
    _write_status(
        api=api,
        obj=obj,
        fields={"observedGeneration": obj["metadata"].get("generation")},
        conditions=_stalled(reason, message),
    )


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

    @property
    def roles(self) -> frozenset[Role]:
        """The Deployments Ready waits for, by role (the endpoint picker as the router)."""
        roles = {c.role for c in self.comps}
        if any(inference_pool.is_picker(c) and c["kind"] == "Deployment" for c in self.children):
            roles.add(Role.ROUTER)
        return frozenset(roles)


@dataclasses.dataclass(frozen=True)
class _ApplyReport:
    created: list[str]
    updated: list[str]
    conflicts: list[str]
    conflict_messages: list[str]
    deployments: dict[Role, dict[str, Any]]
    """Applied Deployments by role; the endpoint picker's under Role.ROUTER."""
    planned: list[child_cache.PlannedChild] = dataclasses.field(default_factory=list)
    """Each child applied without error (what a later reconcile may skip: :func:`_unchanged`)."""
    not_applied: list[str] = dataclasses.field(default_factory=list)
    """Children not sent because something they use is not ours or was not applied."""


@dataclasses.dataclass(frozen=True)
class _Observed:
    pools: dict[Role, PoolObservation]
    shortfalls: list[str]
    replica_failures: list[failures.DeploymentFailure]
    """Pools whose pods cannot be created (Deployment ReplicaFailure)."""
    pod_failures: list[failures.PodFailure]
    """Failing pods of pools without a ready replica (one per pool)."""
    stuck_rollouts: list[failures.DeploymentFailure]
    """Pools past their progress deadline."""


@dataclasses.dataclass(frozen=True)
class _Verdict:
    conditions: list[ConditionUpdate]
    outcome: str
    ready: bool
    message: str


def _parse(*, api: kube.KubeAPI, obj: Mapping[str, Any]) -> _Parsed | None:
    """The parsed spec; None after reporting an invalid one (Event per generation, status)."""
    meta = obj["metadata"]
    try:
        isvc = InferenceService.parse(obj)
    except InvalidSpecError as exc:
        _report_invalid_spec(api=api, obj=obj, message=str(exc))
        return None
    return _Parsed(obj=obj, name=str(meta["name"]), namespace=str(meta["namespace"]), isvc=isvc)


def _render(*, parsed: _Parsed, settings: ReconcileSettings) -> _Rendered:
    children = render.render_children(
        isvc=parsed.isvc,
        runtime_image=settings.runtime_image,
        vllm_image=settings.vllm_image,
        router_service_account=settings.router_service_account,
    )
    return _Rendered(children=children, comps=render.components(parsed.isvc.spec))


def _role_of(child: Mapping[str, Any]) -> str | None:
    role = (child["metadata"].get("labels") or {}).get(contract.LABEL_ROLE)
    return str(role) if role else None


def _owner(parsed: _Parsed) -> apply.Owner:
    return apply.Owner(name=parsed.name, uid=str(parsed.obj["metadata"]["uid"]))


def _handoff_key_of(*, parsed: _Parsed, rendered: _Rendered) -> child_cache.ChildKey | None:
    """Where the KV handoff key Secret is, when a pool of ``rendered`` mounts it."""
    if not any(render.uses_handoff_key(c.role) or render.is_multi_node(c) for c in rendered.comps):
        return None
    return (kube.SECRET.api_version, kube.SECRET.kind, parsed.namespace, naming.handoff_key_secret_name(parsed.name))


def _ensure_handoff_key(
    *, api: kube.KubeAPI, parsed: _Parsed, children: child_cache.ChildCache | None = None
) -> apply.NameConflict | kube.ApiException | None:
    """Create the KV handoff key Secret unless ours is there (:func:`handoff_key.ensure`);
    the name conflict or the API error, if any."""
    try:
        handoff_key.ensure(
            api=api,
            isvc_name=parsed.name,
            namespace=parsed.namespace,
            owner_reference=_owner(parsed).reference(),
            cache=children,
        )
    except (apply.NameConflict, kube.ApiException) as exc:
        return exc
    return None


WORKLOAD_KINDS: Final = frozenset({kube.DEPLOYMENT.kind, kube.LEADER_WORKER_SET.kind})
"""The kinds a pool is rendered as; its replica count is the autoscaler's."""


def _replica_counts(*, parsed: _Parsed, child: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(initial, fixed) replicas of a child for :func:`apply.apply_child`."""
    role_value = _role_of(child)
    if child["kind"] == "Deployment" and inference_pool.is_picker(child):
        return None, inference_pool.PICKER_REPLICAS
    if child["kind"] in WORKLOAD_KINDS:
        return (
            render.initial_replicas(isvc=parsed.isvc, role=Role(str(role_value))),
            parsed.isvc.spec.router.replicas if role_value == Role.ROUTER.value else None,
        )
    return None, None


@dataclasses.dataclass(frozen=True)
class NotApplied:
    """A child left unapplied because something it needs is not ours or was not applied
    (:mod:`.dependencies`)."""

    cause: child_cache.ChildKey


ApplyResult = apply.Applied | BaseException | NotApplied


def _label(key: child_cache.ChildKey) -> str:
    return f"{key[1]}/{key[3]}"


def _apply_all(
    *,
    api: kube.KubeAPI,
    parsed: _Parsed,
    rendered: _Rendered,
    children: child_cache.ChildCache | None = None,
    handoff: child_cache.ChildKey | None = None,
) -> tuple[list[ApplyResult], ApplyResult | None]:
    """Apply every child, and create the KV handoff key Secret at ``handoff`` (None: no pool
    mounts one), in waves (:func:`dependencies.waves`): what needs nothing first, all at once
    (a PATCH each, a GET first for one the watch has not shown us, nothing for one the watch
    shows as our last apply left it), then what needs those, and so on. A child whose needs
    are not all ours and applied is not sent (:class:`NotApplied`). Results come in the order
    of ``rendered.children``, then the Secret's (None when ``handoff`` is None; its success is
    an :class:`apply.Applied` with an empty object)."""
    owner = _owner(parsed)
    by_key = {child_cache.key_of(c): c for c in rendered.children}
    edges = dependencies.needs(rendered.children, also_made=[handoff] if handoff is not None else [])
    if handoff is not None:
        edges[handoff] = set()

    def apply_one(key: child_cache.ChildKey) -> ApplyResult:
        if key == handoff:
            error = _ensure_handoff_key(api=api, parsed=parsed, children=children)
            return error if error is not None else apply.Applied({}, apply.Outcome.UNCHANGED)
        child = by_key[key]
        initial, fixed = _replica_counts(parsed=parsed, child=child)
        # a LeaderWorkerSet is sent only when it changed (see apply_unless_held)
        applier = (
            leader_worker_set.apply_unless_held if child["kind"] == kube.LEADER_WORKER_SET.kind else apply.apply_child
        )
        try:
            return applier(
                api=api,
                desired=child,
                owner=owner,
                initial_replicas=initial,
                fixed_replicas=fixed,
                cache=children,
                defer_hand_over=True,
            )
        except (apply.NameConflict, kube.ApiException) as exc:
            return exc

    def finish(applied: apply.Applied) -> ApplyResult:
        assert applied.finish is not None
        try:
            return applied.finish()
        except kube.ApiException as exc:
            return exc

    results: dict[child_cache.ChildKey, ApplyResult] = {}
    pool = _apply_pool()
    for wave in dependencies.waves(edges):
        failed = {k for k, r in results.items() if not isinstance(r, apply.Applied | NotApplied)}
        stopped = dependencies.blocked(edges, failed)
        for key in wave:
            if key in stopped:
                results[key] = NotApplied(cause=stopped[key])
        sent = [key for key in wave if key not in stopped]
        results.update(zip(sent, pool.map(apply_one, sent), strict=True))
    # Replica hand-overs of created pools, once every child exists: they do not hold up the rest.
    later = {k: r for k, r in results.items() if isinstance(r, apply.Applied) and r.finish is not None}
    results.update(zip(later, pool.map(finish, later.values()), strict=True))
    return ([results[child_cache.key_of(c)] for c in rendered.children], None if handoff is None else results[handoff])


OPTIONAL_CRD_KINDS: Final = (kube.INFERENCE_POOL.kind, kube.LEADER_WORKER_SET.kind)
"""Kinds of other projects' CRDs, which a cluster may lack; reported in this order."""


def _crd_missing(child: Mapping[str, Any], result: apply.Applied | BaseException) -> bool:
    """The apply of an InferencePool or a LeaderWorkerSet found no such resource: the CRD is not
    installed (a PATCH of a kind the API server serves creates the object, it never answers 404)."""
    return child["kind"] in OPTIONAL_CRD_KINDS and isinstance(result, BaseException) and kube.is_not_found(result)


def _report_crd_missing(*, api: kube.KubeAPI, parsed: _Parsed, kind: str) -> None:
    """Stalled/InferencePoolCRDMissing or LeaderWorkerSetCRDMissing (a Warning Event when it
    starts), then retry with back-off: installing the CRD sends no event the operator watches."""
    obj = parsed.obj
    if kind == kube.LEADER_WORKER_SET.kind:
        reason = Reason.LEADER_WORKER_SET_CRD_MISSING
        message = leader_worker_set.crd_missing_message(
            parsed.name, [c.role for c in render.components(parsed.isvc.spec) if render.is_multi_node(c)]
        )
    else:
        reason, message = Reason.INFERENCE_POOL_CRD_MISSING, inference_pool.crd_missing_message(parsed.name)
    if _previous_reason(obj, ConditionType.STALLED) != reason:
        events.warning(obj=obj, reason=reason, message=message)
    _write_status(
        api=api,
        obj=obj,
        fields={"observedGeneration": obj["metadata"].get("generation")},
        conditions=_stalled(reason, message),
    )
    raise RetryableError(message)


def _apply(
    *, api: kube.KubeAPI, parsed: _Parsed, rendered: _Rendered, children: child_cache.ChildCache | None = None
) -> _ApplyReport | None:
    """Apply the children and report what happened (Events). A child the API server refuses
    for good (:func:`apierrors.is_permanent`) makes the spec invalid: reported as
    Stalled/InvalidSpec with the server's words, None is returned and nothing is retried.
    Other API errors are written to status and raised as :class:`RetryableError`."""
    obj = parsed.obj
    report = _ApplyReport(created=[], updated=[], conflicts=[], conflict_messages=[], deployments={})
    permanent: list[str] = []
    transient: list[str] = []

    def failed(what: str, exc: BaseException) -> None:
        text = f"{what} failed: {kube.error_message(exc)}"
        (permanent if apierrors.is_permanent(exc) else transient).append(text)

    handoff = _handoff_key_of(parsed=parsed, rendered=rendered)
    results, key_result = _apply_all(api=api, parsed=parsed, rendered=rendered, children=children, handoff=handoff)
    not_applied: dict[child_cache.ChildKey, list[str]] = {}
    if handoff is not None and isinstance(key_result, apply.NameConflict):
        report.conflicts.append(_label(handoff))
        report.conflict_messages.append(str(key_result))
    elif handoff is not None and isinstance(key_result, BaseException):
        failed(f"creating {_label(handoff)}", key_result)
    crd_missing: set[str] = set()
    for child, result in zip(rendered.children, results, strict=True):
        label = f"{child['kind']}/{child['metadata']['name']}"
        if isinstance(result, NotApplied):
            not_applied.setdefault(result.cause, []).append(label)
        elif _crd_missing(child, result):
            crd_missing.add(str(child["kind"]))
        elif isinstance(result, apply.NameConflict):
            report.conflicts.append(label)
            report.conflict_messages.append(str(result))
        elif isinstance(result, BaseException):
            failed(f"applying {label}", result)
        else:
            if result.outcome is apply.Outcome.CREATED:
                report.created.append(label)
            elif result.outcome is apply.Outcome.UPDATED:
                report.updated.append(label)
            role_value = _role_of(child)
            deployment_role: Role | None = None
            if child["kind"] == "Deployment" and inference_pool.is_picker(child):
                deployment_role = Role.ROUTER
            elif child["kind"] in WORKLOAD_KINDS and role_value:
                deployment_role = Role(role_value)
            if deployment_role is not None:
                report.deployments[deployment_role] = result.obj
            initial, fixed = _replica_counts(parsed=parsed, child=child)
            report.planned.append(
                child_cache.PlannedChild(
                    key=child_cache.key_of(child),
                    digest=result.digest,
                    hands_over_replicas=initial is not None and fixed is None,
                    deployment_role=None if deployment_role is None else deployment_role.value,
                )
            )
    for cause, labels in not_applied.items():
        what = "not controlled by this InferenceService" if _label(cause) in report.conflicts else "not applied"
        text = f"{', '.join(labels)} not applied: {_label(cause)}, which they use, is {what}"
        report.not_applied.extend(labels)
        (report.conflict_messages if _label(cause) in report.conflicts else transient).append(text)
    if permanent:  # retrying cannot help, whatever else failed
        _report_invalid_spec(api=api, obj=obj, message=API_REFUSED_PREFIX + "; ".join(permanent))
        return None
    if crd_missing:
        _report_crd_missing(api=api, parsed=parsed, kind=next(k for k in OPTIONAL_CRD_KINDS if k in crd_missing))
    if transient:
        message = "; ".join(transient)
        events.warning(obj=obj, reason=Reason.API_ERROR, message=message)
        _write_status(
            api=api,
            obj=obj,
            fields={},
            conditions=_conditions(
                ready=("False", Reason.API_ERROR, message),
                reconciling=("True", Reason.API_ERROR, message),
                stalled=("False", Reason.API_ERROR, message),
            ),
        )
        raise RetryableError(message)
    if report.created:
        events.normal(obj=obj, reason=Reason.CHILDREN_CREATED, message="Created " + ", ".join(report.created))
    if report.updated:
        events.normal(obj=obj, reason=Reason.CHILDREN_UPDATED, message="Updated " + ", ".join(report.updated))
    if report.conflicts and _previous_reason(obj, ConditionType.STALLED) != Reason.NAME_CONFLICT:
        events.warning(obj=obj, reason=Reason.NAME_CONFLICT, message="; ".join(report.conflict_messages))
    return report


def _spec_key(*, parsed: _Parsed, settings: ReconcileSettings) -> str:
    """Everything the rendered children depend on: the spec, the object's identity, the settings."""
    return child_cache.digest(
        {
            "uid": parsed.obj["metadata"].get("uid"),
            "name": parsed.name,
            "namespace": parsed.namespace,
            "spec": parsed.isvc.spec.model_dump(mode="json"),
            "settings": dataclasses.asdict(settings),
        }
    )


def _unchanged(
    *, api: kube.KubeAPI, parsed: _Parsed, spec_key: str, children: child_cache.ChildCache | None
) -> tuple[_Rendered, _ApplyReport] | None:
    """Render and apply stages skipped: this spec was applied completely before and the watch
    shows every child as that apply left it (:meth:`child_cache.ChildCache.unchanged`), so a
    render would produce the same bodies and every apply would change nothing. Only the KV
    handoff key is checked again (no request while its watch shows it as ours; a deleted one
    is created again). None: render and apply."""
    plan = None if children is None else children.plan((parsed.namespace, parsed.name), spec_key=spec_key)
    if children is None or plan is None:
        return None
    uid = str(parsed.obj["metadata"].get("uid"))
    deployments: dict[Role, dict[str, Any]] = {}
    for planned in plan.children:
        seen = children.unchanged(
            planned.key, digest=planned.digest, owner_uid=uid, hands_over_replicas=planned.hands_over_replicas
        )
        if seen is None:
            return None
        if planned.deployment_role is not None:
            deployments[Role(planned.deployment_role)] = seen.obj
    rendered = _Rendered(children=[], comps=render.components(parsed.isvc.spec))
    if (
        _handoff_key_of(parsed=parsed, rendered=rendered) is not None
        and _ensure_handoff_key(api=api, parsed=parsed, children=children) is not None
    ):
        return None  # the full path reports the conflict or the error
    return rendered, _ApplyReport(
        created=[], updated=[], conflicts=[], conflict_messages=[], deployments=deployments, planned=list(plan.children)
    )


def _remember(
    *,
    parsed: _Parsed,
    rendered: _Rendered,
    report: _ApplyReport,
    spec_key: str,
    children: child_cache.ChildCache | None,
) -> None:
    """Keep the plan of a complete, conflict-free apply whose every child is watched (the only
    kind :func:`_unchanged` can vouch for)."""
    if (
        children is None
        or report.conflicts
        or len(report.planned) != len(rendered.children)
        or not all(children.watches(p.key) for p in report.planned)
    ):
        return
    children.remember_plan(
        (parsed.namespace, parsed.name), child_cache.Plan(spec_key=spec_key, children=tuple(report.planned))
    )


def _list_pods(*, api: kube.KubeAPI, parsed: _Parsed) -> list[dict[str, Any]]:
    selector = f"{contract.LABEL_INSTANCE}={parsed.name},{contract.LABEL_NAME}={contract.LABEL_NAME_VALUE}"
    try:
        return api.list(kind=kube.POD, namespace=parsed.namespace, label_selector=selector)
    except kube.ApiException as exc:
        raise RetryableError(f"listing pods failed: {kube.error_message(exc)}") from exc


def _gpu_shortfalls(
    *,
    comps: Sequence[Component],
    pools: Mapping[Role, PoolObservation],
    pods: Sequence[Mapping[str, Any]],
    node_list: Sequence[Mapping[str, Any]] | None,
) -> list[str]:
    """Pools whose GPU pods do not fit the eligible nodes, else pods stuck Pending for GPUs."""
    shortfalls: list[str] = []
    for comp in comps:
        if comp.pool is None or comp.role not in pools or node_list is None:
            continue
        gap = capacity.gpu_shortfall(
            pool=comp.role.value,
            pods=pools[comp.role].desired * comp.pool.resources.pods_per_replica,
            gpus_per_pod=comp.pool.resources.gpus_per_pod,
            node_selector=comp.pool.node_selector,
            tolerations=comp.pool.tolerations,
            nodes=node_list,
        )
        if gap is not None:
            shortfalls.append(gap.message())
    stuck = capacity.unschedulable_gpu_pods(pods)
    if stuck and not shortfalls:
        shortfalls.append(f"pods pending for lack of {capacity.GPU_RESOURCE}: {', '.join(sorted(stuck)[:5])}")
    return shortfalls


def pod_failures(
    *, pools: Mapping[Role, PoolObservation], pods: Sequence[Mapping[str, Any]]
) -> list[failures.PodFailure]:
    """One failing pod per pool that has no ready replica (a pool still serving from another
    replica is not reported: its rollout, or its progress deadline, says enough). The endpoint
    picker's pods carry no role; they count as the router's."""
    out = failures.pod_failures(roles=[role for role, pool in pools.items() if pool.ready < 1], pods=pods)
    picker = pools.get(Role.ROUTER)
    if picker is not None and picker.ready < 1:
        out += [
            f for f in map(failures.pod_failure, (p for p in pods if inference_pool.is_picker(p))) if f is not None
        ][:1]
    return out


def _observe(
    *, api: kube.KubeAPI, parsed: _Parsed, rendered: _Rendered, report: _ApplyReport, nodes: NodeCache | None
) -> _Observed:
    pods = _list_pods(api=api, parsed=parsed)
    pools = {role: observe_deployment(role=role, deployment=dep, pods=pods) for role, dep in report.deployments.items()}
    node_list = (nodes or NodeCache()).nodes(api=api)
    shortfalls = _gpu_shortfalls(comps=rendered.comps, pools=pools, pods=pods, node_list=node_list)
    return _Observed(
        pools=pools,
        shortfalls=shortfalls,
        replica_failures=failures.replica_failures(report.deployments),
        pod_failures=pod_failures(pools=pools, pods=pods),
        stuck_rollouts=own_stuck_rollouts(
            failures.stuck_rollouts(report.deployments),
            pools=pools,
            builtin_router=not inference_pool.enabled(parsed.isvc.spec),
        ),
    )


def own_stuck_rollouts(
    stuck: Sequence[failures.DeploymentFailure], *, pools: Mapping[Role, PoolObservation], builtin_router: bool
) -> list[failures.DeploymentFailure]:
    """``stuck`` less the bundled router's rollout while no decode or aggregated pod is ready:
    the router is Ready only with a healthy pod to send to, so its deadline then passes because
    of that pool (which reports its own failure), and "router: ReplicaSet has timed out" would
    blame the router for a failed engine."""
    serving = any(o.ready >= 1 for role, o in pools.items() if role in (Role.DECODE, Role.AGGREGATED))
    if serving or not builtin_router:
        return list(stuck)
    return [f for f in stuck if f.role != Role.ROUTER.value]


def _blocker(observed: _Observed) -> tuple[str, str] | None:
    """(reason, message) of what keeps the pools from coming up, most direct evidence first:
    pods that cannot be created, GPUs that do not exist, pods that cannot start, rollouts past
    their deadline. None while the rollout may still progress."""
    if observed.replica_failures:
        return observed.replica_failures[0].reason, "; ".join(f.describe() for f in observed.replica_failures)
    if observed.shortfalls:
        return Reason.INSUFFICIENT_GPU_CAPACITY, "; ".join(observed.shortfalls)
    if observed.pod_failures:
        return observed.pod_failures[0].reason, "; ".join(f.describe() for f in observed.pod_failures)
    if observed.stuck_rollouts:
        return observed.stuck_rollouts[0].reason, "; ".join(f.describe() for f in observed.stuck_rollouts)
    return None


def _decide(*, parsed: _Parsed, rendered: _Rendered, report: _ApplyReport, observed: _Observed) -> _Verdict:
    """The three conditions, by precedence: name conflict, ready, a blocker (:func:`_blocker`),
    progressing. A newly reported blocker gets one Warning Event."""
    pools = observed.pools
    all_present = set(pools) >= rendered.roles
    ready = all_present and not report.conflicts and all(o.ready >= 1 and o.rolled_out for o in pools.values())
    picker = inference_pool.enabled(parsed.isvc.spec)

    def label(role: Role) -> str:
        return "endpoint picker" if picker and role is Role.ROUTER else role.value

    waiting = ", ".join(
        f"{label(o.role)} {o.ready}/{o.desired} ready" for o in pools.values() if not (o.ready >= 1 and o.rolled_out)
    )
    if report.conflicts:
        msg = "; ".join(report.conflict_messages)
        return _Verdict(_stalled(Reason.NAME_CONFLICT, msg), Reason.NAME_CONFLICT, False, msg)
    if ready:
        msg = "All pools are ready and rolled out"
        conds = _conditions(
            ready=("True", Reason.RECONCILED, msg),
            reconciling=("False", Reason.RECONCILED, msg),
            stalled=("False", Reason.RECONCILED, msg),
        )
        return _Verdict(conds, Reason.RECONCILED, True, msg)
    blocker = _blocker(observed)
    if blocker is not None:
        reason, msg = blocker
        if _previous_reason(parsed.obj, ConditionType.STALLED) != reason:
            events.warning(obj=parsed.obj, reason=reason, message=msg)
        return _Verdict(_stalled(reason, msg), reason, False, msg)
    reason = Reason.CHILDREN_CREATED if report.created else Reason.ROLLOUT_IN_PROGRESS
    msg = f"Waiting for {waiting}" if waiting else "Waiting for rollouts"
    conds = _conditions(
        ready=("False", reason, msg),
        reconciling=("True", reason, msg),
        stalled=("False", Reason.PROGRESSING, "Rollout is progressing"),
    )
    return _Verdict(conds, Reason.PROGRESSING, False, msg)


def _status_fields(*, parsed: _Parsed, settings: ReconcileSettings, observed: _Observed) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "observedGeneration": parsed.obj["metadata"].get("generation"),
        # Behind a Gateway the endpoint is the Gateway's address, which the operator does not know.
        "endpoint": None
        if inference_pool.enabled(parsed.isvc.spec)
        else endpoint_of(name=parsed.name, namespace=parsed.namespace),
        "compatHash": render.compat_hash_of(
            isvc=parsed.isvc, runtime_image=settings.runtime_image, vllm_image=settings.vllm_image
        ),
    }
    picker = inference_pool.enabled(parsed.isvc.spec)
    for role, o in observed.pools.items():
        if picker and role is Role.ROUTER:  # the picker stands where the router would: counted apart
            fields["endpointPicker"] = {
                "replicas": o.replicas,
                "readyReplicas": o.ready,
                "desiredReplicas": o.desired,
                "summary": f"{o.ready}/{o.desired}",
            }
            fields["router"] = None  # counted here by an earlier version: the column must not show it
            continue
        fields[_status_key(role)] = {
            "replicas": o.replicas,
            "readyReplicas": o.ready,
            "desiredReplicas": o.desired,
            "pendingReplicas": o.pending,
            "summary": f"{o.ready}/{o.desired}",
        }
    return fields


def reconcile(
    *,
    api: kube.KubeAPI,
    obj: Mapping[str, Any],
    settings: ReconcileSettings,
    nodes: NodeCache | None = None,
    children: child_cache.ChildCache | None = None,
) -> Result:
    """Converge the children of ``obj`` (a live InferenceService) and write its status.
    A paused object is not touched at all (the caller should not even call this), nor is one
    whose current generation is known not to apply (:func:`spec_never_applies`). ``children``:
    what the operator's child watch delivered (no reads, and no writes of unchanged children);
    None: every child is read and applied."""
    if is_paused(obj):
        return Result(outcome=Reason.PAUSED)
    if spec_never_applies(obj):
        return Result(outcome=Reason.INVALID_SPEC)
    parsed = _parse(api=api, obj=obj)
    if parsed is None:
        return Result(outcome=Reason.INVALID_SPEC)
    if not settings.inference_pool and inference_pool.enabled(parsed.isvc.spec):
        _report_inference_pool_disabled(api=api, parsed=parsed)
        return Result(outcome=Reason.INFERENCE_POOL_DISABLED)
    spec_key = _spec_key(parsed=parsed, settings=settings)
    shortcut = _unchanged(api=api, parsed=parsed, spec_key=spec_key, children=children)
    if shortcut is not None:
        rendered, report = shortcut
    else:
        rendered = _render(parsed=parsed, settings=settings)
        applied = _apply(api=api, parsed=parsed, rendered=rendered, children=children)
        if applied is None:
            return Result(outcome=Reason.INVALID_SPEC)
        report = applied
        _remember(parsed=parsed, rendered=rendered, report=report, spec_key=spec_key, children=children)
    observed = _observe(api=api, parsed=parsed, rendered=rendered, report=report, nodes=nodes)
    verdict = _decide(parsed=parsed, rendered=rendered, report=report, observed=observed)
    _write_status(
        api=api,
        obj=obj,
        fields=_status_fields(parsed=parsed, settings=settings, observed=observed),
        conditions=verdict.conditions,
    )
    if verdict.ready and _previous_reason(obj, ConditionType.READY) != Reason.RECONCILED:
        events.normal(obj=obj, reason=Reason.READY, message=verdict.message)
    return Result(
        outcome=verdict.outcome,
        created=tuple(report.created),
        updated=tuple(report.updated),
        conflicts=tuple(report.conflicts),
        ready=verdict.ready,
    )
