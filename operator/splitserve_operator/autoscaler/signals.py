"""Scaling signals of one pool, read from Prometheus.

Every query is pinned to one namespace, one InferenceService and one role (the labels
Prometheus adds from pod labels, docs/architecture.md, "Metrics"), and optionally to the pool's Ready
pods, so another tenant's pods or a terminating pod never leak into a decision. Each
metric is smoothed over a short window (``avg_over_time``), reduced to one value per pod
(``max by (pod)``, which also de-duplicates a pod scraped twice), and aggregated here:
queues are summed over pods and divided by the Ready replicas (a Ready pod that has not
been scraped yet counts as an empty queue), the KV usage ratio is averaged over pods.

Failures are typed, never a silent zero: a Prometheus error or an unreachable server is
``QueryFailed``, no series for the pool is ``NoData``, and a newest sample older than
``stale_after_seconds`` is ``Stale`` (all :class:`MetricsUnavailable`). Queries are
evaluated at the caller's ``now_seconds`` so the whole decision sees one instant. Every gauge
is smoothed over ``window_seconds`` (default :data:`splitserve_contract.defaults.SIGNAL_WINDOW_SECONDS`).

With ``spec.autoscaling.slo`` the same pinning serves the SLO controller's inputs
(:mod:`.slo.measure`): the engine-step counters' increase per live pod (one regression point
each), the KV capacity, the pool's latency quantiles, and the load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException

from splitserve_contract import Reason, Role, defaults
from splitserve_contract.engine_metrics import ENGINE_METRICS
from splitserve_contract.engines import DEFAULT_ENGINE, Engine

from .decision import MetricsUnavailable, SignalValue

QUEUE: Final = "queue"
KV: Final = "kv"
PROMPT_TOKENS: Final = "promptTokens"

_REGEX_META: Final = frozenset("\\.+*?()|[]{}^$")


def quote_label_value(value: str) -> str:
    """``value`` as a PromQL double-quoted string literal."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _regex_literal(value: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in value)


def pool_selector(*, namespace: str, inferenceservice: str, role: str, pods: Sequence[str] | None = None) -> str:
    """The label matchers that pin a query to one pool (and optionally to some pods)."""
    matchers = [
        f"namespace={quote_label_value(namespace)}",
        f"inferenceservice={quote_label_value(inferenceservice)}",
        f"role={quote_label_value(role)}",
    ]
    if pods is not None:
        alternation = "|".join(_regex_literal(p) for p in sorted(pods))
        matchers.append(f"pod=~{quote_label_value(alternation)}")
    return "{" + ",".join(matchers) + "}"


def query_by_pod(*, prometheus: PrometheusConnect, promql: str, now_seconds: float) -> dict[str, float]:
    """Run an instant query whose result has a ``pod`` label; ``{pod: value}``.
    Raises :class:`MetricsUnavailable` (``QueryFailed``) on any error."""
    if not prometheus.url:
        raise MetricsUnavailable(
            reason=Reason.QUERY_FAILED,
            message=(
                "the operator has no Prometheus URL (its --prometheus-url flag, the chart's prometheus.url "
                "value): autoscaling cannot read metrics"
            ),
        )
    try:
        result: Any = prometheus.custom_query(query=promql, params={"time": f"{now_seconds:.3f}"})
    except (PrometheusApiClientException, requests.RequestException, ValueError) as exc:
        raise MetricsUnavailable(reason=Reason.QUERY_FAILED, message=f"{promql}: {exc}"[:1000]) from exc
    out: dict[str, float] = {}
    for series in result if isinstance(result, list) else []:
        try:
            pod = str(series["metric"].get("pod", ""))
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise MetricsUnavailable(
                reason=Reason.QUERY_FAILED, message=f"{promql}: malformed result {series!r}"[:1000]
            ) from exc
        if math.isfinite(value):
            out[pod] = value
    return out


@dataclasses.dataclass(frozen=True)
class PoolSample:
    """Per-pod values of one pool at one instant (window averages)."""

    requests_waiting_by_pod: dict[str, float]
    requests_running_by_pod: dict[str, float]
    prompt_tokens_waiting_by_pod: dict[str, float]
    kv_cache_usage_ratio_by_pod: dict[str, float]
    newest_sample_age_seconds: float
    engine: Engine = DEFAULT_ENGINE
    """Whose metric names the values were read under (named in messages)."""

    @property
    def pods_reporting(self) -> int:
        return len(self.requests_waiting_by_pod)

    def load_by_pod(self) -> dict[str, float]:
        """Requests in flight per pod (running + waiting): who is cheap to remove."""
        pods = set(self.requests_waiting_by_pod) | set(self.requests_running_by_pod)
        return {p: self.requests_waiting_by_pod.get(p, 0.0) + self.requests_running_by_pod.get(p, 0.0) for p in pods}


def fetch_pool_sample(
    *,
    prometheus: PrometheusConnect,
    namespace: str,
    inferenceservice: str,
    role: str,
    now_seconds: float,
    stale_after_seconds: float,
    window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS,
    pods: Sequence[str] | None = None,
    engine: Engine = DEFAULT_ENGINE,
) -> PoolSample:
    """Query one pool's gauges, under the names its engine exports them by
    (:data:`~splitserve_contract.engine_metrics.ENGINE_METRICS`). ``pods`` (the Ready pods)
    restricts the series; None takes every pod of the pool. Raises :class:`MetricsUnavailable`."""
    names = ENGINE_METRICS[engine]
    if pods is not None and not pods:
        raise MetricsUnavailable(reason=Reason.NO_DATA, message=f"no ready {role} pods to query")
    selector = pool_selector(namespace=namespace, inferenceservice=inferenceservice, role=role, pods=pods)
    where = f"{role} pods of {namespace}/{inferenceservice}"

    newest = query_by_pod(
        prometheus=prometheus,
        promql=f"max by (pod) (timestamp({names.requests_waiting}{selector}))",
        now_seconds=now_seconds,
    )
    if not newest:
        raise MetricsUnavailable(reason=Reason.NO_DATA, message=f"no {names.requests_waiting} series for {where}")
    age_seconds = now_seconds - max(newest.values())
    if age_seconds > stale_after_seconds:
        raise MetricsUnavailable(
            reason=Reason.STALE,
            message=f"newest {names.requests_waiting} sample for {where} is {age_seconds:.0f}s old "
            f"(limit {stale_after_seconds:.0f}s)",
        )

    def smoothed(metric: str) -> dict[str, float]:
        return query_by_pod(
            prometheus=prometheus,
            promql=f"max by (pod) (avg_over_time({metric}{selector}[{window_seconds:.0f}s]))",
            now_seconds=now_seconds,
        )

    prefill_like = role == Role.PREFILL.value
    tokens_waiting = names.prompt_tokens_waiting  # None: the engine exports no such gauge
    return PoolSample(
        requests_waiting_by_pod=smoothed(names.requests_waiting),
        requests_running_by_pod=smoothed(names.requests_running),
        prompt_tokens_waiting_by_pod=smoothed(tokens_waiting) if prefill_like and tokens_waiting else {},
        kv_cache_usage_ratio_by_pod={} if prefill_like else smoothed(names.kv_cache_usage_ratio),
        newest_sample_age_seconds=age_seconds,
        engine=engine,
    )


@dataclasses.dataclass(frozen=True)
class Targets:
    """Per-replica targets of one pool (from ``spec.autoscaling``); None: signal unused."""

    queue_depth: float
    kv_cache_utilization: float | None = None
    prompt_tokens_waiting: float | None = None


def pool_signals(*, sample: PoolSample, ready_replicas: int, targets: Targets) -> dict[str, SignalValue]:
    """The decision's signals: queue and prompt tokens per Ready replica, mean KV usage.
    Raises :class:`MetricsUnavailable` (``NoData``) when a targeted gauge has no series."""
    if ready_replicas <= 0:
        raise ValueError("pool_signals needs at least one ready replica")

    def required(values: Mapping[str, float], metric: str) -> Mapping[str, float]:
        if not values:
            raise MetricsUnavailable(reason=Reason.NO_DATA, message=f"no {metric} series")
        return values

    names = ENGINE_METRICS[sample.engine]
    out = {
        QUEUE: SignalValue(
            value=sum(required(sample.requests_waiting_by_pod, names.requests_waiting).values()) / ready_replicas,
            target=targets.queue_depth,
        )
    }
    if targets.kv_cache_utilization is not None:
        kv = required(sample.kv_cache_usage_ratio_by_pod, names.kv_cache_usage_ratio)
        out[KV] = SignalValue(value=sum(kv.values()) / len(kv), target=targets.kv_cache_utilization)
    if targets.prompt_tokens_waiting is not None:
        tokens = required(sample.prompt_tokens_waiting_by_pod, names.prompt_tokens_waiting or "prompt tokens waiting")
        out[PROMPT_TOKENS] = SignalValue(
            value=sum(tokens.values()) / ready_replicas, target=targets.prompt_tokens_waiting
        )
    return out
