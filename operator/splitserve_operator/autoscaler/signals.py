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
(:func:`fetch_pool_slo`, :func:`fetch_load`): the engine-step counters' increase per live pod
(one regression point each), the KV capacity, the pool's latency quantiles, and the load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException

from splitserve_contract import Metric, Reason, Role, defaults

from .decision import MetricsUnavailable, SignalValue
from .slo.inputs import LoadObservation, PoolSloObservation, StepSample

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
        raise MetricsUnavailable(reason=Reason.QUERY_FAILED, message=(
            "the operator has no Prometheus URL (its --prometheus-url flag, the chart's prometheus.url "
            "value): autoscaling cannot read metrics"))
    try:
        result: Any = prometheus.custom_query(query=promql, params={"time": f"{now_seconds:.3f}"})
    except (PrometheusApiClientException, requests.RequestException, ValueError) as exc:
        raise MetricsUnavailable(
            reason=Reason.QUERY_FAILED, message=f"{promql}: {exc}"[:1000]
        ) from exc
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

    @property
    def pods_reporting(self) -> int:
        return len(self.requests_waiting_by_pod)

    def load_by_pod(self) -> dict[str, float]:
        """Requests in flight per pod (running + waiting): who is cheap to remove."""
        pods = set(self.requests_waiting_by_pod) | set(self.requests_running_by_pod)
        return {
            p: self.requests_waiting_by_pod.get(p, 0.0) + self.requests_running_by_pod.get(p, 0.0)
            for p in pods
        }


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
) -> PoolSample:
    """Query one pool's gauges. ``pods`` (the Ready pods) restricts the series; None
    takes every pod of the pool. Raises :class:`MetricsUnavailable`."""
    if pods is not None and not pods:
        raise MetricsUnavailable(reason=Reason.NO_DATA, message=f"no ready {role} pods to query")
    selector = pool_selector(namespace=namespace, inferenceservice=inferenceservice, role=role, pods=pods)
    where = f"{role} pods of {namespace}/{inferenceservice}"

    newest = query_by_pod(
        prometheus=prometheus,
        promql=f"max by (pod) (timestamp({Metric.REQUESTS_WAITING}{selector}))",
        now_seconds=now_seconds,
    )
    if not newest:
        raise MetricsUnavailable(
            reason=Reason.NO_DATA, message=f"no {Metric.REQUESTS_WAITING} series for {where}"
        )
    age_seconds = now_seconds - max(newest.values())
    if age_seconds > stale_after_seconds:
        raise MetricsUnavailable(
            reason=Reason.STALE,
            message=f"newest {Metric.REQUESTS_WAITING} sample for {where} is {age_seconds:.0f}s old "
            f"(limit {stale_after_seconds:.0f}s)",
        )

    def smoothed(metric: str) -> dict[str, float]:
        return query_by_pod(
            prometheus=prometheus,
            promql=f"max by (pod) (avg_over_time({metric}{selector}[{window_seconds:.0f}s]))",
            now_seconds=now_seconds,
        )

    prefill_like = role == Role.PREFILL.value
    return PoolSample(
        requests_waiting_by_pod=smoothed(Metric.REQUESTS_WAITING),
        requests_running_by_pod=smoothed(Metric.REQUESTS_RUNNING),
        prompt_tokens_waiting_by_pod=smoothed(Metric.PROMPT_TOKENS_WAITING) if prefill_like else {},
        kv_cache_usage_ratio_by_pod={} if prefill_like else smoothed(Metric.KV_CACHE_USAGE_RATIO),
        newest_sample_age_seconds=age_seconds,
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

    out = {
        QUEUE: SignalValue(
            value=sum(required(sample.requests_waiting_by_pod, Metric.REQUESTS_WAITING).values()) / ready_replicas,
            target=targets.queue_depth,
        )
    }
    if targets.kv_cache_utilization is not None:
        kv = required(sample.kv_cache_usage_ratio_by_pod, Metric.KV_CACHE_USAGE_RATIO)
        out[KV] = SignalValue(value=sum(kv.values()) / len(kv), target=targets.kv_cache_utilization)
    if targets.prompt_tokens_waiting is not None:
        tokens = required(sample.prompt_tokens_waiting_by_pod, Metric.PROMPT_TOKENS_WAITING)
        out[PROMPT_TOKENS] = SignalValue(value=sum(tokens.values()) / ready_replicas, target=targets.prompt_tokens_waiting)
    return out


# --------------------------------------------------------------------------- SLO inputs
# The SLO controller (:mod:`.slo`) reads more than the target-tracking gauges: the engine-step
# counters (one regression point per live pod), the pool's KV capacity, its measured p99
# latencies, and the service's load. Every query is pinned like the gauges above, to the
# pool's Ready pods, so a scaled-away pod's stale series never enters a fit or a sum.

ENGINE_COUNTERS: Final = (
    Metric.ENGINE_STEPS_TOTAL, Metric.ENGINE_STEP_SECONDS_TOTAL, Metric.ENGINE_PREFILL_TOKENS_TOTAL,
    Metric.ENGINE_PREFILL_ATTENTION_PAIRS_TOTAL, Metric.ENGINE_DECODE_ROWS_TOTAL,
    Metric.ENGINE_DECODE_CONTEXT_TOKENS_TOTAL,
)
"""The counters of one :class:`~.slo.inputs.StepSample`, in its field order."""
DECODE_ONLY_COUNTERS: Final = (
    Metric.ENGINE_DECODE_ONLY_STEPS_TOTAL, Metric.ENGINE_DECODE_ONLY_STEP_SECONDS_TOTAL,
    Metric.ENGINE_DECODE_ONLY_ROWS_TOTAL, Metric.ENGINE_DECODE_ONLY_CONTEXT_TOKENS_TOTAL,
)
"""Their decode-only part (:meth:`~.slo.inputs.StepSample.split`), in its argument order."""


def query_value(*, prometheus: PrometheusConnect, promql: str, now_seconds: float) -> float | None:
    """Run an instant query that aggregates to one series; its value, or None when the result
    is empty or not a number (a quantile or ratio of nothing). Raises :class:`MetricsUnavailable`."""
    values = query_by_pod(prometheus=prometheus, promql=promql, now_seconds=now_seconds)
    return sum(values.values()) if values else None


def fetch_step_samples(
    *, prometheus: PrometheusConnect, selector: str, now_seconds: float, window_seconds: float,
    split: bool = True,
) -> list[StepSample]:
    """The :class:`StepSample` points of every pod that ran engine steps over the window: the
    increase of the six engine counters, split into its decode-only part and the rest when
    the pod exports the decode-only counters (:meth:`StepSample.split`: two points of different
    mixes). A pod missing one of the six (an older runtime) gives no point; one missing the
    decode-only counters gives its window unsplit. ``split=False`` gives every window unsplit
    without querying the decode-only counters: a Disaggregated prefill pool, whose pods
    finish each request at its first token and so never run a decode-only step (four
    queries fewer per round)."""

    def increases(metrics: Sequence[str]) -> list[dict[str, float]]:
        return [query_by_pod(prometheus=prometheus, now_seconds=now_seconds,
                             promql=f"max by (pod) (increase({metric}{selector}[{window_seconds:.0f}s]))")
                for metric in metrics]

    by_metric = increases(ENGINE_COUNTERS)
    pods = sorted(set.intersection(*(set(values) for values in by_metric)))
    decode_only = increases(DECODE_ONLY_COUNTERS) if pods and split else []
    samples: list[StepSample] = []
    for pod in pods:
        steps, seconds, tokens, pairs, rows, context = (max(0.0, values[pod]) for values in by_metric)
        if steps <= 0:
            continue
        window = StepSample(steps=steps, seconds=seconds, prefill_tokens=tokens, prefill_attention_pairs=pairs,
                            decode_rows=rows, decode_context_tokens=context)
        if not decode_only or not all(pod in values for values in decode_only):
            samples.append(window)
            continue
        d_steps, d_seconds, d_rows, d_context = (max(0.0, values[pod]) for values in decode_only)
        samples.extend(window.split(decode_only_steps=d_steps, decode_only_seconds=d_seconds,
                                    decode_only_rows=d_rows, decode_only_context_tokens=d_context))
    return samples


def latency_quantile_promql(*, metric: str, selector: str, quantile: float, window_seconds: float) -> str:
    """The pool-wide ``quantile`` of a latency histogram over the window (all pods' buckets summed)."""
    return (f"histogram_quantile({quantile:g}, sum by (le) "
            f"(rate({metric}_bucket{selector}[{window_seconds:.0f}s])))")


def fetch_pool_slo(
    *,
    prometheus: PrometheusConnect,
    namespace: str,
    inferenceservice: str,
    role: str,
    pods: Sequence[str],
    sample: PoolSample,
    current_replicas: int,
    pending_replicas: int,
    block_size: int,
    attainment: float,
    now_seconds: float,
    window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS,
) -> PoolSloObservation:
    """One pool's :class:`PoolSloObservation`: ``sample`` (the round's gauges, already read by
    :func:`fetch_pool_sample` for the same pods) plus the step counters, the KV capacity
    (``splitserve_kv_cache_blocks`` × ``block_size``, the smallest pod's) and the pool's TTFT
    and ITL at the ``attainment`` quantile. Each pod records the latencies of the requests it
    served from its own arrival: in Disaggregated mode the prefill pool's TTFT is queue +
    prefill, the decode pool's is the KV pull to its first token (and whole requests for
    prompts the router sends straight to decode). Raises :class:`MetricsUnavailable`."""
    if not pods:
        raise MetricsUnavailable(reason=Reason.NO_DATA, message=f"no ready {role} pods to query")
    selector = pool_selector(namespace=namespace, inferenceservice=inferenceservice, role=role, pods=pods)
    prompt_tokens = sample.prompt_tokens_waiting_by_pod or query_by_pod(
        prometheus=prometheus, now_seconds=now_seconds,
        promql=f"max by (pod) (avg_over_time({Metric.PROMPT_TOKENS_WAITING}{selector}[{window_seconds:.0f}s]))")
    kv_usage = sample.kv_cache_usage_ratio_by_pod
    blocks = query_by_pod(prometheus=prometheus, now_seconds=now_seconds,
                          promql=f"max by (pod) ({Metric.KV_CACHE_BLOCKS}{selector})")

    def quantile(metric: str) -> float | None:
        return query_value(prometheus=prometheus, now_seconds=now_seconds, promql=latency_quantile_promql(
            metric=metric, selector=selector, quantile=attainment, window_seconds=window_seconds))

    return PoolSloObservation(
        role=role,
        current_replicas=current_replicas,
        ready_replicas=len(pods),
        pending_replicas=pending_replicas,
        step_samples=fetch_step_samples(prometheus=prometheus, selector=selector, now_seconds=now_seconds,
                                        window_seconds=window_seconds, split=role != Role.PREFILL.value),
        requests_waiting=sum(sample.requests_waiting_by_pod.values()),
        prompt_tokens_waiting=sum(prompt_tokens.values()),
        requests_running=sum(sample.requests_running_by_pod.values()),
        kv_cache_usage_ratio=sum(kv_usage.values()) / len(kv_usage) if kv_usage else 0.0,
        kv_cache_tokens_per_replica=min(blocks.values()) * block_size if blocks else 0.0,
        ttft_p99_seconds=quantile(Metric.TIME_TO_FIRST_TOKEN_SECONDS),
        itl_p99_seconds=quantile(Metric.INTER_TOKEN_LATENCY_SECONDS),
    )


def fetch_load(
    *,
    prometheus: PrometheusConnect,
    namespace: str,
    inferenceservice: str,
    entry_role: str,
    entry_pods: Sequence[str],
    prefill_role: str,
    prefill_pods: Sequence[str],
    now_seconds: float,
    window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS,
    recent_seconds: float | None = None,
) -> LoadObservation:
    """The service's load over the window. Every request finishes on the entry pool (decode, or
    aggregated), so its ``splitserve_requests_total`` (all outcomes) is the request rate and its
    generation token counter gives the output mean per request; prompt tokens are counted where
    they are computed (the prefill pool's, plus the decode pool's own for prompts the router
    sent straight to it), and so is the prefix hit ratio. With ``recent_seconds`` shorter than
    the window, the prompt and output means over that last stretch too (four more queries;
    None where it saw no request). Raises :class:`MetricsUnavailable` (``NoData`` without live
    entry pods or without any request series)."""
    if not entry_pods:
        raise MetricsUnavailable(reason=Reason.NO_DATA, message=f"no ready {entry_role} pods to read the load from")
    entry = pool_selector(namespace=namespace, inferenceservice=inferenceservice, role=entry_role, pods=entry_pods)

    prefill = (pool_selector(namespace=namespace, inferenceservice=inferenceservice, role=prefill_role,
                             pods=prefill_pods) if prefill_pods else None)

    def rate(metric: str, selector: str, seconds: float = window_seconds) -> float | None:
        return query_value(prometheus=prometheus, now_seconds=now_seconds,
                           promql=f"sum(rate({metric}{selector}[{seconds:.0f}s]))")

    def prompt_rate(seconds: float) -> float:
        """Prompt tokens computed per second: the entry pool's, plus the prefill pool's (a decode
        pod counts the prompts it computed itself, not imported ones)."""
        total = rate(Metric.PROMPT_TOKENS_TOTAL, entry, seconds) or 0.0
        if prefill is not None and prefill_role != entry_role:
            total += rate(Metric.PROMPT_TOKENS_TOTAL, prefill, seconds) or 0.0
        return total

    requests_per_second = rate(Metric.REQUESTS_TOTAL, entry)
    if requests_per_second is None:
        raise MetricsUnavailable(reason=Reason.NO_DATA, message=(
            f"no {Metric.REQUESTS_TOTAL} series for {entry_role} pods of {namespace}/{inferenceservice}"))
    output_rate = rate(Metric.GENERATION_TOKENS_TOTAL, entry) or 0.0
    hit_ratio = 0.0
    if prefill is not None:
        queried = rate(Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL, prefill) or 0.0
        hits = rate(Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL, prefill) or 0.0
        hit_ratio = min(1.0, max(0.0, hits / queried)) if queried > 0 else 0.0
    recent_prompt = recent_output = None
    if recent_seconds is not None and recent_seconds < window_seconds:
        recent_requests = rate(Metric.REQUESTS_TOTAL, entry, recent_seconds) or 0.0
        if recent_requests > 0:
            recent_prompt = prompt_rate(recent_seconds) / recent_requests
            recent_output = (rate(Metric.GENERATION_TOKENS_TOTAL, entry, recent_seconds) or 0.0) / recent_requests
    per_request = requests_per_second if requests_per_second > 0 else math.inf
    return LoadObservation(
        window_seconds=window_seconds,
        request_rate=max(0.0, requests_per_second),
        prompt_tokens_mean=prompt_rate(window_seconds) / per_request,
        output_tokens_mean=output_rate / per_request,
        prefix_hit_ratio=hit_ratio,
        recent_prompt_tokens_mean=recent_prompt,
        recent_output_tokens_mean=recent_output,
    )
