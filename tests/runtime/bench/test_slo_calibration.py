"""The SLO autoscaler's step-model fit calibrates on the real runtime from a prior 2x too fast.

The real engine (tiny Llama on CPU, in-process, one torch thread) serves closed-loop traffic at
six load levels, from one long decode to 32 concurrent ones and 1.5k-token prompts, each
for a window of 0.35 s, round-robin. Each window's increase of the engine-step counters
(``splitserve_engine_*_total``: what the operator reads from Prometheus) is one
:class:`~splitserve_operator.autoscaler.slo.inputs.StepSample`, handed to the fit as the
operator does: its decode-only part and the rest (``StepSample.split``).

* "true" coefficients: the (non-negative, otherwise unregularised) least-squares fit on every
  window, training and held out;
* the operator's :class:`~splitserve_operator.autoscaler.slo.step_fit.StepFit`, started from the
  prior ``true.scaled(0.5)`` (every step predicted 2x too fast), is fed the training windows one
  by one; its step-time prediction on held-out windows (two per round, each level twice) must
  come within :data:`BOUND` of the true fit's (median over the windows) and stay there: the
  number of windows ``K`` this took, and the traffic wall time behind them, are printed;
* with calibration disabled (the prior alone) the same check fails (50 %); against the
  measured busy time the calibrated fit errs at most :data:`MEASURED_MARGIN` more than the true
  fit, and less than the prior alone.

Why the bound is on the deviation from the true fit and not on the measurement: the CPU is
shared with other work, and the wall time of a 0.35 s window moves with the share of the CPU
this process gets (the true fit itself missed the held-out measurements by a median 10-25 %
from run to run here). No speed is asserted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers import load_bench

from splitserve_contract import ServeArgs
from splitserve_operator.autoscaler.slo.inputs import StepCoefficients, StepSample
from splitserve_operator.autoscaler.slo.step_fit import StepFit
from splitserve_runtime.engine.llm_engine import LLMEngine

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # ~13 s of real traffic, ~20 s in all

BOUND = 0.20
"""Median deviation of held-out windows' predicted busy time from the true fit's (the prior's: 50 %)."""
MEASURED_MARGIN = 0.10
"""Against the measured busy time the calibrated fit may err this much more than the true fit
(whose own error here was 10-25 %: wall time on a shared CPU; the prior alone's 45-57 %)."""
WINDOW_SECONDS = 0.35
ROUNDS = 6
"""Each round runs every level once; round ``r`` holds out the windows of levels ``r`` and
``r + 3`` (so held-out windows cover every level twice and the whole run: the machine's speed
drifts with other load)."""


BENCH = load_bench("sim_fidelity")
"""The closed-loop traffic at six levels and the counter → step-sample mapping are the fidelity bench's."""
LEVELS = BENCH.CALIBRATION_LEVELS


def _least_squares(samples: Sequence[StepSample]) -> StepCoefficients:
    """Non-negative least squares on absolute seconds (drop the most negative, refit)."""
    a = np.array([s.features() for s in samples], dtype=float)
    b = np.array([s.seconds for s in samples])
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)  # conditioning only
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sub, *_ = np.linalg.lstsq(a[:, active] / scale[active], b, rcond=None)
        if (sub >= 0).all():
            coef[active] = sub / scale[active]
            break
        active.pop(int(np.argmin(sub)))
    return StepCoefficients.from_tuple([float(c) for c in coef])


def prediction_error(theta: StepCoefficients, samples: Sequence[StepSample]) -> float:
    """Median absolute percentage error of the windows' measured busy seconds."""
    return float(np.median([abs(BENCH.predicted_seconds(theta, s) - s.seconds) / s.seconds for s in samples]))


def deviation(theta: StepCoefficients, true: StepCoefficients, samples: Sequence[StepSample]) -> float:
    """Median absolute percentage deviation of the windows' predicted busy seconds from the true fit's."""
    predict = BENCH.predicted_seconds
    return float(np.median([abs(predict(theta, s) - predict(true, s)) / predict(true, s) for s in samples]))


def _whole(points: Sequence[StepSample]) -> StepSample:
    """A window's points added back together (its counter increase)."""
    steps, tokens, pairs, rows, context = (sum(v) for v in zip(*(p.features() for p in points), strict=True))
    return StepSample(
        steps=steps,
        seconds=sum(p.seconds for p in points),
        prefill_tokens=tokens,
        prefill_attention_pairs=pairs,
        decode_rows=rows,
        decode_context_tokens=context,
    )


Window = list[StepSample]
"""One window's points (its decode-only part and the rest, or the whole window)."""


@pytest.fixture(scope="module")
def windows(tiny_llama_dir: Path) -> tuple[list[Window], list[StepSample], float]:
    torch.set_num_threads(1)
    engine = LLMEngine.from_args(
        ServeArgs(
            model=str(tiny_llama_dir),
            device="cpu",
            block_size=16,
            num_kv_blocks=2048,
            max_model_len=2048,
            max_num_batched_tokens=1024,
            max_num_seqs=64,
        )
    )
    traffic = BENCH.ClosedLoopTraffic(engine, seed=0)
    traffic.window(LEVELS[1], seconds=0.2)  # warm-up (allocator, first-call paths), not measured
    rounds: list[list[Window]] = []
    started = time.monotonic()
    for _ in range(ROUNDS):
        rounds.append([traffic.window(level, seconds=WINDOW_SECONDS) for level in LEVELS])
    wall = time.monotonic() - started
    for rid in list(engine._requests):  # noqa: SLF001 (the test's own engine)
        engine.abort_request(rid)
    held = {(r, (r + shift) % len(LEVELS)) for r in range(ROUNDS) for shift in (0, 3)}
    train = [s for r, windows in enumerate(rounds) for i, s in enumerate(windows) if (r, i) not in held]
    held_out = [_whole(rounds[r][i]) for r, i in sorted(held)]
    assert all(s.steps > 0 for s in held_out) and all(p.steps > 0 for w in train for p in w)
    return train, held_out, wall


def test_windows_span_the_step_model(windows: tuple[list[Window], list[StepSample], float]) -> None:
    """The load levels exercise every coefficient: prefill-heavy, decode-heavy and mixed windows."""
    train, _, _ = windows
    features = np.array([_whole(w).features() for w in train])
    assert (features > 0).any(axis=0).all()
    decode_share = features[:, 3] / np.maximum(features[:, 1] + features[:, 3], 1)
    assert decode_share.min() < 0.2 and decode_share.max() > 0.6  # (with leftovers of the level before)
    assert np.linalg.matrix_rank(features / features.max(axis=0)) == features.shape[1]


def test_fit_from_a_2x_fast_prior_converges_and_the_prior_alone_does_not(
    windows: tuple[list[Window], list[StepSample], float],
) -> None:
    train, held_out, wall = windows
    true = _least_squares([p for w in train for p in w] + held_out)
    prior = true.scaled(0.5)
    true_error = prediction_error(true, held_out)
    prior_error = prediction_error(prior, held_out)
    fit = StepFit.fresh(prior=prior)
    deviations: list[float] = []
    errors: list[float] = []
    traffic_seconds = 0.0
    for window in train:
        traffic_seconds += WINDOW_SECONDS
        fit.add(window, now_seconds=traffic_seconds)
        theta = fit.coefficients
        assert theta is not None
        deviations.append(deviation(theta, true, held_out))
        errors.append(prediction_error(theta, held_out))
    within = [d <= BOUND for d in deviations]
    k = next((i + 1 for i in range(len(within)) if all(within[i:])), None)
    print(
        f"\n{len(train)} training + {len(held_out)} held-out windows of {WINDOW_SECONDS} s "
        f"({wall:.1f} s of traffic). Held-out step time, median deviation from the true fit's: prior alone "
        f"(calibration disabled) {deviation(prior, true, held_out):.1%}, calibrated after each window "
        f"{[round(d, 3) for d in deviations]}: within {BOUND:.0%} from K={k} windows "
        f"({(k or 0) * WINDOW_SECONDS:.1f} s of traffic). Median error against the measured busy time: "
        f"true fit {true_error:.1%}, prior alone {prior_error:.1%}, calibrated {errors[-1]:.1%}. "
        f"Confidence {fit.confidence:.2f}; true {true}; fitted {fit.coefficients}"
    )
    assert deviation(prior, true, held_out) > BOUND  # 50 %: without calibration the bound fails
    assert k is not None, f"the fit never stayed within {BOUND:.0%} of the true step time: {deviations}"
    # and it predicts the measurements about as well as the best linear model does, better than the prior
    assert errors[-1] <= true_error + MEASURED_MARGIN, (errors[-1], true_error)
    assert errors[-1] < prior_error, (errors[-1], prior_error)
    assert 0.0 < fit.confidence <= 1.0  # (noisy wall time keeps it lowish: it penalises the fit's error)
