"""The operator's autoscaling decision, driven by simulated pool metrics.

Reuses :func:`splitserve_operator.autoscaler.decision.decide` (the same code the operator runs,
imported, not copied) with the signals the runtime would export: requests waiting per ready
replica for every pool, and mean KV-cache usage for decode pools. Pods the decision adds
serve after the simulator's start-up delay; pods it removes stop taking requests and drain.
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

    def __init__(self, *, settings: AutoscaleSettings, initial_replicas: dict[str, int],
                 gpus_per_replica: int) -> None:
        self.settings = settings
        self.gpus_per_replica = gpus_per_replica
        self.histories = {role: RecommendationHistory.fresh(now_seconds=0.0, current_replicas=count)
                          for role, count in initial_replicas.items()}
        self.policy = PoolPolicy(min_replicas=settings.min_replicas, max_replicas=settings.max_replicas,
                                 behavior=Behavior(scale_down_stabilization_seconds=settings.scale_down_stabilization_seconds))
        self.decisions: list[Decision] = []

    def step(self, *, now_seconds: float, observations: dict[str, PoolObservation]) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, obs in observations.items():
            ready = max(obs.ready_replicas, 1)
            if role == "decode":
                signals = {"queueDepth": SignalValue(value=obs.requests_waiting / ready,
                                                     target=self.settings.decode_target_queue_depth),
                           "kvCacheUtilization": SignalValue(value=obs.kv_cache_usage_ratio,
                                                             target=self.settings.decode_target_kv_utilization)}
            else:
                signals = {"queueDepth": SignalValue(value=obs.requests_waiting / ready,
                                                     target=self.settings.prefill_target_queue_depth)}
            decision = decide(pool=role, now_seconds=now_seconds, current_replicas=obs.current_replicas,
                              ready_replicas=obs.ready_replicas, pending_replicas=0, signals=signals,
                              policy=self.policy, history=self.histories[role], gpus_per_replica=self.gpus_per_replica)
            self.decisions.append(decision)
            out[role] = decision.result
        return out
