"""The signal queries against a real Prometheus (the harness' build) scraping real targets.

Each fake pod is a ``prometheus_client`` HTTP server with its own registry exporting the
runtime's gauges; Prometheus scrapes them every second, and ``static_configs`` labels add
``namespace``, ``pod`` and ``inferenceservice`` the way the chart's pod relabelling does.
A pod of another namespace with the same InferenceService name checks the pinning. Tests
may run in any order (pytest-randomly): the one that stops a target has a pod of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from autoscaler_testing import FakePod, eventually, running_prometheus
from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from splitserve_contract import Metric, Reason
from splitserve_contract.engine_metrics import VLLM_METRICS
from splitserve_contract.engines import Engine
from splitserve_e2e.net import free_port
from splitserve_operator.autoscaler.decision import MetricsUnavailable
from splitserve_operator.autoscaler.signals import (
    KV,
    PROMPT_TOKENS,
    QUEUE,
    PoolSample,
    Targets,
    fetch_pool_sample,
    pool_selector,
    pool_signals,
    query_by_pod,
)

PODS = [
    FakePod(
        "ns",
        "svc-decode-a",
        "decode",
        {
            Metric.REQUESTS_WAITING: 3,
            Metric.REQUESTS_RUNNING: 5,
            Metric.KV_CACHE_USAGE_RATIO: 0.9,
            Metric.PROMPT_TOKENS_WAITING: 0,
            Metric.KV_CACHE_BLOCKS: 1000,
        },
    ),
    FakePod(
        "ns",
        "svc-decode-b",
        "decode",
        {
            Metric.REQUESTS_WAITING: 1,
            Metric.REQUESTS_RUNNING: 1,
            Metric.KV_CACHE_USAGE_RATIO: 0.5,
            Metric.PROMPT_TOKENS_WAITING: 0,
            Metric.KV_CACHE_BLOCKS: 1000,
        },
    ),
    FakePod(
        "ns",
        "svc-prefill-c",
        "prefill",
        {
            Metric.REQUESTS_WAITING: 6,
            Metric.REQUESTS_RUNNING: 2,
            Metric.KV_CACHE_USAGE_RATIO: 0.1,
            Metric.PROMPT_TOKENS_WAITING: 1200,
            Metric.KV_CACHE_BLOCKS: 1000,
        },
    ),
    # Another tenant: same InferenceService name and role, other namespace, huge queue.
    FakePod(
        "other",
        "svc-decode-x",
        "decode",
        {
            Metric.REQUESTS_WAITING: 100,
            Metric.REQUESTS_RUNNING: 100,
            Metric.KV_CACHE_USAGE_RATIO: 1.0,
            Metric.PROMPT_TOKENS_WAITING: 0,
            Metric.KV_CACHE_BLOCKS: 1000,
        },
    ),
    # A vLLM pool: vLLM's own names only (no splitserve_* series, no prompt-token backlog).
    FakePod(
        "ns",
        "vsvc-engine-v",
        "aggregated",
        {
            VLLM_METRICS.requests_waiting: 4,
            VLLM_METRICS.requests_running: 7,
            VLLM_METRICS.kv_cache_usage_ratio: 0.6,
        },
        inferenceservice="vsvc",
    ),
    # Stopped by test_stopped_target_is_detected, and queried by no other test.
    FakePod(
        "ns",
        "stoppable-prefill-s",
        "prefill",
        {
            Metric.REQUESTS_WAITING: 1,
            Metric.REQUESTS_RUNNING: 1,
            Metric.KV_CACHE_USAGE_RATIO: 0.1,
            Metric.PROMPT_TOKENS_WAITING: 10,
            Metric.KV_CACHE_BLOCKS: 1000,
        },
        inferenceservice="stoppable",
    ),
]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusConnect]:
    with running_prometheus(pods=PODS, workdir=tmp_path_factory.mktemp("prometheus")) as client:
        yield client


def test_selector_pins_namespace_service_role_and_escapes() -> None:
    assert pool_selector(namespace="ns", inferenceservice='we"ird\\', role="decode", pods=["a.b", "c"]) == (
        '{namespace="ns",inferenceservice="we\\"ird\\\\",role="decode",pod=~"a\\\\.b|c"}'
    )


def test_decode_signals_are_per_ready_replica_and_pinned(prometheus: PrometheusConnect) -> None:
    sample = eventually(
        lambda: fetch_pool_sample(
            prometheus=prometheus,
            namespace="ns",
            inferenceservice="svc",
            role="decode",
            now_seconds=time.time(),
            stale_after_seconds=45,
            window_seconds=5,
        )
    )
    assert sample.requests_waiting_by_pod == {"svc-decode-a": 3.0, "svc-decode-b": 1.0}
    assert sample.kv_cache_usage_ratio_by_pod == {"svc-decode-a": 0.9, "svc-decode-b": 0.5}
    assert sample.load_by_pod() == {"svc-decode-a": 8.0, "svc-decode-b": 2.0}
    assert 0 <= sample.newest_sample_age_seconds < 5
    got = pool_signals(sample=sample, ready_replicas=2, targets=Targets(queue_depth=2, kv_cache_utilization=0.8))
    assert got[QUEUE].value == pytest.approx(2.0) and got[QUEUE].target == 2
    assert got[KV].value == pytest.approx(0.7)
    # Three ready pods, one not scraped yet: its queue counts as empty.
    assert pool_signals(sample=sample, ready_replicas=4, targets=Targets(queue_depth=2))[QUEUE].value == 1.0


def test_pod_filter_and_prefill_prompt_tokens(prometheus: PrometheusConnect) -> None:
    only_a = eventually(
        lambda: fetch_pool_sample(
            prometheus=prometheus,
            namespace="ns",
            inferenceservice="svc",
            role="decode",
            now_seconds=time.time(),
            stale_after_seconds=45,
            window_seconds=5,
            pods=["svc-decode-a"],
        )
    )
    assert only_a.requests_waiting_by_pod == {"svc-decode-a": 3.0}
    prefill = eventually(
        lambda: fetch_pool_sample(
            prometheus=prometheus,
            namespace="ns",
            inferenceservice="svc",
            role="prefill",
            now_seconds=time.time(),
            stale_after_seconds=45,
            window_seconds=5,
        )
    )
    got = pool_signals(sample=prefill, ready_replicas=1, targets=Targets(queue_depth=4, prompt_tokens_waiting=1000))
    assert (got[QUEUE].value, got[PROMPT_TOKENS].value) == (6.0, 1200.0)
    assert KV not in got
    with pytest.raises(MetricsUnavailable) as info:  # KV targeted, but prefill does not query it
        pool_signals(sample=prefill, ready_replicas=1, targets=Targets(queue_depth=4, kv_cache_utilization=0.8))
    assert info.value.reason == Reason.NO_DATA


def test_unknown_pool_is_no_data_and_old_samples_are_stale(prometheus: PrometheusConnect) -> None:
    with pytest.raises(MetricsUnavailable) as info:
        fetch_pool_sample(
            prometheus=prometheus,
            namespace="ns",
            inferenceservice='we"ird',
            role="decode",
            now_seconds=time.time(),
            stale_after_seconds=45,
        )
    assert info.value.reason == Reason.NO_DATA
    # Evaluated 20 s after the last scrape (injected time): the newest sample is too old.
    with pytest.raises(MetricsUnavailable) as info:
        fetch_pool_sample(
            prometheus=prometheus,
            namespace="ns",
            inferenceservice="svc",
            role="decode",
            now_seconds=time.time() + 20,
            stale_after_seconds=3 * 3,
        )
    assert info.value.reason == Reason.STALE
    assert "limit 9s" in info.value.message


def test_query_errors_are_query_failed(prometheus: PrometheusConnect) -> None:
    with pytest.raises(MetricsUnavailable) as info:
        query_by_pod(prometheus=prometheus, promql="max by (pod (splitserve_requests_waiting", now_seconds=time.time())
    assert info.value.reason == Reason.QUERY_FAILED
    assert "400" in info.value.message
    unreachable = PrometheusConnect(url=f"http://127.0.0.1:{free_port()}", retry=Retry(total=0), timeout=2)
    with pytest.raises(MetricsUnavailable) as info:
        fetch_pool_sample(
            prometheus=unreachable,
            namespace="ns",
            inferenceservice="svc",
            role="decode",
            now_seconds=time.time(),
            stale_after_seconds=45,
        )
    assert info.value.reason == Reason.QUERY_FAILED


def test_stopped_target_is_detected(prometheus: PrometheusConnect) -> None:
    """Stops the only pod of its own InferenceService (no other test queries it)."""
    target = next(p for p in PODS if p.inferenceservice == "stoppable")
    eventually(
        lambda: fetch_pool_sample(
            prometheus=prometheus,
            namespace="ns",
            inferenceservice="stoppable",
            role="prefill",
            now_seconds=time.time(),
            stale_after_seconds=3,
        )
    )
    target.stop()

    def gone() -> MetricsUnavailable:
        try:
            fetch_pool_sample(
                prometheus=prometheus,
                namespace="ns",
                inferenceservice="stoppable",
                role="prefill",
                now_seconds=time.time(),
                stale_after_seconds=3,
            )
        except MetricsUnavailable as exc:
            return exc
        raise AssertionError("prefill metrics still reported")

    started = time.monotonic()
    exc = eventually(gone, timeout_seconds=10)
    assert exc.reason in (Reason.NO_DATA, Reason.STALE)
    assert time.monotonic() - started < 5  # a failed scrape marks the series stale at once


def test_an_operator_without_prometheus_says_so() -> None:
    """Installed without a Prometheus URL (chart value prometheus.url empty): the condition's
    message names the setting instead of a client library's URL error."""
    with pytest.raises(MetricsUnavailable) as info:
        query_by_pod(prometheus=PrometheusConnect(url="", retry=Retry(total=0)), promql="up", now_seconds=0.0)
    assert info.value.reason == Reason.QUERY_FAILED
    assert "no Prometheus URL" in info.value.message and "prometheus.url" in info.value.message


def test_a_vllm_pool_is_read_under_vllm_names(prometheus: PrometheusConnect) -> None:
    def sample(engine: Engine) -> PoolSample:
        return fetch_pool_sample(
            prometheus=prometheus,
            namespace="ns",
            inferenceservice="vsvc",
            role="aggregated",
            now_seconds=time.time(),
            stale_after_seconds=45,
            window_seconds=5,
            engine=engine,
        )

    got = eventually(lambda: sample(Engine.VLLM))
    assert got.requests_waiting_by_pod == {"vsvc-engine-v": 4.0}
    assert got.requests_running_by_pod == {"vsvc-engine-v": 7.0}
    assert got.kv_cache_usage_ratio_by_pod == {"vsvc-engine-v": 0.6}
    signals = pool_signals(
        sample=got,
        ready_replicas=2,
        targets=Targets(queue_depth=1, kv_cache_utilization=0.5),
    )
    assert signals[QUEUE].value == pytest.approx(2.0) and signals[KV].value == pytest.approx(0.6)
    # Read as the bundled runtime's pool, the same pods have no series: NoData naming its name.
    with pytest.raises(MetricsUnavailable) as missing:
        sample(Engine.SPLITSERVE)
    assert missing.value.reason == Reason.NO_DATA and Metric.REQUESTS_WAITING in str(missing.value)
