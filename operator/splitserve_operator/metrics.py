"""The operator's own Prometheus metrics and the /metrics server.

Metrics live in a private :class:`prometheus_client.CollectorRegistry` (not the global
default one), so tests can build several operators in one process and the exposition
contains only the operator's series plus the process collector.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Final
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve_contract import OperatorMetric

RECONCILE_BUCKETS_SECONDS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class OperatorMetrics:
    registry: CollectorRegistry
    reconcile_seconds: Histogram
    reconcile_errors_total: Counter
    leader: Gauge

    @classmethod
    def create(cls) -> OperatorMetrics:
        registry = CollectorRegistry()
        prometheus_client.ProcessCollector(registry=registry)
        return cls(
            registry=registry,
            reconcile_seconds=Histogram(
                OperatorMetric.RECONCILE_SECONDS, "Time of one InferenceService reconcile",
                ["outcome"], buckets=RECONCILE_BUCKETS_SECONDS, registry=registry,
            ),
            reconcile_errors_total=Counter(
                "splitserve_operator_reconcile_errors_total", "Reconciles that ended in a retryable error",
                registry=registry,
            ),
            leader=Gauge("splitserve_operator_leader", "1 while this replica holds the leader Lease",
                         registry=registry),
        )


def serve(*, metrics: OperatorMetrics, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Start /metrics on host:port in a daemon thread; returns the server (call shutdown())."""
    server, thread = prometheus_client.start_http_server(port, addr=host, registry=metrics.registry)
    return server, thread
