"""What the SLO controller reads from Prometheus, beyond the target-tracking gauges.

The engine-step counters (one regression point per live pod, :func:`fetch_step_samples`),
the pool's KV capacity and its measured latency quantiles (:func:`fetch_pool_slo`), and the
service's load (:func:`fetch_load`). Why here and not in :mod:`..signals`: these queries
exist only for the SLO autoscaler, and :mod:`..signals` (the gauges every round reads) then
needs nothing of :mod:`.inputs`. Every query is pinned like the gauges
(:func:`..signals.pool_selector`), to the pool's Ready pods, so a scaled-away pod's stale
series never enters a fit or a sum. Failures are :class:`..decision.MetricsUnavailable`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from prometheus_api_client import PrometheusConnect

from splitserve_contract import Metric, Reason, Role, defaults

from ..decision import MetricsUnavailable
from ..signals import PoolSample, pool_selector, query_by_pod
from .inputs import LoadObservation, PoolSloObservation, StepSample

ENGINE_COUNTERS: Final = (
    Metric.ENGINE_STEPS_TOTAL,
    Metric.ENGINE_STEP_SECONDS_TOTAL,
    Metric.ENGINE_PREFILL_TOKENS_TOTAL,
    Metric.ENGINE_PREFILL_ATTENTION_PAIRS_TOTAL,
    Metric.ENGINE_DECODE_ROWS_TOTAL,
    Metric.ENGINE_DECODE_CONTEXT_TOKENS_TOTAL,
)
"""The counters of one :class:`~.inputs.StepSample`, in its field order."""
DECODE_ONLY_COUNTERS: Final = (
    Metric.ENGINE_DECODE_ONLY_STEPS_TOTAL,
    Metric.ENGINE_DECODE_ONLY_STEP_SECONDS_TOTAL,
    Metric.ENGINE_DECODE_ONLY_ROWS_TOTAL,
    Metric.ENGINE_DECODE_ONLY_CONTEXT_TOKENS_TOTAL,
)
"""Their decode-only part (:meth:`~.inputs.StepSample.split`), in its argument order."""


def query_value(*, prometheus: PrometheusConnect, promql: str, now_seconds: float) -> float | None:
    """Run an instant query that aggregates to one series; its value, or None when the result
    is empty or not a number (a quantile or ratio of nothing). Raises :class:`MetricsUnavailable`."""
    values = query_by_pod(prometheus=prometheus, promql=promql, now_seconds=now_seconds)
    return sum(values.values()) if values else None


def fetch_step_samples(
    *,
    prometheus: PrometheusConnect,
    selector: str,
    now_seconds: float,
    window_seconds: float,
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
        return [
            query_by_pod(
                prometheus=prometheus,
                now_seconds=now_seconds,
                promql=f"max by (pod) (increase({metric}{selector}[{window_seconds:.0f}s]))",
            )
            for metric in metrics
        ]

    by_metric = increases(ENGINE_COUNTERS)
    pods = sorted(set.intersection(*(set(values) for values in by_metric)))
    decode_only = increases(DECODE_ONLY_COUNTERS) if pods and split else []
    samples: list[StepSample] = []
    for pod in pods:
        steps, seconds, tokens, pairs, rows, context = (max(0.0, values[pod]) for values in by_metric)
        if steps <= 0:
            continue
        window = StepSample(
            steps=steps,
            seconds=seconds,
            prefill_tokens=tokens,
            prefill_attention_pairs=pairs,
            decode_rows=rows,
            decode_context_tokens=context,
        )
        if not decode_only or not all(pod in values for values in decode_only):
            samples.append(window)
            continue
        d_steps, d_seconds, d_rows, d_context = (max(0.0, values[pod]) for values in decode_only)
        samples.extend(
            window.split(
                decode_only_steps=d_steps,
                decode_only_seconds=d_seconds,
                decode_only_rows=d_rows,
                decode_only_context_tokens=d_context,
            )
        )
    return samples


def latency_quantile_promql(*, metric: str, selector: str, quantile: float, window_seconds: float) -> str:
    """The pool-wide ``quantile`` of a latency histogram over the window (all pods' buckets summed)."""
    return f"histogram_quantile({quantile:g}, sum by (le) (rate({metric}_bucket{selector}[{window_seconds:.0f}s])))"


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
    :func:`..signals.fetch_pool_sample` for the same pods) plus the step counters, the KV capacity
    (``splitserve_kv_cache_blocks`` × ``block_size``, the smallest pod's) and the pool's TTFT
    and ITL at the ``attainment`` quantile. Each pod records the latencies of the requests it
    served from its own arrival: in Disaggregated mode the prefill pool's TTFT is queue +
    prefill, the decode pool's is the KV pull to its first token (and whole requests for
    prompts the router sends straight to decode). Raises :class:`MetricsUnavailable`."""
    if not pods:
        raise MetricsUnavailable(reason=Reason.NO_DATA, message=f"no ready {role} pods to query")
    selector = pool_selector(namespace=namespace, inferenceservice=inferenceservice, role=role, pods=pods)
    prompt_tokens = sample.prompt_tokens_waiting_by_pod or query_by_pod(
        prometheus=prometheus,
        now_seconds=now_seconds,
        promql=f"max by (pod) (avg_over_time({Metric.PROMPT_TOKENS_WAITING}{selector}[{window_seconds:.0f}s]))",
    )
    kv_usage = sample.kv_cache_usage_ratio_by_pod
    blocks = query_by_pod(
        prometheus=prometheus, now_seconds=now_seconds, promql=f"max by (pod) ({Metric.KV_CACHE_BLOCKS}{selector})"
    )

    def quantile(metric: str) -> float | None:
        return query_value(
            prometheus=prometheus,
            now_seconds=now_seconds,
            promql=latency_quantile_promql(
                metric=metric, selector=selector, quantile=attainment, window_seconds=window_seconds
            ),
        )

    return PoolSloObservation(
        role=role,
        current_replicas=current_replicas,
        ready_replicas=len(pods),
        pending_replicas=pending_replicas,
        step_samples=fetch_step_samples(
            prometheus=prometheus,
            selector=selector,
            now_seconds=now_seconds,
            window_seconds=window_seconds,
            split=role != Role.PREFILL.value,
        ),
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

    prefill = (
        pool_selector(namespace=namespace, inferenceservice=inferenceservice, role=prefill_role, pods=prefill_pods)
        if prefill_pods
        else None
    )

    def rate(metric: str, selector: str, seconds: float = window_seconds) -> float | None:
        return query_value(
            prometheus=prometheus, now_seconds=now_seconds, promql=f"sum(rate({metric}{selector}[{seconds:.0f}s]))"
        )

    def prompt_rate(seconds: float) -> float:
        """Prompt tokens computed per second: the entry pool's, plus the prefill pool's (a decode
        pod counts the prompts it computed itself, not imported ones)."""
        total = rate(Metric.PROMPT_TOKENS_TOTAL, entry, seconds) or 0.0
        if prefill is not None and prefill_role != entry_role:
            total += rate(Metric.PROMPT_TOKENS_TOTAL, prefill, seconds) or 0.0
        return total

    requests_per_second = rate(Metric.REQUESTS_TOTAL, entry)
    if requests_per_second is None:
        raise MetricsUnavailable(
            reason=Reason.NO_DATA,
            message=(f"no {Metric.REQUESTS_TOTAL} series for {entry_role} pods of {namespace}/{inferenceservice}"),
        )
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
