"""Speculative decoding in the capacity model: fewer target forwards per output token, each a
little dearer.

With ``--speculative-method ngram`` the runtime proposes up to ``k`` tokens per decoding
sequence and verifies them together with the sequence's next token in one forward of
``k + 1`` rows (:mod:`splitserve_runtime.engine.speculative`). If each proposal is accepted
with probability ``a``, independently of the others (the i.i.d. approximation of Leviathan,
Kalman and Matias, *Fast Inference from Transformers via Speculative Decoding*, ICML 2023,
eq. 1), one forward emits on average

    E = 1 + a + a² + … + a^k = (1 − a^(k+1)) / (1 − a)

tokens per sequence (the accepted prefix plus the target's own token after it). ``a`` here is
the per-position acceptance that reproduces the measured tokens per forward
(``bench/speculative.py`` reports it as ``a_fit``), not accepted / proposed.

The verification forward is priced by the same :class:`~.perf_model.StepCost` as any step:
``batch · (k + 1)`` new tokens, each sampled (the LM head runs on every row), attending over
the sequence's context plus the rows before it. On the roofline it is weight-bound at small
batch, so it costs about one decode step, and it reads the KV cache once for ``E`` tokens; its
GEMM compute grows with ``(k + 1) · batch`` and takes over at large batch. Hence the runtime's
rule, modelled here too: no speculation in a step with more than ``max_num_seqs`` decoding
sequences.

Two latencies follow, and they differ:

- the **time per output token** (mean inter-token latency, TPOT) is ``forward / E``;
- the **gap** a client sees between streamed chunks is a whole forward: tokens accepted in one
  forward arrive together (the runtime's ITL histogram records ``E − 1`` gaps of ~0 and one of
  a forward per forward), so a per-token p99 ITL is the verification forward, slightly *above*
  a plain decode step. Speculation shortens requests and raises a pod's tokens/s while the
  batch is small; it does not lower p99 ITL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from splitserve_contract import ServeArgs

from .perf_model import StepCost, decode_step_seconds, max_decode_batch

METHODS: Final = ("none", "ngram")
"""Methods priced here (a draft model's own forwards are not: ``draft`` is refused)."""
_SERVE: Final = ServeArgs()
DEFAULT_NUM_TOKENS: Final = _SERVE.num_speculative_tokens
DEFAULT_MAX_NUM_SEQS: Final = _SERVE.speculative_max_num_seqs
MAX_NUM_TOKENS: Final = 16
DEFAULT_ACCEPTANCE: Final = 0.18
"""Per-position acceptance of n-gram proposals on open-ended chat text (stories,
explanations): ``a_fit`` for k = 4 measured by ``bench/speculative.py`` on SmolLM2-135M-Instruct
(docs/speculative-decoding.md). Output that repeats its prompt (code edits, quoting,
extraction) accepts far more; pass the workload's own value with ``--spec-acceptance``."""


def expected_tokens_per_forward(*, acceptance: float, num_tokens: int) -> float:
    """``(1 − a^(k+1)) / (1 − a)``: tokens one verification forward emits per sequence."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if acceptance == 1.0:
        return float(num_tokens + 1)
    return (1.0 - acceptance ** (num_tokens + 1)) / (1.0 - acceptance)


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """``spec.scheduling.speculative`` plus the acceptance the workload is expected to reach."""

    method: str = "none"
    num_tokens: int = DEFAULT_NUM_TOKENS
    acceptance: float = DEFAULT_ACCEPTANCE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not priced by the planner; choose {' or '.join(METHODS)}"
            )
        if not 1 <= self.num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_NUM_TOKENS}], got {self.num_tokens}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"--spec-acceptance must be in [0, 1], got {self.acceptance}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--speculative-max-num-seqs must be >= 1, got {self.max_num_seqs}")
        tokens = expected_tokens_per_forward(acceptance=self.acceptance, num_tokens=self.num_tokens)
        object.__setattr__(self, "_tokens_per_forward", tokens)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def tokens_per_forward(self) -> float:
        """Expected tokens per sequence per verification forward (1.0 when off)."""
        return float(self.__dict__["_tokens_per_forward"]) if self.enabled else 1.0

    def applies(self, num_decoding: int) -> bool:
        """The runtime's rule: speculate in a step with at most ``max_num_seqs`` decoding sequences."""
        return self.enabled and 0 < num_decoding <= self.max_num_seqs

    @property
    def label(self) -> str:
        if not self.enabled:
            return "no speculation"
        return (
            f"speculation {self.method} k={self.num_tokens}, acceptance {self.acceptance:g} "
            f"({self.tokens_per_forward:.2f} tokens/forward) at <= {self.max_num_seqs} decoding sequences"
        )


NO_SPECULATION: Final = Speculation()


def verify_step_seconds(model: StepCost, *, batch_size: int, num_context_tokens: int, num_tokens: int) -> float:
    """One verification forward: ``batch_size`` sequences holding ``num_context_tokens`` in
    total, each running its last token and ``num_tokens`` proposals (all rows sampled)."""
    rows = batch_size * (num_tokens + 1)
    pairs = (num_tokens + 1) * num_context_tokens + batch_size * (num_tokens + 1) * (num_tokens + 2) // 2
    return model.step_seconds(
        num_tokens=rows, num_seqs=rows, num_attention_pairs=pairs, num_kv_tokens=num_context_tokens
    )


def decode_forward_seconds(
    model: StepCost, *, batch_size: int, num_context_tokens: int, speculation: Speculation = NO_SPECULATION
) -> float:
    """One decode-only forward of ``batch_size`` sequences: a verification forward where the
    rule lets the batch speculate, a plain decode step otherwise. Also the gap between
    streamed chunks."""
    if speculation.applies(batch_size):
        return verify_step_seconds(
            model, batch_size=batch_size, num_context_tokens=num_context_tokens, num_tokens=speculation.num_tokens
        )
    return decode_step_seconds(model, batch_size=batch_size, num_context_tokens=num_context_tokens)


def decode_seconds_per_token(
    model: StepCost, *, batch_size: int, num_context_tokens: int, speculation: Speculation = NO_SPECULATION
) -> float:
    """Mean time per output token of each sequence in a decode-only batch (TPOT)."""
    forward = decode_forward_seconds(
        model, batch_size=batch_size, num_context_tokens=num_context_tokens, speculation=speculation
    )
    return forward / speculation.tokens_per_forward if speculation.applies(batch_size) else forward


@dataclass(frozen=True, kw_only=True)
class DecodeCapacity:
    batch: int
    """Decoding sequences per pod at the best rate (0: none meets the ITL SLO)."""
    tokens_per_second: float
    speculating: bool


def decode_capacity(
    model: StepCost,
    *,
    itl_seconds: float,
    mean_context_tokens: float,
    max_num_seqs: int,
    speculation: Speculation = NO_SPECULATION,
) -> DecodeCapacity:
    """The decode batch with the most output tokens/s among those whose forward (the gap a
    client sees) stays within ``itl_seconds`` and whose KV fits.

    Without speculation that is the largest such batch. With it, a batch at or below the
    rule's limit runs verification forwards (``E`` tokens per sequence each, a slightly longer
    gap) and a larger one plain decode steps, so the rate is not monotone in the batch: every
    batch is priced and the best kept."""
    if not speculation.enabled:
        batch = max_decode_batch(
            model, itl_seconds=itl_seconds, mean_context_tokens=mean_context_tokens, max_num_seqs=max_num_seqs
        )
        if not batch:
            return DecodeCapacity(batch=0, tokens_per_second=0.0, speculating=False)
        step = decode_step_seconds(model, batch_size=batch, num_context_tokens=int(batch * mean_context_tokens))
        return DecodeCapacity(batch=batch, tokens_per_second=batch / step, speculating=False)
    kv_limit = int(model.kv_capacity_tokens // max(mean_context_tokens, 1.0))
    best = DecodeCapacity(batch=0, tokens_per_second=0.0, speculating=False)
    for batch in range(1, min(max_num_seqs, kv_limit) + 1):
        ctx = int(math.ceil(batch * mean_context_tokens))
        forward = decode_forward_seconds(model, batch_size=batch, num_context_tokens=ctx, speculation=speculation)
        speculating = speculation.applies(batch)
        if forward > itl_seconds:
            if speculating:
                continue  # a plain step of a larger batch may still fit
            break  # plain decode steps only grow with the batch
        rate = batch * (speculation.tokens_per_forward if speculating else 1.0) / forward
        if rate >= best.tokens_per_second:
            best = DecodeCapacity(batch=batch, tokens_per_second=rate, speculating=speculating)
    return best
