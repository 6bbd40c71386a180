"""The autoscaler's own Prometheus series (docs/architecture.md, "Metrics").

``splitserve_autoscaler_desired_replicas{namespace,inferenceservice,role}`` is the count the
last decision asked for (also in dry run: it is the recommendation),
``splitserve_autoscaler_ready_replicas{namespace,inferenceservice,role}`` the Ready pods that
decision saw (so a dashboard shows desired against ready without kube-state-metrics), and
``splitserve_autoscaler_decisions_total{namespace,inferenceservice,role,direction}`` counts
decisions by ``direction`` (``up``, ``down``, ``none``, ``hold``). ``namespace`` and
``inferenceservice`` are labels because one operator scales many services and a
dashboard must tell them apart; :meth:`AutoscalerMetrics.forget` removes a deleted
service's series so the label set stays bounded.

The series are registered in the registry the operator serves (:mod:`..metrics`), not the
process-global default one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve_contract import OperatorMetric

from .decision import Decision

DIRECTIONS: Final = ("up", "down", "none", "hold")


@dataclasses.dataclass
class AutoscalerMetrics:
    desired_replicas: Gauge
    ready_replicas: Gauge
    decisions_total: Counter
    _seen: set[tuple[str, str, str]] = dataclasses.field(default_factory=set)

    @classmethod
    def create(cls, *, registry: CollectorRegistry) -> AutoscalerMetrics:
        return cls(
            desired_replicas=Gauge(
                OperatorMetric.AUTOSCALER_DESIRED_REPLICAS,
                "Replicas the autoscaler's last decision asked for",
                ["namespace", "inferenceservice", "role"],
                registry=registry,
            ),
            ready_replicas=Gauge(
                OperatorMetric.AUTOSCALER_READY_REPLICAS,
                "Ready pods the autoscaler's last decision saw",
                ["namespace", "inferenceservice", "role"],
                registry=registry,
            ),
            decisions_total=Counter(
                OperatorMetric.AUTOSCALER_DECISIONS_TOTAL,
                "Autoscaler decisions by direction (hold: metrics unavailable)",
                ["namespace", "inferenceservice", "role", "direction"],
                registry=registry,
            ),
        )

    def observe(self, *, namespace: str, name: str, decision: Decision) -> None:
        self._seen.add((namespace, name, decision.pool))
        self.desired_replicas.labels(namespace, name, decision.pool).set(decision.result)
        self.ready_replicas.labels(namespace, name, decision.pool).set(decision.ready_replicas)
        direction = "hold" if decision.hold else decision.direction
        self.decisions_total.labels(namespace, name, decision.pool, direction).inc()

    def forget(self, *, namespace: str, name: str) -> None:
        for key in [k for k in self._seen if k[:2] == (namespace, name)]:
            self._seen.discard(key)
            self.desired_replicas.remove(*key)
            self.ready_replicas.remove(*key)
            for direction in DIRECTIONS:
                with contextlib.suppress(KeyError):  # a direction never seen
                    self.decisions_total.remove(*key, direction)
