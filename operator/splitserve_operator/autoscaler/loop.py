"""One autoscaling round of an InferenceService, and the operator-wide loop that drives the rounds.

A round (:func:`run_once`) goes: observe every pool (Deployment replicas, Ready and
GPU-Pending pods) → query its signals in Prometheus → :func:`~.decision.decide` per pool →
:func:`~.decision.plan_joint` over the GPU budget (with ``spec.autoscaling.slo``: the SLO
controller instead, :mod:`.slo.round`, with the per-pool decisions as floors and its state in
the ``<isvc>-slo-state`` ConfigMap, :mod:`.slo.store`) → act (deletion costs, then
``spec.replicas``) unless dry run → report: ``status.<pool>.lastDecision`` (and
``desiredReplicas``/``lastScaleTime`` after a write), ``status.<pool>.recentDecisions``,
``status.scalingHistory``, the ``MetricsHealthy`` and ``ScalingActive`` conditions, Events
on every change, and the autoscaler's Prometheus series. Status goes through
:func:`..status.patch_status`, which merges by condition type, so the reconciler's conditions
are never lost.
``status.<pool>.pendingReplicas`` stays the reconciler's (all Pending pods); the GPU-Pending
count of a decision is in its ``inputs``.

The blocking Kubernetes and Prometheus clients run in worker threads
(:func:`asyncio.to_thread`), so a slow Prometheus never stalls kopf's event loop.

Why no kopf timer drives the rounds: a ``@kopf.timer`` makes kopf put its finalizer on every
InferenceService (kopf issue #1074), so ``kubectl delete`` hangs while the operator is down,
and a timer's ``when=`` filter makes kopf remove that finalizer when an object is paused (a
write to a paused object). Instead :func:`register` installs an ``on.event`` handler that
keeps the latest body of every InferenceService (no finalizer, no writes) and one
operator-wide :class:`AutoscalerLoop`, started by ``on.startup`` and stopped by
``on.cleanup`` of the same registry, so like every other handler it runs only on the leader.
Every ``base_tick_seconds`` (default
:data:`splitserve_contract.defaults.AUTOSCALER_BASE_TICK_SECONDS`) the loop starts a round for
each known, non-paused object whose own ``spec.autoscaling.interval`` has passed, judged on the
loop's injected monotonic ``clock``; rounds run as separate tasks (one slow
Prometheus never delays another object), at most one at a time per object, and a failing
round never stops the loop: it sets ``ScalingActive=False`` (``ApiError``, or ``RoundFailed``
with what failed) and is logged once per distinct failure, not with a traceback every interval. Events go
through :mod:`splitserve_operator.events`' own poster, which works from any task.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import kopf
from prometheus_api_client import PrometheusConnect
from prometheus_client import CollectorRegistry
from urllib3.util.retry import Retry

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason, defaults

from .. import events, kube, naming, status
from ..api import (
    MAX_SCALING_HISTORY,
    InferenceService,
    InferenceServiceSpec,
    InvalidSpecError,
    parse_duration_seconds,
    pool_names,
    pool_spec,
)
from . import actuator
from . import history as history_of_decisions
from .decision import (
    Behavior,
    Decision,
    MetricsUnavailable,
    PoolPolicy,
    SignalValue,
    decide,
    plan_joint,
)
from .memory import AutoscalerState, ServiceKey
from .metrics import AutoscalerMetrics
from .observe import PoolObservation, observe_pool
from .signals import PoolSample, Targets, fetch_pool_sample, pool_signals
from .slo import round as slo_round
from .slo.inputs import PoolSloObservation
from .slo.measure import fetch_pool_slo
from .slo.store import SloStore

STALE_AFTER_INTERVALS: Final = 3
"""Metrics older than this many intervals (autoscaler or scrape, whichever is longer) are stale."""
PROMETHEUS_TIMEOUT_SECONDS: Final = 5
MAX_FORMULA_LENGTH: Final = 1024
MAX_MESSAGE_LENGTH: Final = 2048

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolRound:
    """One pool's part of a round: what was seen, what Prometheus said, what was decided."""

    observation: PoolObservation
    sample: PoolSample | None
    problem: MetricsUnavailable | None
    decision: Decision
    """The target-tracking decision (with ``spec.autoscaling.slo``: the SLO decision's floor)."""
    slo: PoolSloObservation | None = None
    """The SLO controller's view of the pool (with ``spec.autoscaling.slo`` and fresh metrics)."""


def policy_for(*, spec: InferenceServiceSpec, pool: str) -> tuple[PoolPolicy, Targets, int]:
    """Bounds, targets and GPUs per replica of one pool. Prefill scales on its queue (and
    uncached prompt tokens when targeted), decode on KV usage and queue. An aggregated pod
    does both jobs: its queue target is ``autoscaling.prefill.targetQueueDepth`` (as the API
    documents) and, like decode, it also tracks ``decode.targetKVCacheUtilization``."""
    auto = spec.autoscaling
    pool_cfg = pool_spec(spec, pool)
    behavior = Behavior(
        scale_up_stabilization_seconds=float(auto.behavior.scale_up.stabilization_seconds),
        scale_up_max_step_percent=auto.behavior.scale_up.max_step_percent,
        scale_down_stabilization_seconds=float(auto.behavior.scale_down.stabilization_seconds),
        scale_down_max_step=auto.behavior.scale_down.max_step,
    )
    policy = PoolPolicy(
        min_replicas=pool_cfg.replicas.min,
        max_replicas=pool_cfg.replicas.max,
        behavior=behavior,
        tolerance=auto.tolerance,
    )
    if pool == contract.Role.PREFILL.value:
        tokens = auto.prefill.target_prompt_tokens_waiting
        targets = Targets(
            queue_depth=auto.prefill.target_queue_depth,
            prompt_tokens_waiting=float(tokens) if tokens is not None else None,
        )
    elif pool == contract.Role.AGGREGATED.value:
        targets = Targets(
            queue_depth=auto.prefill.target_queue_depth,
            kv_cache_utilization=auto.decode.target_kv_cache_utilization,
        )
    else:
        targets = Targets(
            queue_depth=auto.decode.target_queue_depth,
            kv_cache_utilization=auto.decode.target_kv_cache_utilization,
        )
    return policy, targets, pool_cfg.resources.gpus


def _timestamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _is_paused(obj: Mapping[str, Any]) -> bool:
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(contract.ANNOTATION_PAUSED, "")).lower() == "true"


async def _observe_and_decide(
    *,
    spec: InferenceServiceSpec,
    namespace: str,
    name: str,
    pool: str,
    api: kube.Kube,
    prometheus: PrometheusConnect,
    state: AutoscalerState,
    now_seconds: float,
    stale_after_seconds: float,
    window_seconds: float,
) -> PoolRound | None:
    obs = await asyncio.to_thread(observe_pool, api=api, namespace=namespace, name=name, pool=pool)
    if obs is None:
        return None  # not created yet: the reconciler's business
    policy, targets, gpus = policy_for(spec=spec, pool=pool)
    sample: PoolSample | None = None
    problem: MetricsUnavailable | None = None
    signals: dict[str, SignalValue] = {}
    slo = _idle_pool_slo(obs) if spec.autoscaling.slo is not None else None
    if obs.ready_replicas > 0:
        try:
            sample = await asyncio.to_thread(
                fetch_pool_sample,
                prometheus=prometheus,
                namespace=namespace,
                inferenceservice=name,
                role=pool,
                now_seconds=now_seconds,
                stale_after_seconds=stale_after_seconds,
                window_seconds=window_seconds,
                pods=obs.ready_pod_names,
                engine=spec.runtime.engine,
            )
            signals = pool_signals(sample=sample, ready_replicas=obs.ready_replicas, targets=targets)
            if spec.autoscaling.slo is not None:
                slo = await asyncio.to_thread(
                    fetch_pool_slo,
                    prometheus=prometheus,
                    namespace=namespace,
                    inferenceservice=name,
                    role=pool,
                    pods=obs.ready_pod_names,
                    sample=sample,
                    current_replicas=obs.current_replicas,
                    pending_replicas=len(obs.pending_for_gpus),
                    block_size=spec.kv_cache.block_size,
                    attainment=spec.autoscaling.slo.attainment,
                    now_seconds=now_seconds,
                    window_seconds=window_seconds,
                )
        except MetricsUnavailable as exc:
            problem = exc
    decision = decide(
        pool=pool,
        now_seconds=now_seconds,
        current_replicas=obs.current_replicas,
        ready_replicas=obs.ready_replicas,
        pending_replicas=len(obs.pending_for_gpus),
        signals=problem if problem is not None else signals,
        policy=policy,
        history=state.history(
            namespace=namespace, name=name, pool=pool, now_seconds=now_seconds, current_replicas=obs.current_replicas
        ),
        gpus_per_replica=gpus,
        dry_run=spec.autoscaling.dry_run,
    )
    return PoolRound(
        observation=obs, sample=sample, problem=problem, decision=decision, slo=slo if problem is None else None
    )


def _idle_pool_slo(obs: PoolObservation) -> PoolSloObservation:
    """The SLO view of a pool without Ready pods: nothing measured, nothing waiting there."""
    return PoolSloObservation(
        role=obs.pool,
        current_replicas=obs.current_replicas,
        ready_replicas=0,
        pending_replicas=len(obs.pending_for_gpus),
        step_samples=(),
        requests_waiting=0.0,
        prompt_tokens_waiting=0.0,
        requests_running=0.0,
        kv_cache_usage_ratio=0.0,
        kv_cache_tokens_per_replica=0.0,
        ttft_p99_seconds=None,
        itl_p99_seconds=None,
    )


async def _decide_slo(
    *,
    spec: InferenceServiceSpec,
    isvc: Mapping[str, Any],
    rounds: list[PoolRound],
    api: kube.Kube,
    prometheus: PrometheusConnect,
    state: AutoscalerState,
    slo_store: SloStore,
    now_seconds: float,
    window_seconds: float,
    scrape_interval_seconds: float = defaults.SCRAPE_INTERVAL_SECONDS,
) -> tuple[list[Decision], list[PoolRound]]:
    """The SLO controller's decisions for ``rounds`` (in their order), and the rounds (with a
    problem reading the load recorded on the entry pool). Metrics hold as without an SLO: while
    any pool's metrics are unavailable the target-tracking decisions stand (they hold that
    pool) except that no pool scales down, and without the load every pool holds; the fits
    still learn from what was read."""
    slo = spec.autoscaling.slo
    assert slo is not None
    meta = isvc.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    problem = next((r.problem for r in rounds if r.problem is not None), None)
    if problem is not None:
        # The SLO is joint (a prefill pool's TTFT leans on decode's first step): no pool sheds
        # replicas on target tracking alone while another pool's metrics are missing.
        held = [
            r.decision
            if r.decision.direction != "down"
            else _hold_for(
                r,
                problem=problem,
                spec=spec,
                state=state,
                namespace=namespace,
                name=name,
                now_seconds=now_seconds,
                history_pool=r.observation.pool,
            )
            for r in rounds
        ]
        return plan_joint(decisions=held, gpu_budget=spec.autoscaling.gpu_budget), rounds
    load = None
    load_problem: MetricsUnavailable | None = None
    try:
        load = await asyncio.to_thread(
            slo_round.read_load,
            prometheus=prometheus,
            spec=spec,
            namespace=namespace,
            name=name,
            ready_pods={r.observation.pool: r.observation.ready_pod_names for r in rounds},
            now_seconds=now_seconds,
            window_seconds=window_seconds,
            scrape_interval_seconds=scrape_interval_seconds,
        )
    except MetricsUnavailable as exc:
        load_problem = exc
        entry, _ = slo_round.entry_and_prefill_roles(spec)
        rounds = [dataclasses.replace(r, problem=exc) if r.observation.pool == entry else r for r in rounds]
    slo_state = await asyncio.to_thread(slo_store.load, api=api, namespace=namespace, name=name)
    inputs = slo_round.observe(
        slo=slo,
        slo_state=slo_state,
        load=load,
        now_seconds=now_seconds,
        pools={r.observation.pool: r.slo for r in rounds if r.slo is not None},
    )
    if load_problem is not None:
        return [
            _hold_for(
                r,
                problem=load_problem,
                spec=spec,
                state=state,
                namespace=namespace,
                name=name,
                now_seconds=now_seconds,
                history_pool=r.observation.pool + slo_round.HISTORY_SUFFIX,
            )
            for r in rounds
        ], rounds
    policies: dict[str, PoolPolicy] = {}
    gpus: dict[str, int] = {}
    for r in rounds:
        policies[r.observation.pool], _, gpus[r.observation.pool] = policy_for(spec=spec, pool=r.observation.pool)
    histories = slo_round.slo_histories(
        state=state,
        namespace=namespace,
        name=name,
        now_seconds=now_seconds,
        current_replicas={r.observation.pool: r.observation.current_replicas for r in rounds},
    )
    decided = slo_round.decide(
        spec=spec,
        slo=slo,
        slo_state=slo_state,
        inputs=inputs,
        floors={r.observation.pool: r.decision.result for r in rounds},
        policies=policies,
        gpus_per_replica=gpus,
        histories=histories,
    )
    by_pool = {d.pool: d for d in decided}
    return [by_pool.get(r.observation.pool, r.decision) for r in rounds], rounds


def _hold_for(
    pool_round: PoolRound,
    *,
    problem: MetricsUnavailable,
    spec: InferenceServiceSpec,
    state: AutoscalerState,
    namespace: str,
    name: str,
    now_seconds: float,
    history_pool: str,
) -> Decision:
    """A hold of ``pool_round``'s pool for ``problem`` (recorded in the history of ``history_pool``)."""
    obs = pool_round.observation
    policy, _, gpus = policy_for(spec=spec, pool=obs.pool)
    return decide(
        pool=obs.pool,
        now_seconds=now_seconds,
        current_replicas=obs.current_replicas,
        ready_replicas=obs.ready_replicas,
        pending_replicas=len(obs.pending_for_gpus),
        signals=problem,
        policy=policy,
        gpus_per_replica=gpus,
        dry_run=spec.autoscaling.dry_run,
        history=state.history(
            namespace=namespace,
            name=name,
            pool=history_pool,
            now_seconds=now_seconds,
            current_replicas=obs.current_replicas,
        ),
    )


def _act(
    *,
    api: kube.Kube,
    namespace: str,
    obs: PoolObservation,
    sample: PoolSample | None,
    decision: Decision,
) -> None:
    if decision.direction == "down" and sample is not None:
        actuator.annotate_deletion_costs(
            api=api, namespace=namespace, pods=obs.ready_pods, load_by_pod=sample.load_by_pod()
        )
    actuator.apply_replicas(api=api, namespace=namespace, deployment=obs.deployment, replicas=decision.result)


def _last_decision(decision: Decision, *, now_seconds: float, previous: Mapping[str, Any]) -> dict[str, Any]:
    """``status.<pool>.lastDecision``. Status is written as a merge patch, which merges the
    ``inputs`` map key by key: inputs of the ``previous`` decision that this one lacks are
    sent as null (deleted), so the status never mixes two decisions' numbers.

    ``time`` is when the pool's decision last *changed*: a decision equal to ``previous`` in
    everything but the time keeps ``previous``'s time, so a round that decides what the last
    one did writes nothing at all (an idle service's object, and the resourceVersion every
    GitOps watcher follows, stay as they are instead of changing every interval)."""
    inputs: dict[str, Any] = {key: None for key in (previous.get("inputs") or {})}
    inputs.update(decision.inputs())
    out: dict[str, Any] = {
        "time": _timestamp(now_seconds),
        "inputs": inputs,
        "formula": decision.formula[:MAX_FORMULA_LENGTH],
        "result": decision.result,
        "reason": decision.reason,
    }
    if decision.model or previous.get("model"):
        # merged key by key like inputs: keys of the previous model this one lacks are deleted
        out["model"] = {key: None for key in (previous.get("model") or {})} | dict(decision.model or {})
    if previous.get("time") and _without_time(status.merge_patch(dict(previous), out)) == _without_time(previous):
        out["time"] = previous["time"]
    return out


def _without_time(last_decision: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in last_decision.items() if key != "time"}


async def run_once(
    *,
    isvc: Mapping[str, Any],
    api: kube.Kube,
    prometheus: PrometheusConnect,
    state: AutoscalerState,
    metrics: AutoscalerMetrics,
    now_seconds: float,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    scrape_interval_seconds: float = defaults.SCRAPE_INTERVAL_SECONDS,
    window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS,
    slo_store: SloStore | None = None,
) -> list[Decision]:
    """One round for ``isvc`` (a full object: dict or kopf body); returns the decisions
    (after the joint GPU budget). A paused or invalid object gets no writes at all.
    With ``spec.autoscaling.slo`` the SLO controller decides (:func:`_decide_slo`), its state
    kept in ``slo_store`` (None: a store for this round only, read from and written to the
    ConfigMap)."""
    meta = isvc.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    if _is_paused(isvc) or meta.get("deletionTimestamp"):
        return []
    try:
        spec = InferenceService.parse(isvc).spec
    except InvalidSpecError as exc:
        logger.warning("Not autoscaling %s/%s: %s", namespace, name, exc)
        return []
    auto = spec.autoscaling
    generation = meta.get("generation")

    def clock() -> datetime.datetime:
        return datetime.datetime.fromtimestamp(now_seconds, datetime.UTC).replace(microsecond=0)

    if not auto.enabled:
        fields = await asyncio.to_thread(
            _clamp_unscaled, isvc=isvc, spec=spec, api=api, namespace=namespace, name=name, now_seconds=now_seconds
        )
        await asyncio.to_thread(
            status.patch_status,
            api=api,
            namespace=namespace,
            name=name,
            observed_generation=generation,
            clock=clock,
            fields=_finite(fields),
            conditions=[
                status.ConditionUpdate(
                    type=ConditionType.SCALING_ACTIVE.value,
                    status="False",
                    reason=Reason.SCALING_DISABLED,
                    message="spec.autoscaling.enabled is false: each pool's replicas stay where they are, "
                    "within its [min, max]",
                )
            ],
        )
        return []

    stale_after = STALE_AFTER_INTERVALS * max(auto.interval_seconds, scrape_interval_seconds)
    rounds: list[PoolRound] = []
    for pool in pool_names(spec):
        observed = await _observe_and_decide(
            spec=spec,
            namespace=namespace,
            name=name,
            pool=pool,
            api=api,
            prometheus=prometheus,
            state=state,
            now_seconds=now_seconds,
            stale_after_seconds=stale_after,
            window_seconds=window_seconds,
        )
        if observed is not None:
            rounds.append(observed)
    if not rounds:
        return []
    store = slo_store if slo_store is not None else SloStore()
    if auto.slo is not None:
        decisions, rounds = await _decide_slo(
            spec=spec,
            isvc=isvc,
            rounds=rounds,
            api=api,
            prometheus=prometheus,
            state=state,
            slo_store=store,
            now_seconds=now_seconds,
            window_seconds=window_seconds,
            scrape_interval_seconds=scrape_interval_seconds,
        )
    else:
        decisions = plan_joint(decisions=[r.decision for r in rounds], gpu_budget=auto.gpu_budget)

    written: set[str] = set()
    failures: list[str] = []
    for pool_round, decision in zip(rounds, decisions, strict=True):
        metrics.observe(namespace=namespace, name=name, decision=decision)
        if not decision.write:
            continue
        try:
            await asyncio.to_thread(
                _act,
                api=api,
                namespace=namespace,
                obs=pool_round.observation,
                sample=pool_round.sample,
                decision=decision,
            )
        except kube.ApiException as exc:
            failures.append(
                f"{decision.pool} {decision.current_replicas} → {decision.result}: {kube.error_message(exc)}"
            )
            continue
        written.add(decision.pool)
    if auto.slo is not None and (namespace, name) in store.entries:
        slo_state = store.entries[(namespace, name)].state
        for pool in written:
            slo_state.record_replicas_write(pool, now_seconds, next(d.result for d in decisions if d.pool == pool))
        await asyncio.to_thread(
            store.save,
            api=api,
            namespace=namespace,
            name=name,
            uid=str(meta.get("uid", "")),
            now_seconds=now_seconds,
            force=bool(written),
        )

    fields = _record(isvc=isvc, decisions=decisions, written=written, state=state, now_seconds=now_seconds)
    conditions = _conditions(rounds=rounds, decisions=decisions, failures=failures, dry_run=auto.dry_run)
    _post_health_events(isvc=isvc, state=state, namespace=namespace, name=name, rounds=rounds)
    for failure in failures:
        events.warning(obj=isvc, reason=Reason.SCALE_FAILED, message=failure)
    await asyncio.to_thread(
        status.patch_status,
        api=api,
        namespace=namespace,
        name=name,
        fields=_finite(fields),
        conditions=conditions,
        observed_generation=generation,
        clock=clock,
    )
    for decision in decisions:
        logger.info("autoscaler %s/%s %s: %s (%s)", namespace, name, decision.pool, decision.formula, decision.reason)
    return decisions


def _finite(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields``, checked to be what the API server accepts: JSON has no NaN or Infinity
    (Python's ``json`` writes them as bare words, and the API server refuses the whole patch,
    round after round). The numbers are made finite where they are computed; this is the
    ``allow_nan=False`` of the status write, raising ``ValueError`` with the field's path."""
    bad = _non_finite_path(fields, "status")
    if bad is not None:
        raise ValueError(f"{bad} is not a finite number; the status is not written")
    return fields


def _non_finite_path(value: Any, path: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} ({value})"
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite_path(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found is not None:
            return found
    return None


def _clamp_unscaled(
    *,
    isvc: Mapping[str, Any],
    spec: InferenceServiceSpec,
    api: kube.Kube,
    namespace: str,
    name: str,
    now_seconds: float,
) -> dict[str, Any]:
    """With autoscaling off, bring each pool's replica count into its ``[min, max]`` (the CRD
    promises the pool runs at least ``min``; the count is otherwise left where it is, for
    ``kubectl scale`` or nobody to change); returns the status fields of the changes, each
    recorded like an autoscaler write (``desiredReplicas``, ``lastScaleTime``,
    ``scalingHistory``, an Event)."""
    live_status = isvc.get("status") or {}
    history: list[dict[str, Any]] = [dict(e) for e in live_status.get("scalingHistory") or []]
    fields: dict[str, Any] = {}
    for pool in pool_names(spec):
        bounds = pool_spec(spec, pool).replicas
        changed = actuator.clamp_replicas(
            api=api,
            namespace=namespace,
            name=naming.child_name(name, pool),
            min_replicas=bounds.min,
            max_replicas=bounds.max,
        )
        if changed is None:
            continue
        before, after = changed
        reason = Reason.AT_MIN_REPLICAS if after > before else Reason.AT_MAX_REPLICAS
        fields[pool] = {"desiredReplicas": after, "lastScaleTime": _timestamp(now_seconds)}
        history.append({"time": _timestamp(now_seconds), "pool": pool, "from": before, "to": after, "reason": reason})
        events.normal(
            obj=isvc,
            reason=Reason.SCALED_UP if after > before else Reason.SCALED_DOWN,
            message=f"{pool} {before} → {after}: autoscaling is off, replicas kept within [{bounds.min}, {bounds.max}]",
        )
    if history != list(live_status.get("scalingHistory") or []):
        fields["scalingHistory"] = history[-MAX_SCALING_HISTORY:]
    return fields


def _record(
    *,
    isvc: Mapping[str, Any],
    decisions: list[Decision],
    written: set[str],
    state: AutoscalerState,
    now_seconds: float,
) -> dict[str, Any]:
    """Status fields for this round's decisions; posts an Event for every change (a write,
    or a new dry-run recommendation) and appends it to ``status.scalingHistory``; a decision
    that differs from the pool's newest ``recentDecisions`` entry goes in front of that list
    (:mod:`.history`)."""
    meta = isvc.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    live_status = isvc.get("status") or {}
    fields: dict[str, Any] = {}
    history: list[dict[str, Any]] = [dict(e) for e in live_status.get("scalingHistory") or []]
    history_before = len(history)
    for decision in decisions:
        key = (namespace, name, decision.pool)
        pool_status = live_status.get(decision.pool) or {}
        previous = pool_status.get("lastDecision") or {}
        entry: dict[str, Any] = {"lastDecision": _last_decision(decision, now_seconds=now_seconds, previous=previous)}
        recent = history_of_decisions.with_decision(
            pool_status.get("recentDecisions") or [],
            history_of_decisions.decision_entry(
                decision,
                timestamp=_timestamp(now_seconds),
                applied=decision.pool in written,
                max_formula_length=MAX_FORMULA_LENGTH,
            ),
        )
        if recent is not None:
            entry["recentDecisions"] = recent
        change = f"{decision.pool} {decision.current_replicas} → {decision.result}: {decision.formula}"
        if decision.pool in written:
            entry["desiredReplicas"] = decision.result
            entry["lastScaleTime"] = _timestamp(now_seconds)
            reason = Reason.SCALED_UP if decision.direction == "up" else Reason.SCALED_DOWN
            history.append(
                {
                    "time": _timestamp(now_seconds),
                    "pool": decision.pool,
                    "from": decision.current_replicas,
                    "to": decision.result,
                    "reason": decision.reason,
                }
            )
            events.normal(obj=isvc, reason=reason, message=change)
        elif (
            decision.dry_run and decision.direction != "none" and state.last_recommendation.get(key) != decision.result
        ):
            history.append(
                {
                    "time": _timestamp(now_seconds),
                    "pool": decision.pool,
                    "from": decision.current_replicas,
                    "to": decision.result,
                    "reason": Reason.DRY_RUN,
                }
            )
            events.normal(obj=isvc, reason=Reason.DRY_RUN, message=f"would scale {change}")
        state.last_recommendation[key] = decision.result
        fields[decision.pool] = entry
    if len(history) != history_before:
        fields["scalingHistory"] = history[-MAX_SCALING_HISTORY:]
    return fields


def _metrics_problems(rounds: list[PoolRound]) -> list[tuple[str, MetricsUnavailable]]:
    """(pool, problem) of every pool whose metrics were unavailable."""
    return [(r.observation.pool, r.problem) for r in rounds if r.problem is not None]


def _conditions(
    *,
    rounds: list[PoolRound],
    decisions: list[Decision],
    failures: list[str],
    dry_run: bool,
) -> list[status.ConditionUpdate]:
    problems = _metrics_problems(rounds)
    queried = [r.observation.pool for r in rounds if r.observation.ready_replicas > 0]
    out = []
    if problems:
        message = "; ".join(f"{pool}: {p.message}" for pool, p in problems)[:MAX_MESSAGE_LENGTH]
        out.append(
            status.ConditionUpdate(
                type=ConditionType.METRICS_HEALTHY.value,
                status="False",
                reason=problems[0][1].reason,
                message=f"{message} (replicas held)",
            )
        )
    elif queried:
        out.append(
            status.ConditionUpdate(
                type=ConditionType.METRICS_HEALTHY.value,
                status="True",
                reason=Reason.METRICS_AVAILABLE,
                message=f"fresh metrics for {', '.join(queried)}",
            )
        )
    if failures:
        active = status.ConditionUpdate(
            type=ConditionType.SCALING_ACTIVE.value,
            status="False",
            reason=Reason.API_ERROR,
            message="; ".join(failures)[:MAX_MESSAGE_LENGTH],
        )
    elif dry_run:
        active = status.ConditionUpdate(
            type=ConditionType.SCALING_ACTIVE.value,
            status="False",
            reason=Reason.DRY_RUN,
            message="dry run: decisions are recorded, replicas are not changed",
        )
    elif problems:
        active = status.ConditionUpdate(
            type=ConditionType.SCALING_ACTIVE.value,
            status="False",
            reason=Reason.METRICS_UNAVAILABLE,
            message=f"replicas held for {', '.join(pool for pool, _ in problems)}",
        )
    else:
        summary = ", ".join(f"{d.pool} {d.result} ({d.reason})" for d in decisions)
        active = status.ConditionUpdate(
            type=ConditionType.SCALING_ACTIVE.value,
            status="True",
            reason=Reason.ACTIVE,
            message=summary[:MAX_MESSAGE_LENGTH],
        )
    out.append(active)
    return out


def _post_health_events(
    *,
    isvc: Mapping[str, Any],
    state: AutoscalerState,
    namespace: str,
    name: str,
    rounds: list[PoolRound],
) -> None:
    problems = _metrics_problems(rounds)
    if not problems and not any(r.observation.ready_replicas > 0 for r in rounds):
        return  # nothing was queried: no news about the metrics
    now_problem = ",".join(sorted({p.reason for _, p in problems}))
    before = state.metrics_problem.get((namespace, name), "")
    state.metrics_problem[(namespace, name)] = now_problem
    if now_problem and now_problem != before:
        events.warning(
            obj=isvc, reason=Reason.METRICS_UNHEALTHY, message="; ".join(f"{pool}: {p}" for pool, p in problems)
        )
    elif before and not now_problem:
        events.normal(obj=isvc, reason=Reason.METRICS_HEALTHY, message="scaling metrics are available again")


def make_prometheus(*, url: str) -> PrometheusConnect:
    """A client that fails fast: one try per query, bounded time (a round must not hang)."""
    return PrometheusConnect(url=url, retry=Retry(total=0), timeout=PROMETHEUS_TIMEOUT_SECONDS)


@dataclasses.dataclass
class AutoscalerLoop:
    """The operator-wide loop: the latest body of every InferenceService seen (fed by
    :meth:`observe`), and a ticker that starts the rounds that are due.

    ``clock`` (monotonic seconds) decides when a round is due
    (:attr:`AutoscalerState.last_run_seconds` is on it); ``wall_clock`` (Unix seconds) is the
    ``now_seconds`` of each round: status timestamps and Prometheus evaluation time. Both are
    injected so tests can drive them."""

    api: kube.Kube
    prometheus: PrometheusConnect
    state: AutoscalerState
    metrics: AutoscalerMetrics
    base_tick_seconds: float = defaults.AUTOSCALER_BASE_TICK_SECONDS
    scrape_interval_seconds: float = defaults.SCRAPE_INTERVAL_SECONDS
    window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS
    slo_store: SloStore = dataclasses.field(default_factory=SloStore)
    """The SLO controller's state of every service with ``spec.autoscaling.slo`` (:mod:`.slo.store`)."""
    bodies: dict[ServiceKey, dict[str, Any]] = dataclasses.field(default_factory=dict)
    rounds: dict[ServiceKey, asyncio.Task[None]] = dataclasses.field(default_factory=dict)
    ticker: asyncio.Task[None] | None = None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time

    def observe(self, *, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Remember ``body`` (a copy: kopf's view is not ours to keep), or forget the object
        and its state on deletion. Called from kopf's ``on.event`` handler."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if event_type == "DELETED":
            self.bodies.pop(key, None)
            running = self.rounds.pop(key, None)
            if running is not None:
                running.cancel()  # the object is gone: its round has nothing left to write
            self.state.forget(namespace=key[0], name=key[1])
            self.slo_store.forget(namespace=key[0], name=key[1])
            self.metrics.forget(namespace=key[0], name=key[1])
        else:
            self.bodies[key] = copy.deepcopy(dict(body))

    def start(self) -> None:
        if self.ticker is None or self.ticker.done():
            self.ticker = asyncio.create_task(self._tick_forever(), name="autoscaler")

    async def stop(self) -> None:
        """Stop the ticker and every round in flight, and wait for them."""
        tasks = [t for t in [self.ticker, *self.rounds.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.ticker = None
        self.rounds.clear()

    async def _tick_forever(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bad tick must not end autoscaling for good
                logger.exception("Autoscaler tick failed")
            await asyncio.sleep(self.base_tick_seconds)

    def tick(self) -> list[ServiceKey]:
        """Start a round for every known object that is due; returns their keys."""
        now, wall_now = self.clock(), self.wall_clock()
        started: list[ServiceKey] = []
        for key, body in list(self.bodies.items()):
            running = self.rounds.get(key)
            if running is not None and not running.done():
                continue  # the last round is still going: never two at once for one object
            if _is_paused(body) or (body.get("metadata") or {}).get("deletionTimestamp"):
                continue
            interval = str(
                ((body.get("spec") or {}).get("autoscaling") or {}).get("interval") or defaults.AUTOSCALING_INTERVAL
            )
            try:
                interval_seconds = parse_duration_seconds(interval)
            except ValueError:
                continue  # the CRD rejects this; an old object is reported by the reconciler
            # half a tick of slack, so a 15 s interval on a 5 s tick runs every 15 s, not 20 s
            if not self.state.due(
                namespace=key[0],
                name=key[1],
                now_seconds=now,
                interval_seconds=interval_seconds - self.base_tick_seconds / 2,
            ):
                continue
            self.state.mark_run(namespace=key[0], name=key[1], now_seconds=now)
            self.rounds[key] = asyncio.create_task(
                self._round(key=key, body=body, now_seconds=wall_now), name=f"autoscaler {key[0]}/{key[1]}"
            )
            started.append(key)
        return started

    async def _round(self, *, key: ServiceKey, body: Mapping[str, Any], now_seconds: float) -> None:
        try:
            await run_once(
                isvc=body,
                api=self.api,
                prometheus=self.prometheus,
                state=self.state,
                metrics=self.metrics,
                now_seconds=now_seconds,
                logger=logger,
                scrape_interval_seconds=self.scrape_interval_seconds,
                window_seconds=self.window_seconds,
                slo_store=self.slo_store,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one object's failure must not stop the others' rounds
            await self._report_failure(key=key, body=body, now_seconds=now_seconds, error=exc)
        else:
            if self.state.round_failures.pop(key, None) is not None:
                logger.info("Autoscaling rounds of %s/%s succeed again", key[0], key[1])

    async def _report_failure(
        self, *, key: ServiceKey, body: Mapping[str, Any], now_seconds: float, error: Exception
    ) -> None:
        """A failed round: ``ScalingActive=False`` with what failed, so the status does not go on
        claiming an active autoscaler, and one log line per distinct failure (a round that fails
        the same way every interval is logged once, its traceback at DEBUG)."""
        if isinstance(error, kube.ApiException):
            reason, what = Reason.API_ERROR, kube.error_message(error)
        else:
            reason, what = Reason.ROUND_FAILED, f"{type(error).__name__}: {error}"
        if self.state.round_failures.get(key) != what:
            logger.error(
                "Autoscaling round of %s/%s failed (logged again only when this changes): %s", key[0], key[1], what
            )
        logger.debug("Autoscaling round of %s/%s failed", key[0], key[1], exc_info=error)
        self.state.round_failures[key] = what

        def clock() -> datetime.datetime:
            return datetime.datetime.fromtimestamp(now_seconds, datetime.UTC).replace(microsecond=0)

        try:
            await asyncio.to_thread(
                status.patch_status,
                api=self.api,
                namespace=key[0],
                name=key[1],
                clock=clock,
                observed_generation=(body.get("metadata") or {}).get("generation"),
                conditions=[
                    status.ConditionUpdate(
                        type=ConditionType.SCALING_ACTIVE.value,
                        status="False",
                        reason=reason,
                        message=f"the autoscaling round failed: {what}"[:MAX_MESSAGE_LENGTH],
                    )
                ],
            )
        except Exception as exc:  # noqa: BLE001 - the failure is logged already; the next round retries
            logger.debug("Could not report the failed round of %s/%s: %s", key[0], key[1], exc)


def register(
    *,
    registry: kopf.OperatorRegistry,
    api: kube.Kube,
    prometheus_url: str,
    metrics_registry: CollectorRegistry,
    base_tick_seconds: float = defaults.AUTOSCALER_BASE_TICK_SECONDS,
    scrape_interval_seconds: float = defaults.SCRAPE_INTERVAL_SECONDS,
    window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> AutoscalerLoop:
    """Install the autoscaler into ``registry``: an ``on.event`` handler that feeds the
    :class:`AutoscalerLoop` every InferenceService's body (and forgets deleted ones), and
    ``on.startup``/``on.cleanup`` handlers that start and stop its ticker. No handler needs a
    finalizer or writes anything to the object. ``scrape_interval_seconds`` is Prometheus'
    scrape interval (staleness is judged against the longer of it and the object's interval);
    ``window_seconds`` the smoothing window of every gauge; ``clock`` and ``wall_clock`` as in
    :class:`AutoscalerLoop`. Returns the loop, for inspection."""
    autoscaler = AutoscalerLoop(
        api=api,
        prometheus=make_prometheus(url=prometheus_url),
        state=AutoscalerState(),
        metrics=AutoscalerMetrics.create(registry=metrics_registry),
        base_tick_seconds=base_tick_seconds,
        scrape_interval_seconds=scrape_interval_seconds,
        window_seconds=window_seconds,
        clock=clock,
        wall_clock=wall_clock,
    )
    group, version, plural = contract.API_GROUP, contract.API_VERSION, contract.PLURAL

    async def track(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        autoscaler.observe(event_type=event.get("type"), body=body)

    async def start(**_: Any) -> None:
        autoscaler.start()

    async def stop(**_: Any) -> None:
        await autoscaler.stop()

    kopf.on.event(group, version, plural, registry=registry, id="autoscaler-track")(track)
    kopf.on.startup(registry=registry, id="autoscaler-start")(start)
    kopf.on.cleanup(registry=registry, id="autoscaler-stop")(stop)
    return autoscaler
