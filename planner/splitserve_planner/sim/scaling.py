"""The autoscaling hook: every ``interval_seconds`` the operator's own decision
(:class:`~splitserve_planner.autoscale.SimAutoscaler`) sees each pool's queue depth and KV
usage — or, in SLO mode, the window's :class:`SloInputs` (:mod:`.observe`); pods it adds
serve after ``startup_seconds``, pods it removes stop taking requests and leave when drained."""

from __future__ import annotations

from ..autoscale import PoolObservation, SimAutoscaler
from .observe import WindowObserver
from .state import POD_READY, SCALE


class Scaling(WindowObserver):
    """Autoscaler ticks (``SCALE`` events) and the pods they start or drain."""

    scaler: SimAutoscaler
    """Set when the fleet has ``autoscale`` settings; holds every decision made."""

    def _init_autoscaler(self) -> None:
        settings = self.fleet.autoscale
        assert settings is not None
        self.scaler = SimAutoscaler(
            settings=settings,
            initial_replicas={r: len(p) for r, p in self.pools.items()},
            gpus_per_replica=self.fleet.gpus_per_replica,
            max_num_batched_tokens=self.engine.max_batched_tokens,
        )
        if settings.slo is not None:
            self._init_observer()
        self._push(settings.interval_seconds, SCALE, None)

    def _autoscale(self) -> None:
        settings = self.fleet.autoscale
        assert settings is not None
        observations = {
            role: PoolObservation(
                current_replicas=len(pods) + self.starting[role],
                ready_replicas=len(pods),
                requests_waiting=float(sum(len(p.waiting) for p in pods)),
                kv_cache_usage_ratio=sum(p.kv_used / p.capacity for p in pods) / max(len(pods), 1),
            )
            for role, pods in self.pools.items()
        }
        slo_inputs = self._observe_window(quantile=settings.slo.attainment) if settings.slo is not None else None
        desired_counts = self.scaler.step(now_seconds=self.now, observations=observations, slo_inputs=slo_inputs)
        for role, desired in desired_counts.items():
            pods = self.pools[role]
            current = observations[role].current_replicas
            for _ in range(desired - current):
                self.starting[role] += 1
                self._push(self.now + settings.startup_seconds, POD_READY, self._new_pod(role))
            for _ in range(current - desired):
                if len(pods) <= 1:
                    break
                pod = pods.pop()
                pod.accepting = False  # newest first, as a ReplicaSet scales down; it drains
                if not pod.busy and pod.is_idle() and not pod.inbound:
                    pod.gone_s = self.now
