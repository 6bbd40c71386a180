"""The three load shapes the SLO autoscaling comparison runs on (``bench/slo_autoscaling.py``).

Why these three: each breaks a different assumption of target tracking with fixed targets.
*Steady* Poisson is the baseline every policy should handle. A *diurnal ramp* (the rate rises
from a trough to a peak and falls back over the trace) rewards starting pods before queues
build, since a pod starts in about a minute. A *bursty* 2-state Markov-modulated Poisson
process whose prompt lengths shift mid-trace (1k-token prompts, then 2k-token ones)
changes the work per request, so a queue-depth target tuned for one half is wrong for the
other, while a latency SLO stays right.

Every trace is seeded and deterministic; sizes use their own generators, independent of the
arrival stream, as :mod:`splitserve_planner.workload` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from splitserve_planner.workload import Arrivals, LengthDist, Request

TRACE_KINDS = ("steady", "diurnal", "bursty-shift")


@dataclass(frozen=True, kw_only=True)
class TraceShape:
    """Sizes common to the three traces."""

    mean_rate: float
    """Requests/s averaged over the trace (the diurnal and bursty traces vary around it)."""
    duration_seconds: float
    prompt_tokens: LengthDist = LengthDist(kind="lognormal", mean=1024, sigma=0.6, max_tokens=16384)
    output_tokens: LengthDist = LengthDist(kind="lognormal", mean=256, sigma=0.6, max_tokens=4096)
    shifted_prompt_tokens: LengthDist = LengthDist(kind="lognormal", mean=2048, sigma=0.5, max_tokens=16384)
    """Prompt lengths of the bursty trace's second half."""
    diurnal_trough: float = 0.25
    """Diurnal rate at the start and end, as a fraction of its peak."""
    burst_factor: float = 2.0
    burst_seconds: float = 300.0
    """Mean dwell in each MMPP state: longer than a pod's start, so scaling can follow a burst."""

    def __post_init__(self) -> None:
        if not (self.mean_rate > 0 and self.duration_seconds > 0):
            raise ValueError("a trace needs a rate > 0 and a duration > 0")
        if not 0 < self.diurnal_trough <= 1:
            raise ValueError("the diurnal trough must be in (0, 1]")


def steady(shape: TraceShape, *, seed: int) -> list[Request]:
    """Poisson at the mean rate."""
    times = Arrivals(rate_per_second=shape.mean_rate).times(
        np.random.default_rng(seed), duration_seconds=shape.duration_seconds
    )
    return _requests(times, shape, seed=seed, prompt_for=lambda _t: shape.prompt_tokens)


def diurnal_rate(shape: TraceShape, at_seconds: float) -> float:
    """Rate at ``at_seconds``: trough → peak → trough on half a sine, mean ``mean_rate``."""
    trough = shape.diurnal_trough
    # mean of trough + (1 - trough)·sin(πt/T) over [0, T] is trough + (1 - trough)·2/π
    peak = shape.mean_rate / (trough + (1 - trough) * 2 / math.pi)
    return peak * (trough + (1 - trough) * math.sin(math.pi * at_seconds / shape.duration_seconds))


def diurnal(shape: TraceShape, *, seed: int) -> list[Request]:
    """Non-homogeneous Poisson on :func:`diurnal_rate`, by thinning a Poisson stream at the peak."""
    rng = np.random.default_rng(seed)
    peak = diurnal_rate(shape, shape.duration_seconds / 2)
    candidates = Arrivals(rate_per_second=peak).times(rng, duration_seconds=shape.duration_seconds)
    keep = rng.random(len(candidates)) * peak < np.asarray([diurnal_rate(shape, float(t)) for t in candidates])
    return _requests(candidates[keep], shape, seed=seed, prompt_for=lambda _t: shape.prompt_tokens)


def bursty_shift(shape: TraceShape, *, seed: int) -> list[Request]:
    """2-state MMPP (high state ``burst_factor`` × the low one, mean ``mean_rate``), with the
    prompt lengths switching to ``shifted_prompt_tokens`` at half the trace."""
    arrivals = Arrivals(
        rate_per_second=shape.mean_rate,
        kind="bursty",
        burst_factor=shape.burst_factor,
        burst_seconds=shape.burst_seconds,
    )
    times = arrivals.times(np.random.default_rng(seed), duration_seconds=shape.duration_seconds)
    shift = _shift_at(shape)
    return _requests(
        times, shape, seed=seed, prompt_for=lambda t: shape.prompt_tokens if t < shift else shape.shifted_prompt_tokens
    )


def _shift_at(shape: TraceShape) -> float:
    return shape.duration_seconds / 2


TRACES: dict[str, Callable[..., list[Request]]] = {"steady": steady, "diurnal": diurnal, "bursty-shift": bursty_shift}


def shift_seconds(kind: str, shape: TraceShape) -> float | None:
    """When the trace's prompt lengths shift (None: they do not)."""
    return _shift_at(shape) if kind == "bursty-shift" else None


def make_trace(kind: str, shape: TraceShape, *, seed: int) -> list[Request]:
    """One of :data:`TRACE_KINDS`; ValueError names the known ones."""
    if kind not in TRACES:
        raise ValueError(f"unknown trace {kind!r}; choose one of: {', '.join(TRACE_KINDS)}")
    return TRACES[kind](shape, seed=seed)


def _requests(
    times: np.ndarray, shape: TraceShape, *, seed: int, prompt_for: Callable[[float], LengthDist]
) -> list[Request]:
    count = len(times)
    outputs = shape.output_tokens.sample(np.random.default_rng([seed, 2]), count=count)
    prompt_rng = np.random.default_rng([seed, 1])
    out: list[Request] = []
    for i, at in enumerate(times):
        prompt = int(prompt_for(float(at)).sample(prompt_rng, count=1)[0])
        out.append(Request(i, float(at), prompt, int(outputs[i])))
    return out
