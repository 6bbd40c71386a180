"""Synthetic step-counter windows and SLO inputs for the SLO controller's unit tests."""

from __future__ import annotations

import random

from splitserve_operator.autoscaler.slo import (
    LoadObservation,
    PoolSloObservation,
    SloInputs,
    StepCoefficients,
    StepFit,
    StepSample,
)

TRUTH = StepCoefficients(step=0.012, prefill_token=6e-5, prefill_pair=2e-8, decode_row=3e-4, decode_context=1e-7)
"""A nonzero ground truth of the order of a small model on one GPU."""


def window(rng: random.Random, theta: StepCoefficients, *, noise: float = 0.03, role: str = "aggregated") -> StepSample:
    """One pod's 15 s window of counter deltas with a random mix of work, timed by ``theta``."""
    steps = rng.uniform(100, 1500)
    prefill = 0.0 if role == "decode" else steps * rng.uniform(0, 1000)
    pairs = prefill * rng.uniform(50, 5000)
    rows = 0.0 if role == "prefill" else steps * rng.uniform(0.5, 60)
    context = rows * rng.uniform(100, 6000)
    x = (steps, prefill, pairs, rows, context)
    seconds = sum(c * v for c, v in zip(theta.as_tuple(), x, strict=True)) * (1.0 + rng.gauss(0.0, noise))
    return StepSample(
        steps=steps,
        seconds=max(seconds, 1e-6),
        prefill_tokens=prefill,
        prefill_attention_pairs=pairs,
        decode_rows=rows,
        decode_context_tokens=context,
    )


def within(fitted: StepCoefficients | None, truth: StepCoefficients, tolerance: float) -> bool:
    if fitted is None:
        return False
    return all(abs(f - t) <= tolerance * t for f, t in zip(fitted.as_tuple(), truth.as_tuple(), strict=True))


def trained_fit(
    theta: StepCoefficients,
    *,
    role: str,
    prior: StepCoefficients | None = None,
    windows: int = 40,
    seed: int = 7,
    until: float = 0.0,
) -> StepFit:
    """A fit fed ``windows`` noisy windows timed by ``theta`` (ending at ``until`` seconds)."""
    rng = random.Random(seed)
    fit = StepFit.fresh(prior=prior)
    for i in range(windows):
        fit.add([window(rng, theta, noise=0.02, role=role)], now_seconds=until - (windows - 1 - i) * 15.0)
    return fit


def pool(
    role: str,
    *,
    current: int,
    ready: int | None = None,
    pending: int = 0,
    ttft: float | None = None,
    itl: float | None = None,
    waiting: float = 0.0,
    waiting_tokens: float = 0.0,
    kv_tokens: float = 0.0,
) -> PoolSloObservation:
    return PoolSloObservation(
        role=role,
        current_replicas=current,
        ready_replicas=current if ready is None else ready,
        pending_replicas=pending,
        step_samples=(),
        requests_waiting=waiting,
        prompt_tokens_waiting=waiting_tokens,
        requests_running=0.0,
        kv_cache_usage_ratio=0.0,
        kv_cache_tokens_per_replica=kv_tokens,
        ttft_p99_seconds=ttft,
        itl_p99_seconds=itl,
    )


def load(rate: float, *, prompt: float = 1000.0, output: float = 200.0, hit: float = 0.0) -> LoadObservation:
    return LoadObservation(
        window_seconds=15.0,
        request_rate=rate,
        prompt_tokens_mean=prompt,
        output_tokens_mean=output,
        prefix_hit_ratio=hit,
    )


def inputs(now: float, pools: dict[str, PoolSloObservation], rate: float | None, **shape: float) -> SloInputs:
    return SloInputs(now_seconds=now, pools=pools, load=None if rate is None else load(rate, **shape))


REFERENCE_STEPS: tuple[tuple[float, ...], ...] = (
    (1.0, 2048.0, 2048.0 * 2049.0 / 2.0, 0.0, 0.0),  # a full prefill chunk of a fresh prompt
    (1.0, 0.0, 0.0, 32.0, 32.0 * 2000.0),  # a decode step, batch 32 at 2000 tokens of context
    (1.0, 512.0, 512.0 * 1000.0, 16.0, 16.0 * 1500.0),  # a mixed step
)
"""Steps the controller's estimates are made of: what a calibrated model must predict."""


def predicts(fitted: StepCoefficients | None, truth: StepCoefficients, tolerance: float) -> bool:
    """Every reference step's predicted time within ``tolerance`` of the truth's."""
    if fitted is None:
        return False
    for x in REFERENCE_STEPS:
        want = sum(c * v for c, v in zip(truth.as_tuple(), x, strict=True))
        got = sum(c * v for c, v in zip(fitted.as_tuple(), x, strict=True))
        if abs(got - want) > tolerance * want:
            return False
    return True


def decode_window(
    theta: StepCoefficients, *, batch: float, steps: float = 500.0, context: float = 1100.0
) -> StepSample:
    """A decode pod's window of ``steps`` steps of ``batch`` rows each, timed by ``theta``."""
    rows = batch * steps
    x = (steps, 0.0, 0.0, rows, rows * context)
    return StepSample(
        steps=steps,
        seconds=sum(c * v for c, v in zip(theta.as_tuple(), x, strict=True)),
        prefill_tokens=0.0,
        prefill_attention_pairs=0.0,
        decode_rows=rows,
        decode_context_tokens=rows * context,
    )


def decode_fit(
    theta: StepCoefficients, *, batches: list[float], prior: StepCoefficients | None = None, until: float = 0.0
) -> StepFit:
    """A decode pool's fit from one window per batch size of ``batches`` (prompt lengths varying
    a little, as they do), ending at ``until`` seconds."""
    fit = StepFit.fresh(prior=prior)
    for i, batch in enumerate(batches):
        fit.add(
            [decode_window(theta, batch=batch, context=1100.0 + 20.0 * (i % 3))],
            now_seconds=until - (len(batches) - 1 - i) * 15.0,
        )
    return fit
