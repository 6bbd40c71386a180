"""The simulator against queueing theory where it is exact: M/M/1 and M/M/c mean waits.

Exponential-service mode: one request at a time per pod, service ~ Exp(mu). One pod is M/M/1;
c pods behind the central-queue router are M/M/c (Erlang C). Tolerance 5 % of the mean wait:
at rho = 0.5 and 200,000 requests the standard error of the M/M/1 sample mean is ~1.2 %, at
M/M/4, rho = 0.7 and 300,000 requests ~1.5 % (asymptotic variance of a queue's sample mean),
so 5 % is > 3 sigma; the seed fixes the draw, so the test is deterministic.
"""

from __future__ import annotations

import math

import pytest

from splitserve_planner.gpus import get_gpu
from splitserve_planner.model_presets import load_model
from splitserve_planner.perf_model import RooflineModel, roofline_model
from splitserve_planner.simulator import AGGREGATED, FleetConfig, SimOptions, simulate
from splitserve_planner.workload import Arrivals, LengthDist, Request, WorkloadSpec

TOLERANCE = 0.05


def _perf() -> RooflineModel:  # only its KV capacity is read in exponential-service mode
    name, config = load_model(name_or_path="tiny")
    return roofline_model(name=name, config=config, gpu=get_gpu("H100-SXM"), tensor_parallel=1, dtype="float32")


def _requests(*, rate: float, count: int, seed: int) -> list[Request]:
    spec = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=rate),
        prompt_tokens=LengthDist.parse("16"),
        output_tokens=LengthDist.parse("4"),
    )
    return spec.generate(duration_seconds=count / rate, seed=seed)


def erlang_c_wait_seconds(*, servers: int, arrival_rate: float, service_rate: float) -> float:
    """Mean wait in queue of M/M/c."""
    a = arrival_rate / service_rate
    rho = a / servers
    tail = a**servers / math.factorial(servers) / (1 - rho)
    head = sum(a**k / math.factorial(k) for k in range(servers))
    probability_wait = tail / (head + tail)
    return probability_wait / (servers * service_rate - arrival_rate)


def test_erlang_c_formula_reduces_to_mm1() -> None:
    assert erlang_c_wait_seconds(servers=1, arrival_rate=0.5, service_rate=1.0) == pytest.approx(1.0)


def test_mm1_mean_wait_and_sojourn() -> None:
    lam, mu = 0.5, 1.0
    requests = _requests(rate=lam, count=200_000, seed=11)
    fleet = FleetConfig(mode=AGGREGATED, aggregated_replicas=1, exponential_service_rate=mu, router_policy="least-load")
    result = simulate(
        fleet=fleet,
        perf=_perf(),
        requests=requests,
        options=SimOptions(warmup_seconds=1000, sample_interval_seconds=0, seed=3),
    )
    expected_wait = lam / mu / (mu - lam)  # rho / (mu - lambda)
    assert result.num_unfinished == 0
    assert result.queue_seconds.mean() == pytest.approx(expected_wait, rel=TOLERANCE)
    assert result.e2e_seconds.mean() == pytest.approx(1 / (mu - lam), rel=TOLERANCE)
    assert result.pools[AGGREGATED].busy_fraction == pytest.approx(lam / mu, rel=0.02)


def test_mmc_mean_wait_matches_erlang_c() -> None:
    servers, lam, mu = 4, 2.8, 1.0
    requests = _requests(rate=lam, count=300_000, seed=12)
    fleet = FleetConfig(
        mode=AGGREGATED, aggregated_replicas=servers, exponential_service_rate=mu, router_policy="central-queue"
    )
    result = simulate(
        fleet=fleet,
        perf=_perf(),
        requests=requests,
        options=SimOptions(warmup_seconds=1000, sample_interval_seconds=0, seed=4),
    )
    expected = erlang_c_wait_seconds(servers=servers, arrival_rate=lam, service_rate=mu)
    assert result.queue_seconds.mean() == pytest.approx(expected, rel=TOLERANCE)
    # P(wait > 0) is Erlang C itself
    waited = float((result.queue_seconds > 1e-12).mean())
    assert waited == pytest.approx(expected * (servers * mu - lam), rel=TOLERANCE)


def test_join_shortest_queue_is_not_mmc_but_close() -> None:
    """Per-pod queues (least-load router) wait at least as long as one shared queue."""
    servers, lam, mu = 4, 2.8, 1.0
    requests = _requests(rate=lam, count=50_000, seed=13)
    shared = simulate(
        fleet=FleetConfig(
            mode=AGGREGATED, aggregated_replicas=servers, exponential_service_rate=mu, router_policy="central-queue"
        ),
        perf=_perf(),
        requests=requests,
        options=SimOptions(sample_interval_seconds=0, seed=5),
    )
    jsq = simulate(
        fleet=FleetConfig(
            mode=AGGREGATED, aggregated_replicas=servers, exponential_service_rate=mu, router_policy="least-load"
        ),
        perf=_perf(),
        requests=requests,
        options=SimOptions(sample_interval_seconds=0, seed=5),
    )
    rr = simulate(
        fleet=FleetConfig(
            mode=AGGREGATED, aggregated_replicas=servers, exponential_service_rate=mu, router_policy="round-robin"
        ),
        perf=_perf(),
        requests=requests,
        options=SimOptions(sample_interval_seconds=0, seed=5),
    )
    assert shared.queue_seconds.mean() < jsq.queue_seconds.mean() < rr.queue_seconds.mean()
