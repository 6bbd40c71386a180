"""What one engine step computed, summed into the engine-step counters of the SLO autoscaler.

Why: the operator fits each pool's step-time model from the pods' own counters
(``splitserve_engine_*_total``, ``docs/architecture.md``, "Metrics"). The model is linear in
the step's work, so counters summed over many steps obey the same equation as one step and a
window of counter increases is an exact regression point; no per-step samples leave the pod.

Per step (:func:`step_work`, read from the :class:`~.scheduler.SchedulerOutput` before the
step runs, while ``num_computed_tokens`` still says where each row starts):

* **prefill tokens**: the new tokens of every prefill chunk (prompt tokens found in the prefix
  cache are not computed, so not counted; recompute after a preemption is, as it is computed);
* **prefill attention pairs**: per chunk of ``n`` new tokens after ``c`` computed ones
  (prefix-cached included) ``n·c + n(n+1)/2``, the causal (query, key) pairs;
* **decode rows**: the decoding sequences; with speculative decoding each verified
  proposal is one more row (a decode with ``k`` proposals is ``1 + k`` rows, as it is in the
  forward);
* **decode context tokens**: the tokens each decode row reads from the KV cache (the
  sequence's computed tokens; a verification row ``i`` also the ``i`` proposals before it),
  summed over the rows. The row's own token is not counted (it is one per row: the decode-row
  coefficient holds it), as the planner prices a decode (``splitserve_planner.perf_model``,
  ``decode_step_seconds``: ``num_kv_tokens`` = context held).

:class:`StepCounters` adds steps, their busy wall time and that work; the engine times each
:meth:`~.llm_engine.LLMEngine.step` call as a whole (scheduling, forward, sampling, output),
so idle time between steps is never counted.

It also keeps the same steps, seconds, decode rows and context tokens of the **decode-only**
steps (no prefill chunk) apart. On an aggregated pod under steady traffic, prefill and decode
work grow together from window to window, so windows of the totals alone cannot tell a
prefill token's cost from a decode row's (measured on the tiny Llama on CPU: the fit
over-priced a 256-512-token prefill step by 25 % with the window means right). The
decode-only part of a window and the rest (total minus decode-only) are two regression
points with different mixes, which separates them (``fetch_step_samples`` in the operator's
``autoscaler/signals.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter

from .scheduler import SchedulerOutput

_num_computed = attrgetter("num_computed_tokens")


@dataclass(frozen=True, slots=True)
class StepWork:
    """The work of one scheduled step (see the module docstring)."""

    prefill_tokens: int
    prefill_attention_pairs: int
    decode_rows: int
    decode_context_tokens: int


def step_work(sched: SchedulerOutput) -> StepWork:
    """The work of ``sched``; call it before the step's computed counters advance."""
    prefill_tokens = pairs = 0
    for chunk in sched.prefills:
        n, c = chunk.num_tokens, chunk.start_position
        prefill_tokens += n
        pairs += n * c + n * (n + 1) // 2
    decodes = sched.decodes
    if not sched.num_speculative:  # the hot path: one row per decode, summed without a Python loop
        return StepWork(
            prefill_tokens=prefill_tokens,
            prefill_attention_pairs=pairs,
            decode_rows=len(decodes),
            decode_context_tokens=sum(map(_num_computed, decodes)),
        )
    rows = context = 0
    for seq in decodes:
        k = len(seq.spec_token_ids)
        rows += 1 + k
        context += (1 + k) * seq.num_computed_tokens + k * (k + 1) // 2
    return StepWork(
        prefill_tokens=prefill_tokens, prefill_attention_pairs=pairs, decode_rows=rows, decode_context_tokens=context
    )


@dataclass(slots=True)
class StepCounters:
    """Running totals since the engine started (exported as counters)."""

    steps: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_attention_pairs: int = 0
    decode_rows: int = 0
    decode_context_tokens: int = 0
    decode_only_steps: int = 0
    """The decode-only part (module docstring): calls whose steps computed no prefill chunk."""
    decode_only_seconds: float = 0.0
    decode_only_rows: int = 0
    decode_only_context_tokens: int = 0

    def add(self, works: Iterable[StepWork], *, seconds: float) -> None:
        """``works``: the steps one ``LLMEngine.step`` call finished, in ``seconds`` of wall time
        (normally one; with asynchronous scheduling, a call may also wait out a dropped step)."""
        counted = rows = context = prefill = 0
        for work in works:
            counted += 1
            prefill += work.prefill_tokens
            rows += work.decode_rows
            context += work.decode_context_tokens
            self.prefill_attention_pairs += work.prefill_attention_pairs
        if not counted:
            return
        self.steps += counted
        self.seconds += seconds
        self.prefill_tokens += prefill
        self.decode_rows += rows
        self.decode_context_tokens += context
        if not prefill:
            self.decode_only_steps += counted
            self.decode_only_seconds += seconds
            self.decode_only_rows += rows
            self.decode_only_context_tokens += context
