"""The operator's autoscaling decision, driven by simulated pool metrics.

Reuses :func:`splitserve_operator.autoscaler.decision.decide` (the same code the operator runs,
imported, not copied) with the signals the runtime would export: requests waiting per ready
replica for every pool, and mean KV-cache usage for decode pools. Pods the decision adds
serve after the simulator's start-up delay; pods it removes stop taking requests and drain.

SLO mode (``AutoscaleSettings.slo``) runs the operator's SLO controller instead —
:class:`~splitserve_operator.autoscaler.slo.state.SloState` and
:func:`~splitserve_operator.autoscaler.slo.controller.decide_slo`, imported as well — on the
window's :class:`SloInputs` (:mod:`.sim.observe`). Replica writes go into the state's pod-start
tracker, so the forecast horizon is the start-up delay the controller measured, as in a cluster.
Target tracking then only supplies floors, and only when ``slo_target_floors`` says targets are
configured.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_operator.autoscaler.decision import (
    Behavior,
    Decision,
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    decide,
)
from splitserve_operator.autoscaler.slo.controller import decide_slo
from splitserve_operator.autoscaler.slo.inputs import SloInputs
from splitserve_operator.autoscaler.slo.state import SloState

from .sim.config import AutoscaleSettings


@dataclass(frozen=True, kw_only=True)
class PoolObservation:
    """What the operator would read for one pool at one tick."""

    current_replicas: int
    """Ready plus starting pods (the Deployment's spec.replicas)."""
    ready_replicas: int
    requests_waiting: float
    kv_cache_usage_ratio: float


class SimAutoscaler:
    """One :class:`RecommendationHistory` per pool, one :func:`decide` call per pool and tick."""

    def __init__(
        self,
        *,
        settings: AutoscaleSettings,
        initial_replicas: dict[str, int],
        gpus_per_replica: int,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        self.settings = settings
        self.gpus_per_replica = gpus_per_replica
        self.max_num_batched_tokens = max_num_batched_tokens
        self.histories = {
            role: RecommendationHistory.fresh(now_seconds=0.0, current_replicas=count)
            for role, count in initial_replicas.items()
        }
        self.floor_histories = {
            role: RecommendationHistory.fresh(now_seconds=0.0, current_replicas=count)
            for role, count in initial_replicas.items()
        }
        """Target tracking's own proposals in SLO mode (its floors must not stabilize the SLO decision)."""
        self.slo_state = SloState.fresh()
        """The SLO controller's memory (fits, forecaster, pod start times); used in SLO mode only."""
        self.policy = PoolPolicy(
            min_replicas=settings.min_replicas,
            max_replicas=settings.max_replicas,
            behavior=Behavior(scale_down_stabilization_seconds=settings.scale_down_stabilization_seconds),
        )
        self.decisions: list[Decision] = []

    def step(
        self, *, now_seconds: float, observations: dict[str, PoolObservation], slo_inputs: SloInputs | None = None
    ) -> dict[str, int]:
        """Desired replicas per pool; ``slo_inputs`` is required in SLO mode."""
        slo = self.settings.slo
        if slo is None:
            return self._target_tracking(
                now_seconds=now_seconds, observations=observations, histories=self.histories, record=True
            )
        if slo_inputs is None:
            raise ValueError("SLO mode needs the window's SloInputs")
        floors = (
            self._target_tracking(
                now_seconds=now_seconds, observations=observations, histories=self.floor_histories, record=False
            )
            if self.settings.slo_target_floors
            else None
        )
        self.slo_state.observe(slo_inputs, slo)
        roles = list(slo_inputs.pools)
        decisions = decide_slo(
            inputs=slo_inputs,
            slo=slo,
            state=self.slo_state,
            policies=dict.fromkeys(roles, self.policy),
            histories=self.histories,
            gpus_per_replica=dict.fromkeys(roles, self.gpus_per_replica),
            floors=floors,
            gpu_budget=None,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        out: dict[str, int] = {}
        for decision in decisions:
            self.decisions.append(decision)
            out[decision.pool] = decision.result
            if decision.write:
                self.slo_state.record_replicas_write(decision.pool, now_seconds, decision.result)
        at_max = self.settings.max_from_seconds
        if at_max is not None and now_seconds >= at_max:
            return dict.fromkeys(out, self.settings.max_replicas)
        return out

    def _target_tracking(
        self,
        *,
        now_seconds: float,
        observations: dict[str, PoolObservation],
        histories: dict[str, RecommendationHistory],
        record: bool,
    ) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, obs in observations.items():
            ready = max(obs.ready_replicas, 1)
            if role == "decode":
                signals = {
                    "queueDepth": SignalValue(
                        value=obs.requests_waiting / ready, target=self.settings.decode_target_queue_depth
                    ),
                    "kvCacheUtilization": SignalValue(
                        value=obs.kv_cache_usage_ratio, target=self.settings.decode_target_kv_utilization
                    ),
                }
            else:
                signals = {
                    "queueDepth": SignalValue(
                        value=obs.requests_waiting / ready, target=self.settings.prefill_target_queue_depth
                    )
                }
            decision = decide(
                pool=role,
                now_seconds=now_seconds,
                current_replicas=obs.current_replicas,
                ready_replicas=obs.ready_replicas,
                pending_replicas=0,
                signals=signals,
                policy=self.policy,
                history=histories[role],
                gpus_per_replica=self.gpus_per_replica,
            )
            if record:
                self.decisions.append(decision)
            out[role] = decision.result
        return out
