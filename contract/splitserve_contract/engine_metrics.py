"""Each serving engine's names for the signals the operator reads from its pods.

Why here: the autoscaler (target tracking and the SLO controller), the router's load view and
the dashboard read the same handful of signals (queue depth, KV usage, token and request
counters, latency histograms) from every pool, whichever engine serves it. The bundled runtime
exports them under ``splitserve_*`` names (:class:`.metrics.Metric`); vLLM under its own
``vllm:*`` names. One :class:`EngineMetricNames` per engine says which series carries which
signal, so a reader asks for "requests waiting" of an engine, never for a name, and a new
engine is one more table here. ``None``: the engine exports no such signal (the reader holds,
or falls back, saying so).

The vLLM table is checked against a real ``/metrics`` page of the pinned vLLM
(``tests/contract/fixtures/vllm-0.32.0-metrics.txt``, ``tests/contract/test_engine_metrics.py``).
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .engines import Engine
from .metrics import Metric, ModelServerMetric


@dataclass(frozen=True, kw_only=True)
class EngineMetricNames:
    """The series of one engine for each signal (see the module docstring)."""

    requests_waiting: str
    """Gauge: requests queued, not yet scheduled."""
    requests_running: str
    """Gauge: requests in the running batch."""
    kv_cache_usage_ratio: str
    """Gauge: the fraction (0..1) of KV cache blocks in use."""
    prompt_tokens_waiting: str | None
    """Gauge: prompt tokens queued and not yet computed (the prefill pool's backlog)."""
    prompt_tokens_total: str
    """Counter: prompt tokens of finished prefills."""
    generation_tokens_total: str
    """Counter: output tokens generated."""
    prefix_cache_queried_tokens_total: str
    """Counter: prompt tokens looked up in the prefix cache."""
    prefix_cache_hit_tokens_total: str
    """Counter: of those, tokens found."""
    preemptions_total: str
    """Counter: running requests preempted for KV room."""
    requests_total: str
    """Counter: requests that ended (by ``requests_outcome_label``)."""
    requests_outcome_label: str
    """The label of ``requests_total`` that says how each ended."""
    time_to_first_token_seconds: str
    """Histogram: arrival to first output token."""
    inter_token_latency_seconds: str
    """Histogram: between consecutive output tokens."""
    e2e_request_latency_seconds: str
    """Histogram: arrival to the last token."""
    model_label: str
    """The label naming the served model on every series."""


SPLITSERVE_METRICS: Final = EngineMetricNames(
    requests_waiting=Metric.REQUESTS_WAITING,
    requests_running=Metric.REQUESTS_RUNNING,
    kv_cache_usage_ratio=Metric.KV_CACHE_USAGE_RATIO,
    prompt_tokens_waiting=Metric.PROMPT_TOKENS_WAITING,
    prompt_tokens_total=Metric.PROMPT_TOKENS_TOTAL,
    generation_tokens_total=Metric.GENERATION_TOKENS_TOTAL,
    prefix_cache_queried_tokens_total=Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL,
    prefix_cache_hit_tokens_total=Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL,
    preemptions_total=Metric.PREEMPTIONS_TOTAL,
    requests_total=Metric.REQUESTS_TOTAL,
    requests_outcome_label="outcome",
    time_to_first_token_seconds=Metric.TIME_TO_FIRST_TOKEN_SECONDS,
    inter_token_latency_seconds=Metric.INTER_TOKEN_LATENCY_SECONDS,
    e2e_request_latency_seconds=Metric.E2E_REQUEST_LATENCY_SECONDS,
    model_label="model",
)

VLLM_METRICS: Final = EngineMetricNames(
    requests_waiting=ModelServerMetric.NUM_REQUESTS_WAITING,  # the model-server protocol's are vLLM's own
    requests_running=ModelServerMetric.NUM_REQUESTS_RUNNING,
    kv_cache_usage_ratio=ModelServerMetric.KV_CACHE_USAGE_PERC,  # a fraction 0..1 despite its name
    prompt_tokens_waiting=None,  # vLLM exports no backlog in tokens, only in requests
    prompt_tokens_total="vllm:prompt_tokens_total",
    generation_tokens_total="vllm:generation_tokens_total",
    prefix_cache_queried_tokens_total="vllm:prefix_cache_queries_total",  # counted in tokens
    prefix_cache_hit_tokens_total="vllm:prefix_cache_hits_total",
    preemptions_total="vllm:num_preemptions_total",
    requests_total="vllm:request_success_total",
    requests_outcome_label="finished_reason",  # stop, length, abort, error, repetition
    time_to_first_token_seconds="vllm:time_to_first_token_seconds",
    inter_token_latency_seconds="vllm:inter_token_latency_seconds",
    e2e_request_latency_seconds="vllm:e2e_request_latency_seconds",
    model_label="model_name",
)

SIGNAL_KINDS: Final[dict[str, str]] = {
    "requests_waiting": "gauge",
    "requests_running": "gauge",
    "kv_cache_usage_ratio": "gauge",
    "prompt_tokens_waiting": "gauge",
    "prompt_tokens_total": "counter",
    "generation_tokens_total": "counter",
    "prefix_cache_queried_tokens_total": "counter",
    "prefix_cache_hit_tokens_total": "counter",
    "preemptions_total": "counter",
    "requests_total": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
}
"""The Prometheus type of each signal's series (the fields of :class:`EngineMetricNames` that
name a series), whichever engine exports it."""

ENGINE_METRICS: Final[dict[Engine, EngineMetricNames]] = {
    Engine.SPLITSERVE: SPLITSERVE_METRICS,
    Engine.VLLM: VLLM_METRICS,
}
"""Every engine's table; a new engine must add one (a test checks each is complete)."""
