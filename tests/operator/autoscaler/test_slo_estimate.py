"""Closed-form TTFT/ITL estimates: queueing facts, monotonicity, backlog, stability, KV."""

from __future__ import annotations

import math

import pytest
from slo_testing import TRUTH

from splitserve_operator.autoscaler.slo import (
    Backlog,
    Workload,
    estimate_aggregated,
    estimate_decode,
    estimate_disaggregated,
    estimate_prefill,
)
from splitserve_operator.autoscaler.slo.estimate import (
    erlang_c,
    normal_quantile,
    queue_wait_quantile,
)

BUDGET = 2048
LOAD = Workload(request_rate=4.0, prompt_tokens=1500.0, output_tokens=200.0, prefix_hit_ratio=0.2)


def test_queueing_building_blocks_match_textbook_values() -> None:
    assert normal_quantile(0.99) == pytest.approx(2.3263, abs=1e-3)
    assert normal_quantile(0.5) == pytest.approx(0.0, abs=1e-6)
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # M/M/1: P(wait) = ρ
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # M/M/1 (cs² = 1): P(W > t) = ρ·exp(-(μ-λ)t)  →  t_q = ln(ρ/(1-q)) / (μ-λ)
    wait = queue_wait_quantile(servers=1, rate=0.8, service_seconds=1.0, attainment=0.99, scv=1.0)
    assert wait == pytest.approx(math.log(0.8 / 0.01) / 0.2)
    assert queue_wait_quantile(servers=1, rate=0.005, service_seconds=1.0, attainment=0.99) == 0.0
    assert queue_wait_quantile(servers=2, rate=2.0, service_seconds=1.0, attainment=0.99) == math.inf


def test_workload_splits_cached_and_uncached_prompt() -> None:
    assert LOAD.uncached_tokens == pytest.approx(1200.0)
    assert LOAD.cached_tokens == pytest.approx(300.0)
    assert LOAD.prefill_pairs == pytest.approx(1200 * 300 + 1200 * 1201 / 2)
    assert Workload(request_rate=1, prompt_tokens=100, output_tokens=10, prefix_hit_ratio=1.0).uncached_tokens == 1.0


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_estimates_fall_with_replicas_and_rise_with_rate(mode: str) -> None:
    def at(n: int, rate: float) -> tuple[float, float]:
        load = Workload(request_rate=rate, prompt_tokens=1500, output_tokens=200, prefix_hit_ratio=0.2)
        if mode == "aggregated":
            e = estimate_aggregated(TRUTH, load, replicas=n, max_num_batched_tokens=BUDGET, attainment=0.99)
        else:
            e = estimate_disaggregated(
                TRUTH,
                TRUTH,
                load,
                prefill_replicas=n,
                decode_replicas=n,
                max_num_batched_tokens=BUDGET,
                attainment=0.99,
            )
        return e.ttft_seconds, e.itl_seconds

    for rate in (0.5, 2.0, 6.0):
        series = [at(n, rate) for n in range(1, 12)]
        for (ttft_a, itl_a), (ttft_b, itl_b) in zip(series, series[1:], strict=False):
            assert ttft_b <= ttft_a and itl_b <= itl_a, (rate, series)
        assert math.isfinite(series[-1][0]) and math.isfinite(series[-1][1])
    for n in (2, 4, 8):
        rates = [at(n, r) for r in (0.5, 1, 2, 4, 6, 8)]
        for (ttft_a, itl_a), (ttft_b, itl_b) in zip(rates, rates[1:], strict=False):
            assert ttft_b >= ttft_a and itl_b >= itl_a, (n, rates)


def test_overload_is_infinite_not_negative() -> None:
    p = estimate_prefill(
        TRUTH,
        LOAD.__class__(request_rate=1000.0, prompt_tokens=1500, output_tokens=200),
        replicas=1,
        max_num_batched_tokens=BUDGET,
        attainment=0.99,
    )
    assert p.ttft_seconds == math.inf and p.utilization >= 1.0
    d = estimate_decode(
        TRUTH, Workload(request_rate=1000.0, prompt_tokens=1500, output_tokens=200), replicas=1, attainment=0.99
    )
    assert d.itl_seconds == math.inf
    assert estimate_decode(TRUTH, LOAD, replicas=0, attainment=0.99).itl_seconds == math.inf


def test_queue_backlog_raises_ttft_and_more_replicas_drain_it() -> None:
    calm = estimate_prefill(TRUTH, LOAD, replicas=2, max_num_batched_tokens=BUDGET, attainment=0.99)
    backlog = Backlog(requests_waiting=200, prompt_tokens_waiting=200 * 1200)
    stuck = estimate_prefill(TRUTH, LOAD, replicas=2, max_num_batched_tokens=BUDGET, attainment=0.99, backlog=backlog)
    assert stuck.drain_seconds > 1.0 and stuck.ttft_seconds > calm.ttft_seconds + 1.0
    more = estimate_prefill(TRUTH, LOAD, replicas=6, max_num_batched_tokens=BUDGET, attainment=0.99, backlog=backlog)
    assert more.ttft_seconds < stuck.ttft_seconds
    # new pods arrive only after the start time: the current pods drain meanwhile
    late = estimate_prefill(
        TRUTH,
        LOAD,
        replicas=6,
        max_num_batched_tokens=BUDGET,
        attainment=0.99,
        backlog=backlog,
        serving_replicas=2,
        start_seconds=60.0,
    )
    assert late.drain_seconds < more.drain_seconds


def test_attainment_quantile_matters() -> None:
    busy = Workload(request_rate=5.0, prompt_tokens=1500, output_tokens=200)
    loose = estimate_prefill(TRUTH, busy, replicas=2, max_num_batched_tokens=BUDGET, attainment=0.9)
    tight = estimate_prefill(TRUTH, busy, replicas=2, max_num_batched_tokens=BUDGET, attainment=0.999)
    assert tight.queue_seconds > loose.queue_seconds
    d90 = estimate_decode(TRUTH, busy, replicas=2, attainment=0.9)
    d999 = estimate_decode(TRUTH, busy, replicas=2, attainment=0.999)
    assert d999.itl_seconds > d90.itl_seconds


def test_decode_batch_follows_littles_law() -> None:
    d = estimate_decode(TRUTH, LOAD, replicas=2, attainment=0.99)
    tokens_per_second = LOAD.request_rate * LOAD.output_tokens / 2
    assert d.batch == pytest.approx(tokens_per_second * d.step_seconds)
    assert d.step_seconds == pytest.approx(
        TRUTH.step + d.batch * (TRUTH.decode_row + TRUTH.decode_context * LOAD.decode_context)
    )


def test_kv_capacity_bounds_the_batch() -> None:
    roomy = estimate_decode(TRUTH, LOAD, replicas=2, attainment=0.99, kv_tokens_per_replica=1e6)
    assert math.isfinite(roomy.itl_seconds)
    cramped = estimate_decode(
        TRUTH, LOAD, replicas=2, attainment=0.99, kv_tokens_per_replica=roomy.kv_tokens / 0.9 * 0.5
    )
    assert cramped.itl_seconds == math.inf


def test_disaggregated_ttft_includes_the_first_decode_step() -> None:
    e = estimate_disaggregated(
        TRUTH, TRUTH, LOAD, prefill_replicas=2, decode_replicas=2, max_num_batched_tokens=BUDGET, attainment=0.99
    )
    assert e.prefill is not None and e.decode is not None
    assert e.ttft_seconds == pytest.approx(e.prefill.ttft_seconds + e.decode.step_seconds)
    assert e.itl_seconds == e.decode.itl_seconds


def test_aggregated_steps_carry_prefill_chunks() -> None:
    """Mixing prefill into decode steps makes ITL worse than a pure decode pool's."""
    agg = estimate_aggregated(TRUTH, LOAD, replicas=3, max_num_batched_tokens=BUDGET, attainment=0.99)
    pure = estimate_decode(TRUTH, LOAD, replicas=3, attainment=0.99)
    assert agg.itl_seconds > pure.itl_seconds
    assert agg.decode is not None and agg.decode.batch > pure.batch  # steps are longer, so more in flight


def test_a_committed_queue_drains_at_one_servers_spare_rate() -> None:
    """The router binds a request to one pod on arrival: the wait probability is still
    Erlang C's, but the tail decays c× slower than a shared queue's."""
    shared = queue_wait_quantile(servers=4, rate=3.4, service_seconds=1.0, attainment=0.99)
    committed = queue_wait_quantile(servers=4, rate=3.4, service_seconds=1.0, attainment=0.99, committed=True)
    assert shared > 0.0 and math.isclose(committed, 4.0 * shared)
    single = queue_wait_quantile(servers=1, rate=0.85, service_seconds=1.0, attainment=0.99)
    assert queue_wait_quantile(servers=1, rate=0.85, service_seconds=1.0, attainment=0.99, committed=True) == single
    # idle capacity: no wait either way
    assert queue_wait_quantile(servers=4, rate=0.2, service_seconds=1.0, attainment=0.99, committed=True) == 0.0
