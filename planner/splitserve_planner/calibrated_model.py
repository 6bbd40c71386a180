"""A :class:`~.perf_model.StepCost` from the SLO controller's fitted step coefficients.

Why: the operator calibrates each pool's linear step model from the pods' engine-step counters
(:class:`~splitserve_operator.autoscaler.slo.inputs.StepCoefficients`); the fleet simulator
prices steps through :class:`~.perf_model.StepCost`. This adapter lets the simulator run on
exactly the model the controller fitted, so that the simulator can be checked against the real
runtime with the calibrated model (``bench/sim_fidelity.py``) and a what-if can start from
what a live service measured.

The simulator describes a step by ``(num_tokens, num_seqs, num_attention_pairs, num_kv_tokens)``
(:mod:`.sim.engine`); the step model by the runtime's counters (prefill tokens, prefill pairs,
decode rows, decode context). The mapping is exact for pure decode steps (``num_seqs`` rows
over ``num_kv_tokens`` held tokens, ``num_kv_tokens + num_seqs`` pairs) and for prefill chunks
after no computed context. In a step with prefill chunks two things cannot be told apart from
the simulator's four numbers and are approximated:

* the sampled row of a prompt's last chunk is priced as a decode row rather than a prefill
  token (``num_seqs`` counts it; the runtime samples it, so it is not free either);
* the computed context before a continuing chunk (or a prefix-cache hit) is priced as decode
  context rather than as prefill pairs (``num_kv_tokens`` includes it).

Both are one row or a few per-token coefficients' worth per chunk: small against the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_operator.autoscaler.slo.inputs import StepCoefficients


@dataclass(frozen=True, kw_only=True)
class CalibratedStepCost:
    """Step times from fitted :class:`StepCoefficients` (a :class:`~.perf_model.StepCost`)."""

    coefficients: StepCoefficients
    kv_capacity_tokens: int
    """KV tokens one pod holds (the runtime's blocks × block size)."""
    kv_bytes_per_token: int
    """Whole model: what a prefill → decode transfer ships per token."""
    name: str = "calibrated"

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1 or self.kv_bytes_per_token < 1:
            raise ValueError("kv_capacity_tokens and kv_bytes_per_token must be >= 1")
        if any(v < 0 for v in self.coefficients.as_tuple()):
            raise ValueError(f"step coefficients must be >= 0, got {self.coefficients}")

    def step_seconds(self, *, num_tokens: int, num_seqs: int, num_attention_pairs: int, num_kv_tokens: int) -> float:
        c = self.coefficients
        rows = min(num_seqs, num_tokens)
        context = max(0, min(num_kv_tokens, num_attention_pairs - rows))
        prefill_pairs = max(0, num_attention_pairs - rows - context)
        return (
            c.step
            + c.prefill_token * (num_tokens - rows)
            + c.prefill_pair * prefill_pairs
            + c.decode_row * rows
            + c.decode_context * context
        )
