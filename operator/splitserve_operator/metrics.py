"""The operator's own Prometheus metrics and the /metrics server.

Metrics live in a private :class:`prometheus_client.CollectorRegistry` (not the global
default one), so tests can build several operators in one process and the exposition
contains only the operator's series plus the process collector.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve_contract import OperatorMetric

RECONCILE_BUCKETS_SECONDS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


ConditionKey = tuple[str, str]
"""(namespace, name) of an InferenceService."""


class ConditionCollector(Collector):
    """``splitserve_inferenceservice_condition``: what each InferenceService's status shows now,
    as the operator's watch delivers it (whichever writer set it: the reconciler or the
    autoscaler), so alerts read a condition itself (e.g. MetricsHealthy=False) rather than a
    proxy. One series of value 1 per condition; a deleted object's series go with it."""

    def __init__(self) -> None:
        self._conditions: dict[ConditionKey, tuple[tuple[str, str, str], ...]] = {}
        self._lock = threading.Lock()

    def observe(self, key: ConditionKey, conditions: Sequence[Mapping[str, Any]]) -> None:
        rows = tuple(
            (str(c.get("type", "")), str(c.get("status", "")), str(c.get("reason", "")))
            for c in conditions
            if c.get("type")
        )
        with self._lock:
            self._conditions[key] = rows

    def forget(self, key: ConditionKey) -> None:
        with self._lock:
            self._conditions.pop(key, None)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            OperatorMetric.INFERENCESERVICE_CONDITION,
            "1 for each condition an InferenceService's status shows now",
            labels=["namespace", "inferenceservice", "type", "status", "reason"],
        )
        with self._lock:
            items = sorted(self._conditions.items())
        for (namespace, name), rows in items:
            for type_, status, reason in rows:
                family.add_metric([namespace, name, type_, status, reason], 1.0)
        yield family


@dataclasses.dataclass
class OperatorMetrics:
    registry: CollectorRegistry
    reconcile_seconds: Histogram
    reconcile_errors_total: Counter
    leader: Gauge
    conditions: ConditionCollector

    @classmethod
    def create(cls) -> OperatorMetrics:
        registry = CollectorRegistry()
        prometheus_client.ProcessCollector(registry=registry)
        conditions = ConditionCollector()
        registry.register(conditions)
        return cls(
            registry=registry,
            reconcile_seconds=Histogram(
                OperatorMetric.RECONCILE_SECONDS,
                "Time of one InferenceService reconcile",
                ["outcome"],
                buckets=RECONCILE_BUCKETS_SECONDS,
                registry=registry,
            ),
            reconcile_errors_total=Counter(
                OperatorMetric.RECONCILE_ERRORS_TOTAL,
                "Reconciles that ended in a retryable error",
                registry=registry,
            ),
            leader=Gauge(OperatorMetric.LEADER, "1 while this replica holds the leader Lease", registry=registry),
            conditions=conditions,
        )


def serve(*, metrics: OperatorMetrics, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Start /metrics on host:port in a daemon thread; returns the server (call shutdown())."""
    server, thread = prometheus_client.start_http_server(port, addr=host, registry=metrics.registry)
    return server, thread
