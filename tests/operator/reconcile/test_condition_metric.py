"""``splitserve_inferenceservice_condition``: alerts read an InferenceService's conditions
from the operator's /metrics (as its watch delivers them), and a deleted object's series go."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contract import OperatorMetric
from splitserve_operator.metrics import OperatorMetrics


def _series(metrics: OperatorMetrics) -> set[tuple[str, ...]]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.labels["namespace"], s.labels["inferenceservice"], s.labels["type"], s.labels["status"], s.labels["reason"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == OperatorMetric.INFERENCESERVICE_CONDITION and s.value == 1.0
    }


def test_conditions_follow_the_status_and_leave_with_the_object() -> None:
    metrics = OperatorMetrics.create()
    metrics.conditions.observe(
        ("team", "chat"),
        [
            {"type": "Ready", "status": "True", "reason": "Reconciled"},
            {"type": "MetricsHealthy", "status": "False", "reason": "MetricsUnavailable"},
        ],
    )
    metrics.conditions.observe(("team", "other"), [{"type": "Ready", "status": "False", "reason": "Progressing"}])
    assert _series(metrics) == {
        ("team", "chat", "Ready", "True", "Reconciled"),
        ("team", "chat", "MetricsHealthy", "False", "MetricsUnavailable"),
        ("team", "other", "Ready", "False", "Progressing"),
    }
    # a new status replaces the old rows (no stale False once it is True again)
    metrics.conditions.observe(
        ("team", "chat"),
        [{"type": "MetricsHealthy", "status": "True", "reason": "MetricsAvailable"}, {"status": "True"}],
    )
    metrics.conditions.forget(("team", "other"))
    assert _series(metrics) == {("team", "chat", "MetricsHealthy", "True", "MetricsAvailable")}
