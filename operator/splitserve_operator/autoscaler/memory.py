"""What the autoscaler remembers between rounds, in memory only.

Per (namespace, InferenceService, pool): the recommendation history the stabilization
windows need and the last recommendation (so a dry run reports a change once, not every
round). Per InferenceService: when it last ran, the last metrics-health reason (Events
fire on transitions) and what made its last round fail (logged on a change only).

Lost on restart, deliberately: the status already records every decision for humans, and
a fresh history is seeded with the current replica count
(:meth:`RecommendationHistory.fresh`), so the first down-window after a restart holds
scale-down: a restart can delay a scale-down by one window, never cause one. Entries are
dropped when the InferenceService is deleted (:meth:`AutoscalerState.forget`), so memory
is bounded by the live objects.
"""

from __future__ import annotations

import dataclasses

from .decision import RecommendationHistory

ServiceKey = tuple[str, str]
"""(namespace, name) of an InferenceService."""
PoolKey = tuple[str, str, str]
"""(namespace, name, pool)."""


@dataclasses.dataclass
class AutoscalerState:
    histories: dict[PoolKey, RecommendationHistory] = dataclasses.field(default_factory=dict)
    last_recommendation: dict[PoolKey, int] = dataclasses.field(default_factory=dict)
    last_run_seconds: dict[ServiceKey, float] = dataclasses.field(default_factory=dict)
    """When the loop last started a round per service, on the loop's monotonic clock."""
    metrics_problem: dict[ServiceKey, str] = dataclasses.field(default_factory=dict)
    """Last MetricsUnavailable reason per service ("" while healthy)."""
    round_failures: dict[ServiceKey, str] = dataclasses.field(default_factory=dict)
    """Per service whose last round failed, what failed (logged once, not every interval)."""

    def history(
        self, *, namespace: str, name: str, pool: str, now_seconds: float, current_replicas: int
    ) -> RecommendationHistory:
        key = (namespace, name, pool)
        if key not in self.histories:
            self.histories[key] = RecommendationHistory.fresh(
                now_seconds=now_seconds, current_replicas=current_replicas
            )
        return self.histories[key]

    def due(self, *, namespace: str, name: str, now_seconds: float, interval_seconds: float) -> bool:
        """Whether ``interval_seconds`` passed since the last run (True the first time)."""
        last = self.last_run_seconds.get((namespace, name))
        return last is None or now_seconds - last >= interval_seconds

    def mark_run(self, *, namespace: str, name: str, now_seconds: float) -> None:
        self.last_run_seconds[(namespace, name)] = now_seconds

    def forget(self, *, namespace: str, name: str) -> None:
        """Drop everything about one InferenceService (on deletion)."""
        for table in (self.histories, self.last_recommendation):
            for key in [k for k in table if k[:2] == (namespace, name)]:
                del table[key]
        self.last_run_seconds.pop((namespace, name), None)
        self.metrics_problem.pop((namespace, name), None)
        self.round_failures.pop((namespace, name), None)
