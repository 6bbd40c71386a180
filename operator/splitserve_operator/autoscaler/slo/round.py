"""The SLO part of an autoscaling round: from ``spec.autoscaling.slo`` and what the round
observed to the SLO controller's decisions (:func:`.controller.decide_slo`).

Why a module of its own: :mod:`..loop` stays the round's skeleton (observe → decide → act →
report) for both ways of deciding, and everything that exists only because of the SLO (the
conversion of the spec, which pool the load is read from, the controller's own
recommendation histories, feeding the state) is here, free of kopf and of status writing.

Pools and their roles: the *entry* pool is where every request finishes (decode, or the
aggregated pool), so the request rate and the token means are read there; the *prefill* pool
(prefill, or the aggregated pool) is where prompts are computed, so the prefix hit ratio is
read there (:func:`.measure.fetch_load`).

The controller's stabilization windows keep a history of their own per pool (key
``<pool>:slo`` in :class:`..memory.AutoscalerState`): the target-tracking decisions computed in
the same round as floors record theirs in the pool's usual history, and the two must not mix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from prometheus_api_client import PrometheusConnect

from splitserve_contract import Role, defaults

from ...api.spec import InferenceServiceSpec, Mode, SloSpec
from ..decision import Decision, PoolPolicy, RecommendationHistory
from ..memory import AutoscalerState
from .controller import decide_slo
from .inputs import LoadObservation, PoolSloObservation, SloInputs, SloTarget, StepCoefficients
from .measure import fetch_load
from .state import SloState

HISTORY_SUFFIX: Final = ":slo"


def slo_target(slo: SloSpec) -> SloTarget:
    """``spec.autoscaling.slo`` as the controller's :class:`SloTarget` (durations in seconds)."""
    prior = None
    if slo.prior is not None:
        prior = StepCoefficients(
            step=slo.prior.step,
            prefill_token=slo.prior.prefill_token,
            prefill_pair=slo.prior.prefill_pair,
            decode_row=slo.prior.decode_row,
            decode_context=slo.prior.decode_context,
        )
    return SloTarget(
        ttft_p99_seconds=slo.ttft_p99_seconds,
        itl_p99_seconds=slo.itl_p99_seconds,
        attainment=slo.attainment,
        headroom=slo.headroom,
        prior=prior,
    )


def entry_and_prefill_roles(spec: InferenceServiceSpec) -> tuple[str, str]:
    """(entry role, prefill role): see the module docstring."""
    if spec.mode is Mode.AGGREGATED:
        return Role.AGGREGATED.value, Role.AGGREGATED.value
    return Role.DECODE.value, Role.PREFILL.value


def read_load(
    *,
    prometheus: PrometheusConnect,
    spec: InferenceServiceSpec,
    namespace: str,
    name: str,
    ready_pods: Mapping[str, Sequence[str]],
    now_seconds: float,
    window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS,
    scrape_interval_seconds: float = defaults.SCRAPE_INTERVAL_SECONDS,
) -> LoadObservation:
    """The service's load, from the live pods of ``ready_pods`` (pool → Ready pod names), with
    the request mix of the last autoscaling interval as well where that is shorter than the
    window and holds two scrapes (``rate()`` needs two samples; with the default 15 s scrapes
    it is the 30 s window itself, and nothing more is read). Raises :class:`MetricsUnavailable`."""
    entry, prefill = entry_and_prefill_roles(spec)
    recent = max(spec.autoscaling.interval_seconds, 2.0 * scrape_interval_seconds)
    return fetch_load(
        prometheus=prometheus,
        namespace=namespace,
        inferenceservice=name,
        entry_role=entry,
        entry_pods=list(ready_pods.get(entry, ())),
        prefill_role=prefill,
        prefill_pods=list(ready_pods.get(prefill, ())),
        now_seconds=now_seconds,
        window_seconds=window_seconds,
        recent_seconds=recent if recent < window_seconds else None,
    )


def slo_histories(
    *, state: AutoscalerState, namespace: str, name: str, now_seconds: float, current_replicas: Mapping[str, int]
) -> dict[str, RecommendationHistory]:
    """The controller's own recommendation history of each pool (see the module docstring)."""
    return {
        pool: state.history(
            namespace=namespace,
            name=name,
            pool=pool + HISTORY_SUFFIX,
            now_seconds=now_seconds,
            current_replicas=replicas,
        )
        for pool, replicas in current_replicas.items()
    }


def observe(
    *,
    slo: SloSpec,
    slo_state: SloState,
    pools: Mapping[str, PoolSloObservation],
    load: LoadObservation | None,
    now_seconds: float,
) -> SloInputs:
    """Feed this round's inputs to the state (the fits, the forecaster, the pod start-time
    tracker); returns them for :func:`decide`. The fits learn even in a round that holds."""
    inputs = SloInputs(now_seconds=now_seconds, pools=pools, load=load)
    slo_state.observe(inputs, slo_target(slo))
    return inputs


def decide(
    *,
    spec: InferenceServiceSpec,
    slo: SloSpec,
    slo_state: SloState,
    inputs: SloInputs,
    floors: Mapping[str, int],
    policies: Mapping[str, PoolPolicy],
    gpus_per_replica: Mapping[str, int],
    histories: Mapping[str, RecommendationHistory],
) -> list[Decision]:
    """The controller's decision for every pool of ``inputs`` (already through :func:`observe`),
    with ``floors`` (the target-tracking results) as lower bounds."""
    return decide_slo(
        inputs=inputs,
        slo=slo_target(slo),
        state=slo_state,
        policies=policies,
        histories=histories,
        gpus_per_replica=gpus_per_replica,
        floors=floors,
        gpu_budget=spec.autoscaling.gpu_budget,
        max_num_batched_tokens=_prompt_pool_budget(spec),
        dry_run=spec.autoscaling.dry_run,
    )


def _prompt_pool_budget(spec: InferenceServiceSpec) -> int:
    """The token budget per step of the pool that computes prompts (its own scheduling wins
    over the service's)."""
    pool = spec.prefill or spec.aggregated
    return (spec.pool_scheduling(pool) if pool is not None else spec.scheduling_settings).max_batched_tokens
