"""The state of one request as it moves through the scheduler.

A :class:`Sequence` is the prompt plus the tokens generated so far. The scheduler only needs
two counters: ``num_tokens`` (all tokens) and ``num_computed_tokens`` (tokens whose K/V is
in the cache). A step computes ``num_tokens - num_computed_tokens`` tokens (or a chunk of
them); when it reaches the end, the model's last row samples the next token. Prefill,
chunked prefill, decode and recompute after preemption are therefore the same operation.

With asynchronous scheduling (:mod:`.llm_engine`) a step is scheduled while the previous one
still runs: a token sampled by a step in flight is counted in ``num_pending_tokens`` (its
value is not known yet; the model reads it on the device), and ``num_computed_tokens``
already includes the positions the step in flight computes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, kw_only=True, slots=True)
class Sequence:
    """One request. Identity-compared (``eq=False``): two requests never compare equal."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time_s: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of this sequence's full blocks, computed lazily by the block manager."""
    num_registered_blocks: int = 0
    """Leading blocks of ``block_table`` whose hash is in the prefix cache index."""
    num_preemptions: int = 0
    was_admitted: bool = False
    finish_reason: str | None = None
    spec_token_ids: tuple[int, ...] = ()
    """Speculative proposals verified in the current step (empty: a plain decode). A tuple:
    every plain decode shares the one empty tuple, so the scheduler's per-decode test of it
    reads no object of the sequence's own."""
    num_spec_accepted: int = 0
    """How many of :attr:`spec_token_ids` the target accepted (set after the step's forward)."""
    num_draft_computed: int = 0
    """Leading positions whose draft-model K/V is valid (``--speculative-method draft``)."""
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    num_pending_tokens: int = 0
    """Tokens sampled by a step still in flight, not in :attr:`token_ids` yet (0 or 1)."""
    block_row: int = -1
    """This sequence's row in the block manager's :class:`~.block_tables.BlockTables`."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
