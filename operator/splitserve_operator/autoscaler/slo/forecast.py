"""Short-horizon load forecast: Holt's linear trend on the request rate.

Why: a replica asked for now serves only after the pod start time (image pull, model load:
minutes). Planning on the current rate scales up when the queue has already built;
planning on ``rate + trend × start_time`` starts the pods in time on a ramp.

Why Holt and not Holt-Winters: the seasonal periods of inference traffic are a day or a
week, the horizon is minutes; over minutes a daily cycle *is* a linear trend, and a
seasonal model needs several periods of history (days) the operator does not keep.

With irregular intervals ``dt`` between windows (the level and trend are per second; α, β
and the deviation's weight are per 15 s and scaled to ``dt`` so the memory is one of time)::

    predicted = level + trend · dt
    level'    = max(0, α · rate + (1 - α) · predicted)         α = 0.5
    trend'    = β · (level' - level) / dt + (1 - β) · trend    β = 0.1
    forecast(h) = max(0, level + trend · h)

α = 0.5 follows a step in one or two windows (the request-rate window already averages
15-60 s); β = 0.1 needs about ten windows (2-3 min at 15 s) of a consistent slope before the
trend counts in full, so one burst window does not extrapolate into a surge (one window at
3× a steady 2/s gives a +120 s forecast of 5.6/s, below the burst; β = 0.3 would give 8.8/s). The means of prompt and output
length and the prefix hit ratio are plain EWMAs (α = 0.5; lengths shift, they do not
trend). A gap longer than :data:`RESET_AFTER_SECONDS` restarts from the new observation.
The controller plans on ``max(current, forecast, peak) + BURST_MARGIN × burstiness``, where
``peak`` is the recent peak of the level (decaying toward it, :data:`PEAK_HALF_LIFE_SECONDS`),
``deviation`` is a slow EWMA (α = 0.05) of ``|rate - predicted|`` and ``burstiness`` the part
of it beyond the Poisson sampling noise of a window rate (``sqrt(2/π)·sqrt(λ/W)``):
the forecast only ever adds capacity, and a bursty workload (MMPP) gets the margin a pod
start time cannot provide once a burst has begun, while a steady Poisson one gets none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from .inputs import LoadObservation

ALPHA: Final = 0.5
BETA: Final = 0.1
MEAN_ALPHA: Final = 0.5
DEVIATION_ALPHA: Final = 0.05
"""Slow on purpose: the burstiness of a workload is a property of it (about 5 min memory at 15 s)."""
NOISE_FACTOR: Final = 1.0
"""Deviation up to this many times the Poisson sampling noise counts as noise, not bursts."""
PEAK_HALF_LIFE_SECONDS: Final = 300.0
"""The recent peak of the smoothed rate decays toward the level with this half-life. The
peak is what the controller plans on through a lull between bursts (a pod start is too slow
to catch the next one); 5 min, like the burstiness' memory: about one lull of a bursty
workload, and on a diurnal ramp's falling side it only delays scale-down by minutes."""
REFERENCE_INTERVAL_SECONDS: Final = 15.0
"""ALPHA, BETA and DEVIATION_ALPHA are the weights of an update this long after the last (the
default autoscaling interval); other intervals get the weight of the same memory in time."""
RESET_AFTER_SECONDS: Final = 600.0
FORMAT_VERSION: Final = 1


class LoadForecaster:
    """Holt's linear trend on request rate plus EWMAs of the request shape."""

    def __init__(self) -> None:
        self.level: float | None = None
        """Smoothed request rate (requests/s)."""
        self.trend = 0.0
        """Smoothed slope of the rate (requests/s per second)."""
        self.deviation = 0.0
        """EWMA of ``|rate - predicted|`` (requests/s): how bursty the rate is around the trend."""
        self.peak = 0.0
        """Recent peak of the smoothed rate (requests/s), decaying toward the level (see
        :data:`PEAK_HALF_LIFE_SECONDS`)."""
        self.prompt_tokens_mean = 0.0
        self.output_tokens_mean = 0.0
        self.prefix_hit_ratio = 0.0
        self.window_seconds = 0.0
        self.last_seconds: float | None = None

    def update(self, load: LoadObservation, *, now_seconds: float) -> None:
        """Fold one window's observation in (a repeated or older time only refreshes the means)."""
        rate = max(0.0, load.request_rate)
        if not math.isfinite(rate):
            return
        if self.level is None or self.last_seconds is None or now_seconds - self.last_seconds > RESET_AFTER_SECONDS:
            self.level, self.trend, self.deviation, self.peak = rate, 0.0, 0.0, rate
            self.prompt_tokens_mean, self.output_tokens_mean = load.prompt_tokens_mean, load.output_tokens_mean
            self.prefix_hit_ratio = load.prefix_hit_ratio
        else:
            dt = now_seconds - self.last_seconds
            if dt > 0:
                previous = self.level
                alpha, beta, deviation_alpha = (_per_interval(a, dt) for a in (ALPHA, BETA, DEVIATION_ALPHA))
                miss = abs(rate - (previous + self.trend * dt))
                self.deviation = deviation_alpha * miss + (1.0 - deviation_alpha) * self.deviation
                self.level = max(0.0, alpha * rate + (1.0 - alpha) * (previous + self.trend * dt))
                self.trend = beta * (self.level - previous) / dt + (1.0 - beta) * self.trend
                decay = 0.5 ** (dt / PEAK_HALF_LIFE_SECONDS)
                self.peak = max(self.level, self.level + (self.peak - self.level) * decay)
            self.prompt_tokens_mean = _ewma(self.prompt_tokens_mean, load.prompt_tokens_mean)
            self.output_tokens_mean = _ewma(self.output_tokens_mean, load.output_tokens_mean)
            self.prefix_hit_ratio = _ewma(self.prefix_hit_ratio, load.prefix_hit_ratio)
        self.window_seconds = load.window_seconds
        if self.last_seconds is None or now_seconds > self.last_seconds:
            self.last_seconds = now_seconds

    @property
    def burstiness(self) -> float:
        """Rate deviation beyond Poisson sampling noise (requests/s): ``max(0, deviation -
        NOISE_FACTOR·sqrt(2/π)·sqrt(level/window))``. A steady Poisson stream's window rates
        miss by about ``sqrt(2/π)·sqrt(λ/W)`` on their own; only the excess is burstiness."""
        if self.level is None or self.window_seconds <= 0:
            return 0.0
        noise = math.sqrt(2.0 / math.pi) * math.sqrt(max(self.level, 0.0) / self.window_seconds)
        return max(0.0, self.deviation - NOISE_FACTOR * noise)

    def forecast(self, *, horizon_seconds: float) -> LoadObservation | None:
        """The load ``horizon_seconds`` from the last update; None before the first."""
        if self.level is None:
            return None
        return LoadObservation(
            window_seconds=self.window_seconds,
            request_rate=max(0.0, self.level + self.trend * max(0.0, horizon_seconds)),
            prompt_tokens_mean=self.prompt_tokens_mean,
            output_tokens_mean=self.output_tokens_mean,
            prefix_hit_ratio=min(1.0, max(0.0, self.prefix_hit_ratio)),
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "version": FORMAT_VERSION,
            "level": self.level,
            "trend": self.trend,
            "deviation": self.deviation,
            "peak": self.peak,
            "promptTokensMean": self.prompt_tokens_mean,
            "outputTokensMean": self.output_tokens_mean,
            "prefixHitRatio": self.prefix_hit_ratio,
            "windowSeconds": self.window_seconds,
            "lastSeconds": self.last_seconds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LoadForecaster:
        """Inverse of :meth:`to_dict`; ``ValueError`` on anything malformed."""
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"unknown forecaster version {data.get('version')!r}")
        out = cls()
        level, last = data.get("level"), data.get("lastSeconds")
        out.level = None if level is None else _float(level)
        out.last_seconds = None if last is None else _float(last)
        out.trend = _float(data.get("trend", 0.0))
        out.deviation = _float(data.get("deviation", 0.0))
        out.peak = _float(data.get("peak", out.level or 0.0))
        out.prompt_tokens_mean = _float(data.get("promptTokensMean", 0.0))
        out.output_tokens_mean = _float(data.get("outputTokensMean", 0.0))
        out.prefix_hit_ratio = _float(data.get("prefixHitRatio", 0.0))
        out.window_seconds = _float(data.get("windowSeconds", 0.0))
        return out


def _per_interval(weight: float, dt: float) -> float:
    """A smoothing weight stated per :data:`REFERENCE_INTERVAL_SECONDS`, for an update ``dt``
    seconds after the last: ``1 - (1 - weight)^(dt / reference)``. The memory is then one of
    time, not of updates: at a 5 s interval the trend needs the same ~2.5 min of consistent
    slope as at 15 s, instead of learning a step load's ``rate()``-window ramp three times as
    fast and extrapolating it over the pod start time."""
    return 1.0 - math.pow(1.0 - weight, dt / REFERENCE_INTERVAL_SECONDS)


def _ewma(previous: float, value: float) -> float:
    if not math.isfinite(value):
        return previous
    return value if not math.isfinite(previous) else MEAN_ALPHA * value + (1.0 - MEAN_ALPHA) * previous


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)
