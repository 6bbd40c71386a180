"""Prometheus metrics of one runtime process, named exactly as in docs/architecture.md, "Metrics".

Two sources feed one private registry (never the global one, so several apps can live in a
test process):
- engine state (queue depth, KV usage, token, prefix-cache, speculative decoding and
  engine-step counters) is read from ``engine.stats()`` at scrape time by :class:`_EngineStatsCollector`; nothing copies it
  periodically, so a scrape is never stale and an idle server does no work;
- request-level series (outcomes, TTFT / inter-token / end-to-end latency, KV transfer)
  are ordinary prometheus_client objects the serving code updates.

Every series carries the labels ``role`` and ``model``. Before the engine has loaded, the
engine-derived series are absent rather than zero, so an autoscaler never mistakes a
loading pod for an idle one.

The queue and KV gauges are also exported under the model-server protocol's names
(:class:`~splitserve_contract.ModelServerMetric`, vLLM's, labelled ``model_name``), which
Gateway API Inference Extension endpoint pickers read without configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve_contract import OUTCOMES, ModelServerMetric
from splitserve_contract import Metric as M
from splitserve_runtime.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("role", "model")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


StatsSource = Callable[[], EngineStats | None]

_GAUGES: Sequence[tuple[str, str, str]] = (
    (M.REQUESTS_WAITING, "requests_waiting", "requests queued, not yet scheduled"),
    (M.REQUESTS_RUNNING, "requests_running", "requests being prefilled or decoded"),
    (M.PROMPT_TOKENS_WAITING, "prompt_tokens_waiting", "uncached prompt tokens queued"),
    (
        M.KV_CACHE_USAGE_RATIO,
        "kv_cache_usage_ratio",
        "KV blocks held by live requests / total (cached-but-free blocks count as free)",
    ),
    (M.KV_CACHE_BLOCKS, "kv_cache_blocks_total", "KV cache blocks in the pool"),
)
_COUNTERS: Sequence[tuple[str, str, str]] = (
    (M.PROMPT_TOKENS_TOTAL, "prompt_tokens_total", "prompt tokens admitted"),
    (M.GENERATION_TOKENS_TOTAL, "generation_tokens_total", "tokens generated"),
    (
        M.PREFIX_CACHE_QUERIED_TOKENS_TOTAL,
        "prefix_cache_queried_tokens_total",
        "prompt tokens looked up in the prefix cache",
    ),
    (M.PREFIX_CACHE_HIT_TOKENS_TOTAL, "prefix_cache_hit_tokens_total", "prompt tokens found in the prefix cache"),
    (M.PREEMPTIONS_TOTAL, "preemptions_total", "sequences preempted for lack of KV blocks"),
    (M.SPEC_DECODE_PROPOSED_TOKENS_TOTAL, "spec_decode_proposed_tokens_total", "speculative proposals verified"),
    (
        M.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL,
        "spec_decode_accepted_tokens_total",
        "speculative proposals accepted (each one a token without a step of its own)",
    ),
    # the SLO autoscaler's step model: increases over a window are one regression point
    (M.ENGINE_STEPS_TOTAL, "engine_steps_total", "engine steps run"),
    (
        M.ENGINE_STEP_SECONDS_TOTAL,
        "engine_step_seconds_total",
        "wall time spent inside engine steps (busy time, idle excluded)",
    ),
    (
        M.ENGINE_PREFILL_TOKENS_TOTAL,
        "engine_prefill_tokens_total",
        "new (uncached) prompt tokens computed by engine steps",
    ),
    (
        M.ENGINE_PREFILL_ATTENTION_PAIRS_TOTAL,
        "engine_prefill_attention_pairs_total",
        "causal attention pairs of prefill chunks (n*c + n(n+1)/2 per chunk)",
    ),
    (
        M.ENGINE_DECODE_ROWS_TOTAL,
        "engine_decode_rows_total",
        "decoding sequences summed over steps (speculative verification: 1 + proposals rows)",
    ),
    (
        M.ENGINE_DECODE_CONTEXT_TOKENS_TOTAL,
        "engine_decode_context_tokens_total",
        "KV-cache tokens the decode rows read (their computed context), summed over steps",
    ),
    # their decode-only part (steps without a prefill chunk): two regression points per window
    (M.ENGINE_DECODE_ONLY_STEPS_TOTAL, "engine_decode_only_steps_total", "engine steps that computed no prefill chunk"),
    (
        M.ENGINE_DECODE_ONLY_STEP_SECONDS_TOTAL,
        "engine_decode_only_step_seconds_total",
        "wall time spent inside engine steps that computed no prefill chunk",
    ),
    (
        M.ENGINE_DECODE_ONLY_ROWS_TOTAL,
        "engine_decode_only_rows_total",
        "decoding sequences summed over the steps that computed no prefill chunk",
    ),
    (
        M.ENGINE_DECODE_ONLY_CONTEXT_TOKENS_TOTAL,
        "engine_decode_only_context_tokens_total",
        "KV-cache tokens the decode rows of steps without a prefill chunk read, summed",
    ),
)
_POSITION_COUNTERS: Sequence[tuple[str, str, str]] = (
    (
        M.SPEC_DECODE_ACCEPTED_TOKENS_BY_POSITION_TOTAL,
        "spec_decode_accepted_tokens_by_position",
        "speculative proposals accepted, by position in the step's proposals (0: the first)",
    ),
    (
        M.SPEC_DECODE_PROPOSED_TOKENS_BY_POSITION_TOTAL,
        "spec_decode_proposed_tokens_by_position",
        "speculative proposals verified, by position (accepted / proposed: that position's acceptance rate)",
    ),
)
"""Counters with one series per proposal position (label ``position``)."""


class _EngineStatsCollector(Collector):
    def __init__(self, *, stats_source: StatsSource, labels: tuple[str, str]) -> None:
        self._stats_source = stats_source
        self._labels = list(labels)

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: the registry must not call collect() at registration time

    def collect(self) -> Iterable[Metric]:
        stats = self._stats_source()
        if stats is None:
            return
        for name, field, help_text in _GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=LABELS)
            gauge.add_metric(self._labels, float(getattr(stats, field)))
            yield gauge
        for name, field, help_text in _COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=LABELS)
            counter.add_metric(self._labels, float(getattr(stats, field)))
            yield counter
        for name, field, help_text in _POSITION_COUNTERS:
            counts: tuple[int, ...] = getattr(stats, field)
            if not counts:
                continue
            by_position = CounterMetricFamily(name, help_text, labels=(*LABELS, "position"))
            for position, count in enumerate(counts):
                by_position.add_metric([*self._labels, str(position)], float(count))
            yield by_position
        yield from _model_server_gauges(stats, model=self._labels[1])


def _model_server_gauges(stats: EngineStats, *, model: str) -> Iterable[Metric]:
    """The protocol's gauges (module docstring) from the same snapshot as ours."""
    for name, value, help_text in (
        (ModelServerMetric.NUM_REQUESTS_WAITING, stats.requests_waiting, "requests waiting to be scheduled"),
        (ModelServerMetric.NUM_REQUESTS_RUNNING, stats.requests_running, "requests being processed"),
        (
            ModelServerMetric.KV_CACHE_USAGE_PERC,
            stats.kv_cache_usage_ratio,
            "KV cache usage as a fraction of the pool (1 means 100 percent)",
        ),
    ):
        gauge = GaugeMetricFamily(name, help_text, labels=("model_name",))
        gauge.add_metric([model], float(value))
        yield gauge
    info = GaugeMetricFamily(
        ModelServerMetric.CACHE_CONFIG_INFO,
        "KV cache configuration",
        labels=("model_name", "block_size", "num_gpu_blocks"),
    )
    info.add_metric([model, str(stats.kv_cache_block_size), str(stats.kv_cache_blocks_total)], 1.0)
    yield info


class ServerMetrics:
    """The registry of one server plus the request-level instruments."""

    def __init__(self, *, role: str, model: str, stats_source: StatsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = (role, model)
        self._requests = Counter(
            M.REQUESTS_TOTAL, "finished requests by outcome", (*LABELS, "outcome"), registry=self.registry
        )
        for outcome in OUTCOMES:
            self._requests.labels(role, model, outcome)
        self._ttft = Histogram(
            M.TIME_TO_FIRST_TOKEN_SECONDS,
            "arrival to first token",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*labels)
        self._itl = Histogram(
            M.INTER_TOKEN_LATENCY_SECONDS,
            "gap between output tokens",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(*labels)
        self._e2e = Histogram(
            M.E2E_REQUEST_LATENCY_SECONDS, "arrival to last token", LABELS, buckets=E2E_BUCKETS, registry=self.registry
        ).labels(*labels)
        self._kv_bytes = Counter(
            M.KV_TRANSFER_BYTES_TOTAL, "KV cache bytes sent or received", LABELS, registry=self.registry
        ).labels(*labels)
        self._kv_failures = Counter(
            M.KV_TRANSFER_FAILURES_TOTAL, "failed KV transfers", LABELS, registry=self.registry
        ).labels(*labels)
        self._kv_seconds = Histogram(
            M.KV_TRANSFER_SECONDS,
            "duration of one KV transfer",
            LABELS,
            buckets=KV_TRANSFER_BUCKETS,
            registry=self.registry,
        ).labels(*labels)
        self._labels = labels
        self.registry.register(_EngineStatsCollector(stats_source=stats_source, labels=labels))

    def record_outcome(self, *, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        self._requests.labels(*self._labels, outcome).inc()

    def observe_timings(
        self, *, ttft_seconds: float | None, itl_seconds: Sequence[float], e2e_seconds: float | None
    ) -> None:
        if ttft_seconds is not None:
            self._ttft.observe(ttft_seconds)
        for gap in itl_seconds:
            self._itl.observe(gap)
        if e2e_seconds is not None:
            self._e2e.observe(e2e_seconds)

    def record_kv_transfer(self, *, num_bytes: int, seconds: float, ok: bool) -> None:
        """For the KV transfer connector: one finished (or failed) transfer."""
        if ok:
            self._kv_bytes.inc(num_bytes)
            self._kv_seconds.observe(seconds)
        else:
            self._kv_failures.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
