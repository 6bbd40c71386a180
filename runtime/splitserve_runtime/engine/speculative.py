"""Speculative decoding: propose a few tokens per decoding sequence, verify them all in one
target forward, keep the longest prefix the target agrees with.

Decode is memory-bound: a forward over ``1 + k`` tokens of a sequence reads the weights once,
like a forward over one, so every accepted proposal is a token for (nearly) nothing.

**Proposers**: :class:`NgramProposer` looks the sequence's last n tokens up earlier in the
same sequence (prompt and output) and proposes what followed (prompt-lookup decoding; no extra
model); :class:`~.draft.DraftModel` runs a smaller model with the same vocabulary and proposes
its greedy continuation. Each is a deterministic function of the tokens so far, which makes
verification simple and exact (below); an EAGLE-style head would fit the same way.

**Verification** (:meth:`SpeculativeDecoder.verify`): the sequence's last sampled token and
its ``k`` proposals are run as one extend chunk; the sampler draws a token from the target's
distribution at each of the ``k + 1`` rows, exactly as it would without speculation (the
request's temperature, filters and seed). Proposal ``i`` is accepted while the
target's token at row ``i`` equals it; the emitted tokens are the target's tokens of rows
``0..a`` (``a`` accepted proposals, plus the target's own token after them). For a
deterministic proposal this *is* speculative sampling's rejection rule: the proposal ``d`` is
kept with probability ``p(d)`` and, when rejected, the emitted token is a draw from ``p``
conditioned on ``≠ d`` — the normalised residual ``max(0, p - q)`` for a one-hot ``q``. So
greedy output is token for token the non-speculative one, and sampled output has exactly
the target's distribution.

**Seeds** (coupled rejection sampling): a seeded request's uniform is keyed on the output
position it samples (:mod:`.seed_stream`), not on a count of rows: row ``i`` of a sequence with
``n`` output tokens draws with position ``n + i``'s uniform, and the draws of the rows after
the first rejection are given back (:meth:`~.sampler.Sampler.unwind_draws`), to be drawn again
at the next step. The acceptance test is that sampling draw itself, there is no second uniform:
row ``i``'s context is the tokens so far and proposals ``0..i-1``, which, wherever row ``i``'s
token is emitted, were accepted, i.e. are the tokens emitted before it; so every emitted token
is the one plain sampling draws at its position, from the same context with the same uniform.
A proposal decides how many positions a step computes, never which token a position gets: the
same seeded request gives the same tokens with speculation on or off (so whatever the load
that switches it off) and whatever shares its steps. This holds for n-gram and draft-model
proposals alike, because a draft proposes its greedy token, a deterministic function of the
tokens so far; a draft that sampled its proposals would need the general rule (accept with
probability ``min(1, p/q)``, its own uniform, residual draws), whose tokens do not equal plain
sampling's. The limit is arithmetic, as for greedy ties: verification rows are computed in an
extend chunk and a batch's shape can change float summation order, so a uniform within
rounding of a token's cumulative-probability boundary may pick its neighbour.

**KV rollback**: the rejected proposals' K/V slots sit past ``num_computed_tokens`` and are
overwritten by later steps; blocks allocated only for them are returned at once
(:meth:`~.block_manager.BlockManager.trim`), and only full blocks of accepted tokens are ever
hashed into the prefix cache, so block usage and prefix hashes equal the non-speculative run's.

**When not to speculate** (:meth:`SpeculativeConfig.proposals_for`): a request that opted
out, one below its ``min_tokens`` (its stop tokens are banned per row), the last token a
request may produce, and any step with more than ``max_num_seqs`` decoding sequences: the
verification rows then cost real compute (the forward stops being weight-bound), so the step
gets slower for everyone while the proposals gain little.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Final, Protocol

import numpy as np

from .draft import DraftModel
from .outputs import TokenLogprob
from .sampler import Sampler
from .scheduler import SchedulerOutput
from .sequence import Sequence

METHODS: Final = ("none", "ngram", "draft")
DEFAULT_NUM_TOKENS: Final = 4
DEFAULT_MAX_NUM_SEQS: Final = 16
NGRAM_MAX: Final = 4
NGRAM_MIN: Final = 1
NGRAM_WINDOW: Final = 4096
"""Only the last this-many tokens are searched (bounded time per proposal)."""


class Proposer(Protocol):
    def propose(self, token_ids: list[int], *, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` proposed continuations of ``token_ids`` (may be empty)."""


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt-lookup proposals: the longest suffix n-gram (``max_n`` down to ``min_n``)
    found earlier in the sequence, most recent occurrence first; what followed it."""

    max_n: int = NGRAM_MAX
    min_n: int = NGRAM_MIN
    window: int = NGRAM_WINDOW

    def propose(self, token_ids: list[int], *, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids[-self.window :], dtype=np.int64)
        total = tokens.shape[0]
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n :]
            # windows starting at 0 .. total - n - 1: every occurrence except the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in tokens[start : start + max_tokens]]
        return []


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-method``, ``--num-speculative-tokens``, ``--speculative-max-num-seqs``."""

    method: str = "none"
    num_tokens: int = DEFAULT_NUM_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose {', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"speculative_max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def proposer(self) -> Proposer | None:
        """The model-free proposer (``ngram``); None for ``none`` and ``draft`` (a model, run
        by the engine after scheduling: :mod:`.draft`)."""
        return NgramProposer() if self.method == "ngram" else None


Emitted = tuple[Sequence, int, TokenLogprob | None]
"""A token a verified step emits: its sequence, the token id and its logprob."""


class SpeculativeDecoder:
    """One engine's speculation: proposals before scheduling, the draft's tokens after it,
    verification after sampling; and the ``spec_decode_*`` counters of
    :class:`~.stats.EngineStats`. Nothing happens with the method ``none``."""

    def __init__(
        self, config: SpeculativeConfig, *, draft: DraftModel | None, max_model_len: int, sampler: Sampler
    ) -> None:
        self.config = config
        self.proposer = config.proposer()
        self.draft = draft
        self._max_model_len = max_model_len
        self._sampler = sampler
        self.proposed_total = 0
        self.accepted_total = 0
        self.accepted_by_position = [0] * config.num_tokens
        self.proposed_by_position = [0] * config.num_tokens

    def propose(self, running: Iterable[Sequence]) -> list[Sequence]:
        """Speculative proposals for this step's decodes (among ``running``), when few enough
        sequences decode for the verification rows to be nearly free."""
        config = self.config
        if not config.enabled:
            return []
        decoding = [seq for seq in running if seq.num_uncomputed_tokens == 1]
        if len(decoding) > config.max_num_seqs:
            return []
        proposed: list[Sequence] = []
        for seq in decoding:
            params = seq.params
            # at most max_tokens - 1 more tokens after this step's own, and room in the context
            room = min(
                config.num_tokens,
                params.max_tokens - seq.num_output_tokens - 1,
                self._max_model_len - seq.num_tokens - 1,
            )
            if room <= 0 or not params.speculative or params.min_tokens > seq.num_output_tokens:
                continue
            drafts = (
                self.proposer.propose(seq.token_ids, max_tokens=room) if self.proposer is not None else [-1] * room
            )  # draft model: slots reserved now, tokens after scheduling
            if drafts:
                seq.spec_token_ids = tuple(drafts)
                proposed.append(seq)
        return proposed

    def keep_scheduled(self, proposed: list[Sequence], sched: SchedulerOutput) -> list[Sequence]:
        """The proposed sequences ``sched`` decodes (the others drop their proposals: preempted
        or not scheduled, nothing to verify); a draft model fills the slots they reserved."""
        scheduled = {id(seq) for seq in sched.decodes}
        for seq in proposed:
            if id(seq) not in scheduled:
                seq.spec_token_ids = ()
        kept = [seq for seq in proposed if seq.spec_token_ids]
        if self.draft is not None and kept:
            lengths = [len(seq.spec_token_ids) for seq in kept]
            for seq, tokens in zip(kept, self.draft.propose(kept, lengths), strict=True):
                seq.spec_token_ids = tuple(tokens)
        return kept

    def verify(
        self, sample_seqs: list[Sequence], token_ids: list[int], logprobs: list[TokenLogprob | None]
    ) -> list[Emitted]:
        """The tokens each sampled sequence emits this step: one per plain row; for a sequence
        with ``k`` proposals (``1 + k`` consecutive rows) the target's tokens up to and
        including the first that differs from a proposal (module docstring)."""
        emitted: list[Emitted] = []
        row = 0
        while row < len(sample_seqs):
            seq = sample_seqs[row]
            drafts = seq.spec_token_ids
            if not drafts:
                emitted.append((seq, token_ids[row], logprobs[row]))
                row += 1
                continue
            accepted = 0
            while accepted < len(drafts) and token_ids[row + accepted] == drafts[accepted]:
                accepted += 1
            seq.num_spec_accepted = accepted
            # rows past the first rejection drew positions the next step draws again
            self._sampler.unwind_draws(seq.request_id, len(drafts) - accepted)
            if self.draft is not None:
                self.draft.after_verification(seq, num_proposed=len(drafts), num_accepted=accepted)
            self.proposed_total += len(drafts)
            self.accepted_total += accepted
            for position in range(len(drafts)):
                self.proposed_by_position[position] += 1
            for position in range(accepted):
                self.accepted_by_position[position] += 1
            emitted.extend((seq, token_ids[row + i], logprobs[row + i]) for i in range(accepted + 1))
            row += 1 + len(drafts)
        return emitted
