"""The roofline as the SLO controller's prior: :class:`StepCoefficients` fitted to a perf model.

Why a fit and not the roofline's own constants: the controller's step model is *linear* in five
coefficients (:mod:`splitserve_operator.autoscaler.slo.inputs`), while the roofline takes maxima
(GEMMs vs reading the weights, attention FLOPs vs reading the KV cache). The prior that
``splitserve plan --slo`` writes into ``spec.autoscaling.slo.prior`` is the linear model closest
to the planner's model over the steps a pod actually runs — prefill chunks up to the token
budget with and without cached context, decode batches up to ``max_num_seqs`` over short and
long contexts, and mixes — in *relative* error, so a 6 ms decode step counts as much as a 200 ms
prefill. Coefficients are non-negative (more work never makes a step cheaper), as the online
fit constrains them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitserve_operator.autoscaler.slo.inputs import (
    COEFFICIENT_NAMES,
    StepCoefficients,
    StepSample,
)

from .perf_model import StepCost, prefill_attention_pairs

PRIOR_KEYS: dict[str, str] = {
    "step": "step",
    "prefill_token": "prefillToken",
    "prefill_pair": "prefillPair",
    "decode_row": "decodeRow",
    "decode_context": "decodeContext",
}
"""``spec.autoscaling.slo.prior`` keys (camelCase) of each coefficient."""


@dataclass(frozen=True, kw_only=True)
class PriorFit:
    coefficients: StepCoefficients
    relative_rms_error: float
    """RMS of (linear − perf model) / perf model over the representative steps."""
    max_relative_error: float
    num_steps: int


def representative_steps(*, max_batched_tokens: int, max_num_seqs: int, kv_capacity_tokens: int) -> list[StepSample]:
    """One engine step each (``steps = 1``, ``seconds`` left 0): the grid the prior is fitted on."""
    out: list[StepSample] = []
    chunks = sorted({c for c in (64, 256, 512, 1024, 2048, 4096, 8192, max_batched_tokens) if c <= max_batched_tokens})
    for take in chunks:
        for computed in (0, 1024, 4096):
            if computed + take > kv_capacity_tokens:
                continue
            out.append(
                StepSample(
                    steps=1,
                    seconds=0.0,
                    prefill_tokens=take,
                    prefill_attention_pairs=prefill_attention_pairs(num_new_tokens=take, num_computed_tokens=computed),
                    decode_rows=0,
                    decode_context_tokens=0,
                )
            )
    batches = sorted({b for b in (1, 4, 16, 32, 64, 128, 256, max_num_seqs) if b <= max_num_seqs})
    for rows in batches:
        for context in (256, 1024, 2048, 4096):
            if rows * (context + 1) > kv_capacity_tokens:
                continue
            out.append(
                StepSample(
                    steps=1,
                    seconds=0.0,
                    prefill_tokens=0,
                    prefill_attention_pairs=0,
                    decode_rows=rows,
                    decode_context_tokens=rows * context,
                )
            )
            take = min(512, max_batched_tokens - rows)
            if take > 0 and rows * (context + 1) + take <= kv_capacity_tokens:  # a mixed step: decodes + one chunk
                out.append(
                    StepSample(
                        steps=1,
                        seconds=0.0,
                        prefill_tokens=take,
                        prefill_attention_pairs=prefill_attention_pairs(num_new_tokens=take, num_computed_tokens=0),
                        decode_rows=rows,
                        decode_context_tokens=rows * context,
                    )
                )
    return out


def step_seconds(perf: StepCost, sample: StepSample) -> float:
    """The perf model's time for one representative step (the engine prices a step this way)."""
    rows = int(sample.decode_rows)
    context = int(sample.decode_context_tokens)
    tokens = int(sample.prefill_tokens) + rows
    seqs = rows + (1 if sample.prefill_tokens else 0)
    return perf.step_seconds(
        num_tokens=tokens,
        num_seqs=max(seqs, 1),
        num_attention_pairs=int(sample.prefill_attention_pairs) + context + rows,
        num_kv_tokens=context + (0 if not sample.prefill_tokens else _computed(sample)),
    )


def _computed(sample: StepSample) -> int:
    """Cached context of a prefill chunk, recovered from its pairs (``take·computed + take(take+1)/2``)."""
    take = int(sample.prefill_tokens)
    return max(0, (int(sample.prefill_attention_pairs) - take * (take + 1) // 2) // max(take, 1))


def fit_prior(perf: StepCost, *, max_batched_tokens: int, max_num_seqs: int) -> PriorFit:
    """Non-negative least squares in relative error over :func:`representative_steps`."""
    steps = representative_steps(
        max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs, kv_capacity_tokens=perf.kv_capacity_tokens
    )
    x = np.asarray([s.features() for s in steps], dtype=float)
    y = np.asarray([step_seconds(perf, s) for s in steps])
    a = x / y[:, None]  # relative error: divide each row by its target
    b = np.ones(len(y))
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns to O(1): pairs are ~1e7, steps 1
    a = a / scale
    active = list(range(len(COEFFICIENT_NAMES)))
    theta = np.zeros(len(COEFFICIENT_NAMES))
    while active:  # drop the most negative coefficient until none is negative
        solution, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (solution >= 0).all():
            theta[:] = 0.0
            theta[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    theta = theta / scale
    relative = x @ theta / y - 1.0
    return PriorFit(
        coefficients=StepCoefficients.from_tuple([float(v) for v in theta]),
        relative_rms_error=float(np.sqrt(np.mean(relative**2))),
        max_relative_error=float(np.abs(relative).max()),
        num_steps=len(steps),
    )


def prior_manifest(coefficients: StepCoefficients) -> dict[str, float]:
    """``spec.autoscaling.slo.prior``: camelCase keys, seconds per unit (4 significant digits)."""
    return {
        PRIOR_KEYS[name]: float(f"{value:.4g}")
        for name, value in zip(COEFFICIENT_NAMES, coefficients.as_tuple(), strict=True)
    }
