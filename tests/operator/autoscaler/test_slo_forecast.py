"""Holt's linear-trend forecast of the request rate: follows ramps ahead, never negative."""

from __future__ import annotations

import json
import math
import random

import pytest
from slo_testing import load

from splitserve_operator.autoscaler.slo import LoadForecaster, LoadObservation


def ramp(rate_at: float, *, seconds: float, step: float = 15.0) -> tuple[LoadForecaster, float, float]:
    """Feed ``rate(t) = 1 + rate_at·t`` every ``step`` seconds: the forecaster, the last t and
    what a plain EWMA (α 0.5, no trend) would plan on."""
    forecaster = LoadForecaster()
    t, ewma = 0.0, 1.0
    while t <= seconds:
        forecaster.update(load(1.0 + rate_at * t), now_seconds=t)
        ewma = 0.5 * (1.0 + rate_at * t) + 0.5 * ewma
        t += step
    return forecaster, t - step, ewma


def test_nothing_to_forecast_before_the_first_window() -> None:
    assert LoadForecaster().forecast(horizon_seconds=60) is None


def test_a_steady_rate_forecasts_itself() -> None:
    forecaster = LoadForecaster()
    for i in range(40):
        forecaster.update(load(5.0, prompt=800, output=100, hit=0.3), now_seconds=15.0 * i)
    out = forecaster.forecast(horizon_seconds=120)
    assert out is not None
    assert abs(out.request_rate - 5.0) < 1e-6
    assert (out.prompt_tokens_mean, out.output_tokens_mean) == (800, 100)
    assert abs(out.prefix_hit_ratio - 0.3) < 1e-9


def test_a_ramp_is_led_not_lagged() -> None:
    slope = 0.02  # +1.2 requests/s per minute
    forecaster, now, ewma = ramp(slope, seconds=600)
    current = 1.0 + slope * now
    ahead = forecaster.forecast(horizon_seconds=120)
    assert ahead is not None
    truth = 1.0 + slope * (now + 120)
    print(
        f"ramp: now {current:.2f}/s, forecast +120 s {ahead.request_rate:.2f}/s, truth {truth:.2f}/s, "
        f"plain EWMA {ewma:.2f}/s"
    )
    assert abs(ahead.request_rate - truth) < 0.05 * truth
    assert ahead.request_rate > current
    # a plain EWMA lags the ramp: it plans for less than the current rate
    assert ewma < current < ahead.request_rate


def test_a_falling_rate_never_forecasts_below_zero() -> None:
    forecaster = LoadForecaster()
    for i in range(20):
        forecaster.update(load(max(0.0, 10.0 - i)), now_seconds=15.0 * i)
    out = forecaster.forecast(horizon_seconds=600)
    assert out is not None and out.request_rate == 0.0


def test_one_burst_window_does_not_extrapolate_into_a_surge() -> None:
    forecaster = LoadForecaster()
    for i in range(20):
        forecaster.update(load(2.0), now_seconds=15.0 * i)
    forecaster.update(load(6.0), now_seconds=300.0)
    out = forecaster.forecast(horizon_seconds=120)
    assert out is not None
    print(f"after one 3x burst window: forecast +120 s {out.request_rate:.2f}/s")
    assert 4.0 <= out.request_rate < 6.0


def test_a_long_gap_restarts_from_the_new_observation() -> None:
    forecaster, now, _ = ramp(0.05, seconds=300)
    forecaster.update(load(3.0), now_seconds=now + 3600)
    out = forecaster.forecast(horizon_seconds=300)
    assert out is not None and out.request_rate == 3.0


def test_round_trip_and_rejects_garbage() -> None:
    forecaster, _, _ = ramp(0.01, seconds=300)
    back = LoadForecaster.from_dict(json.loads(json.dumps(forecaster.to_dict())))
    assert back.forecast(horizon_seconds=90) == forecaster.forecast(horizon_seconds=90)
    for bad in ({}, {"version": 1, "level": "x"}, {"version": 2}):
        try:
            LoadForecaster.from_dict(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_observation_fields_pass_through() -> None:
    forecaster = LoadForecaster()
    forecaster.update(
        LoadObservation(
            window_seconds=30.0, request_rate=1.0, prompt_tokens_mean=10.0, output_tokens_mean=5.0, prefix_hit_ratio=0.5
        ),
        now_seconds=0.0,
    )
    out = forecaster.forecast(horizon_seconds=0.0)
    assert out == LoadObservation(
        window_seconds=30.0, request_rate=1.0, prompt_tokens_mean=10.0, output_tokens_mean=5.0, prefix_hit_ratio=0.5
    )


def test_burstiness_is_deviation_beyond_poisson_noise() -> None:
    rng = random.Random(4)
    steady, bursty = LoadForecaster(), LoadForecaster()
    for i in range(200):
        t = 15.0 * i
        steady.update(load(_poisson(rng, 20.0 * 15.0) / 15.0), now_seconds=t)
        high = (i // 8) % 2 == 1  # 2-minute phases at 10/s and 30/s (an MMPP)
        bursty.update(load(_poisson(rng, (30.0 if high else 10.0) * 15.0) / 15.0), now_seconds=t)
    print(
        f"burstiness: steady Poisson {steady.burstiness:.2f}/s (deviation {steady.deviation:.2f}), "
        f"MMPP {bursty.burstiness:.2f}/s (deviation {bursty.deviation:.2f})"
    )
    # the steady stream keeps only the forecast's own error above the noise (~0.4/s of 20/s)
    assert steady.burstiness < 0.6 < 1.0 < steady.deviation
    assert bursty.burstiness > 5 * steady.burstiness and bursty.burstiness > 2.0


def _poisson(rng: random.Random, mean: float) -> float:
    """A Poisson count by its normal approximation (mean ≥ 100 here)."""
    return max(0.0, round(rng.gauss(mean, math.sqrt(mean))))


def test_the_recent_peak_outlives_a_burst_and_decays_with_its_half_life() -> None:
    """After a burst the plan keeps the burst's rate for a while (a pod start is too slow to
    catch the next one): the peak stays near the high state, then decays toward the level."""
    from splitserve_operator.autoscaler.slo import forecast

    f = LoadForecaster()
    t = 0.0
    for rate in [10.0] * 20 + [30.0] * 20:
        f.update(load(rate), now_seconds=t)
        t += 15.0
    assert f.peak > 29.0
    for _ in range(20):
        f.update(load(10.0), now_seconds=t)
        t += 15.0
    assert f.level is not None and f.level < 11.0
    # 300 s of low rate: one half-life, so about half of the excess is left
    half = forecast.PEAK_HALF_LIFE_SECONDS
    assert half == 20 * 15.0
    assert 16.0 < f.peak < 22.0, f.peak
    restored = LoadForecaster.from_dict(json.loads(json.dumps(f.to_dict())))
    assert restored.peak == f.peak
    legacy = {k: v for k, v in f.to_dict().items() if k != "peak"}
    assert LoadForecaster.from_dict(legacy).peak == f.level


def test_the_memory_is_one_of_time_not_of_updates() -> None:
    # a step from 0 to 20/s seen through a 30 s rate() window is a 30 s ramp; the trend it leaves
    # after 45 s must not depend on how often the operator looks (5 s vs the default 15 s)
    def forecast_after(interval: float) -> float:
        forecaster = LoadForecaster()
        t = 0.0
        while t <= 45.0:
            forecaster.update(load(min(20.0, 20.0 * t / 30.0)), now_seconds=t)
            t += interval
        out = forecaster.forecast(horizon_seconds=120.0)
        assert out is not None
        return out.request_rate

    every_5s, every_15s = forecast_after(5.0), forecast_after(15.0)
    assert every_5s == pytest.approx(every_15s, rel=0.25), (every_5s, every_15s)
    assert every_5s < 2.0 * 20.0  # a step does not extrapolate into a surge
