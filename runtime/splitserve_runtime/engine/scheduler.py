"""Continuous batching with a per-step token budget, chunked prefill and recompute preemption.

Every step hands out at most ``max_num_batched_tokens`` tokens, in this order:

1. **decodes** — running sequences with exactly one uncomputed token (the last sampled one),
   each with its speculative proposals when the budget and free blocks allow (they never
   cause a preemption; see :mod:`.speculative`);
2. **continuing prefill chunks** of running sequences, oldest first;
3. **admission** of waiting sequences in FCFS order (stopping at the first that does not fit,
   so nobody is overtaken), after a prefix-cache lookup that marks cached tokens computed.

With chunked prefill a prompt takes ``min(remaining, budget)`` tokens; without it a prompt
is scheduled whole or not at all. When a running sequence cannot get a KV block, the
*newest* running sequence not yet scheduled this step is preempted by recompute: its blocks
are freed (their hashes stay cached, so it usually re-hits its own prefix) and it goes back
to the front of the waiting queue. No admission happens in a step that preempted.

Blocks the scheduler does not own are never taken: KV pinned for a decode pod's pull
(``keep_kv``, held until RELEASE or its lease) and blocks reserved for a KV import. A
sequence left without a victim is therefore preempted too and waits for them to be released;
only a sequence that needs more blocks than the whole pool holds is ended (``length``).
Counting "am I alone?" instead would end a prompt whose remaining chunk waits for exported
KV to be pulled: on a prefill pod under KV pressure that lost the request (``export_failed``).

The output (:class:`SchedulerOutput`) lists prefill chunks first, then decodes — the order
of :class:`~splitserve_runtime.ops.interface.AttentionMetadata`.

Two ways to finish a step. Synchronously, :meth:`Scheduler.on_step_done` advances the computed
counters once the step has run. With asynchronous scheduling (the engine schedules step n+1
while step n runs), :meth:`Scheduler.on_step_launched` advances them as soon as the step is
launched and counts each sampled token as pending (``Sequence.num_pending_tokens``), so the
next :meth:`Scheduler.schedule` already sees the sequence as a decode; a decode whose pending
token reaches ``max_tokens`` is not scheduled again (it finishes when the token arrives). The
engine appends the tokens and indexes the full blocks when the step's results arrive.

A decode step is the hot path (hundreds of sequences, every few milliseconds): its loop does
no per-sequence call unless a sequence needs a new block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .outputs import FINISH_ABORT, FINISH_LENGTH
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, kw_only=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at position ``start_position``."""

    seq: Sequence
    start_position: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence (its last row is sampled)."""
        seq = self.seq
        return self.start_position + self.num_tokens == len(seq.token_ids) + seq.num_pending_tokens


@dataclass(kw_only=True)
class SchedulerOutput:
    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    """Sequences the scheduler itself ended (a lone sequence the KV cache cannot hold)."""
    num_speculative: int = 0
    """Decodes scheduled with speculative proposals."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + sum(1 + len(s.spec_token_ids) for s in self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass
class SchedulerCounters:
    prefix_cache_queried_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    preemptions_total: int = 0


class Scheduler:
    """Owns the waiting queue and running list; the only writer of the block manager."""

    def __init__(self, *, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self._by_id: dict[str, Sequence] = {}

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        seq.status = SequenceStatus.WAITING
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Start a sequence whose KV is already in its blocks (an imported prefill)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        if not seq.block_table or seq.num_computed_tokens >= seq.num_tokens:
            raise ValueError("an imported sequence needs held blocks and an uncomputed last token")
        seq.status = SequenceStatus.RUNNING
        seq.was_admitted = True
        self._by_id[seq.request_id] = seq
        self.running.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks; None if unknown."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, reason=FINISH_ABORT)
        return seq

    def finish(self, seq: Sequence, *, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_prompt_tokens_waiting(self) -> int:
        """Tokens the waiting sequences still need computed, prefix-cache hits excluded."""
        total = 0
        for seq in self.waiting:
            hits = self.block_manager.lookup_prefix(seq)
            total += seq.num_tokens - len(hits) * self.block_manager.block_size
        return total

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        block_size = self.block_manager.block_size
        running_status = SequenceStatus.RUNNING
        decodes = out.decodes
        chunked: list[Sequence] = []  # running sequences with more than one uncomputed token

        # 1. decodes, oldest first (with their speculative proposals when budget and free
        #    blocks allow; speculation never preempts anybody)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running_status:
                continue
            computed = seq.num_computed_tokens
            pending = seq.num_pending_tokens
            uncomputed = len(seq.token_ids) + pending - computed
            if uncomputed != 1:
                if uncomputed > 1:
                    chunked.append(seq)
                continue
            if pending and len(seq.token_ids) + pending - seq.num_prompt_tokens >= seq.params.max_tokens:
                continue  # the token in flight is its last: it finishes when the token arrives
            if seq.spec_token_ids:
                if not self._reserve_speculative(seq, budget=budget, out=out):
                    continue
                budget -= 1 + len(seq.spec_token_ids)
                continue
            # the common case: room left in the last block, nothing to allocate
            if computed < len(seq.block_table) * block_size or self._reserve(seq=seq, num_new_tokens=1, out=out):
                decodes.append(seq)
                budget -= 1

        # 2. continuing prefill chunks, oldest first
        for seq in chunked:
            if budget == 0:
                break
            if seq.status is not running_status:  # preempted for a decode above
                continue
            num_uncomputed = seq.num_uncomputed_tokens
            num_new = min(num_uncomputed, budget)
            if not self.config.chunked_prefill and num_new < num_uncomputed:
                continue
            start = seq.num_computed_tokens
            if self._reserve(seq=seq, num_new_tokens=num_new, out=out):
                out.prefills.append(ScheduledChunk(seq=seq, start_position=start, num_tokens=num_new))
                budget -= num_new

        # 3. admission (FCFS), only if nobody was preempted this step
        if not out.preempted:
            budget = self._admit(budget=budget, out=out)
        return out

    def _reserve_speculative(self, seq: Sequence, *, budget: int, out: SchedulerOutput) -> bool:
        """Schedule a decode with proposals (dropping them when the budget or the free blocks
        do not allow them); False if ``seq`` itself had to be preempted."""
        if 1 + len(seq.spec_token_ids) > budget or not self.block_manager.allocate_slots(
            seq=seq, num_new_tokens=1 + len(seq.spec_token_ids)
        ):
            seq.spec_token_ids = ()
        if self._reserve(seq=seq, num_new_tokens=1, out=out):
            out.decodes.append(seq)
            out.num_speculative += bool(seq.spec_token_ids)
            return True
        seq.spec_token_ids = ()
        return False

    def _admit(self, *, budget: int, out: SchedulerOutput) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted while its last step runs: not before it ends
                break
            hits = bm.lookup_prefix(seq)
            num_cached = len(hits) * bm.block_size
            num_uncomputed = seq.num_tokens - num_cached
            num_new = min(num_uncomputed, budget)
            if not self.config.chunked_prefill and num_new < num_uncomputed:
                break
            if not bm.can_allocate(seq=seq, num_new_tokens=num_new, cached_block_ids=hits):
                break
            self.waiting.popleft()
            bm.take_cached_prefix(seq=seq, cached_block_ids=hits)
            if not bm.allocate_slots(seq=seq, num_new_tokens=num_new):
                raise RuntimeError("KV allocation failed after can_allocate succeeded")
            if not seq.was_admitted:
                seq.was_admitted = True
                seq.num_cached_tokens = num_cached
                self.counters.prefix_cache_queried_tokens_total += seq.num_tokens
                self.counters.prefix_cache_hit_tokens_total += num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(ScheduledChunk(seq=seq, start_position=num_cached, num_tokens=num_new))
            budget -= num_new
        return budget

    def _reserve(self, *, seq: Sequence, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate KV for ``seq``, preempting newer unscheduled sequences as needed.

        Returns False if ``seq`` itself had to be preempted (or finished, if the whole
        cache cannot hold it).
        """
        bm = self.block_manager
        while not bm.allocate_slots(seq=seq, num_new_tokens=num_new_tokens):
            victim = self._pick_victim(out)
            if victim is None or victim is seq:
                if bm.num_blocks_for(seq.num_computed_tokens + num_new_tokens) > bm.num_blocks:
                    # More than the whole pool: it can never fit. End it.
                    self.finish(seq, reason=FINISH_LENGTH)
                    out.finished.append(seq)
                else:
                    # The blocks it needs are held by sequences scheduled this step, or
                    # outside the scheduler (pinned exports, KV imports): wait for them.
                    self._preempt(seq, out=out)
                return False
            self._preempt(victim, out=out)
        return True

    def _pick_victim(self, out: SchedulerOutput) -> Sequence | None:
        """The newest running sequence not scheduled in ``out`` yet."""
        scheduled = {id(seq) for seq in out.decodes}
        scheduled.update(id(chunk.seq) for chunk in out.prefills)
        for seq in reversed(self.running):
            if id(seq) not in scheduled:
                return seq
        return None

    def _preempt(self, seq: Sequence, *, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.counters.preemptions_total += 1
        out.preempted.append(seq)

    # ------------------------------------------------------------------ after the step
    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance computed counters for what the model just ran and index full blocks."""
        bm = self.block_manager
        for chunk in out.prefills:
            if chunk.seq.is_finished:  # ended while the step ran (a stop string, overlapped)
                continue
            chunk.seq.num_computed_tokens = chunk.start_position + chunk.num_tokens
            bm.commit(chunk.seq)
        caching = bm.enable_prefix_caching
        block_size = bm.block_size
        finished = SequenceStatus.FINISHED
        for seq in out.decodes:
            if seq.status is finished:
                continue
            if seq.spec_token_ids:
                seq.num_computed_tokens += 1 + seq.num_spec_accepted
                # the rejected proposals' slots go back; the accepted tokens are appended after
                # this, so the engine commits their blocks then
                bm.trim(seq)
                seq.spec_token_ids = ()
                seq.num_spec_accepted = 0
                continue
            computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
            if caching and computed // block_size > seq.num_registered_blocks:
                bm.commit(seq)

    def on_step_launched(self, out: SchedulerOutput) -> None:
        """Asynchronous scheduling: count ``out`` as computed as soon as it is launched, and
        its sampled tokens as pending (see the module docstring). No speculation."""
        for chunk in out.prefills:
            seq = chunk.seq
            if chunk.samples:
                seq.num_pending_tokens += 1
            seq.num_computed_tokens = chunk.start_position + chunk.num_tokens
        for seq in out.decodes:
            if seq.spec_token_ids:
                raise RuntimeError("speculative decodes cannot be scheduled asynchronously")
            seq.num_computed_tokens += 1
            seq.num_pending_tokens += 1
