"""Turns a :class:`SchedulerOutput` into tensors, runs the model and samples.

The runner owns the model and the paged KV cache (per layer a ``(k_cache, v_cache)`` pair
of ``[num_blocks, block_size, num_kv_heads, head_dim]`` on the device). Inputs are built on
the host as flat Python lists (prefill chunks first, then decodes, as
:class:`~splitserve_runtime.ops.interface.AttentionMetadata` requires) and copied in one
go, pinned and non-blocking on CUDA, so the only host/device synchronisation per step is
reading the sampled token ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..ops.interface import AttentionMetadata
from .kv_budget import (
    KVCacheSpec,
    cpu_kv_budget_bytes,
    cuda_kv_budget_bytes,
    num_blocks_for_budget,
)
from .sampler import PendingSample, Sampler, SamplerOutput
from .scheduler import SchedulerOutput
from .sequence import Sequence

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class CausalLM(Protocol):
    """What the runner needs from a model (the Llama model and the null model have it)."""

    def forward(self, *, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: KVCaches, md: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True, kw_only=True)
class PrefillRow:
    token_ids: list[int]
    start_position: int
    block_table: list[int]


@dataclass(slots=True, kw_only=True)
class DecodeRow:
    token_id: int
    position: int
    block_table: list[int]


@dataclass(slots=True, kw_only=True)
class StepRows:
    """One step's batch as host lists: what :func:`build_step_inputs` turns into tensors (and
    what a tensor-parallel driver sends its ranks, so each builds the same inputs)."""

    prefills: list[PrefillRow]
    decodes: list[DecodeRow]
    sample_prefill: list[int]

    def build(self, *, block_size: int, device: torch.device) -> StepInputs:
        return build_step_inputs(prefills=self.prefills, decodes=self.decodes,
                                 sample_prefill=self.sample_prefill, block_size=block_size, device=device)


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    logits_indices: torch.Tensor
    """Rows of the hidden states whose logits are sampled, in :attr:`sample_seqs` order."""


def build_step_inputs(*, prefills: list[PrefillRow], decodes: list[DecodeRow],
                      sample_prefill: list[int], block_size: int,
                      device: torch.device) -> StepInputs:
    """Flatten rows into model inputs; ``sample_prefill[i]`` is how many trailing rows of
    chunk i are sampled: 0, 1 (a chunk that reaches the end of its sequence; ``True`` works),
    or ``1 + k`` for a decode verifying ``k`` speculative proposals. Every decode row is sampled."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    prefill_ctx: list[int] = []
    logits_idx: list[int] = []
    for row, samples in zip(prefills, sample_prefill, strict=True):
        n = len(row.token_ids)
        start = row.start_position
        bt = row.block_table
        input_ids.extend(row.token_ids)
        positions.extend(range(start, start + n))
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        cu_seqlens.append(cu_seqlens[-1] + n)
        prefill_ctx.append(start + n)
        logits_idx.extend(range(cu_seqlens[-1] - int(samples), cu_seqlens[-1]))
    num_prefill_tokens = cu_seqlens[-1]
    decode_ctx: list[int] = []
    for j, drow in enumerate(decodes):
        p = drow.position
        input_ids.append(drow.token_id)
        positions.append(p)
        slots.append(drow.block_table[p // block_size] * block_size + p % block_size)
        decode_ctx.append(p + 1)
        logits_idx.append(num_prefill_tokens + j)

    pin = device.type == "cuda"

    def to_dev(data: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=pin)
        return t.to(device, non_blocking=True) if pin else t

    def tables(rows: list[list[int]]) -> torch.Tensor:
        if not rows:
            return to_dev([[0]], torch.int32)[:0]
        width = max(len(r) for r in rows)
        flat: list[int] = []  # one flat list converts much faster than a nested one
        for r in rows:
            flat.extend(r)
            flat.extend([0] * (width - len(r)))
        return to_dev(flat, torch.int32).view(len(rows), width)

    md = AttentionMetadata(
        slot_mapping=to_dev(slots, torch.int64),
        num_prefills=len(prefills),
        num_prefill_tokens=num_prefill_tokens,
        prefill_cu_seqlens_q=to_dev(cu_seqlens, torch.int32),
        prefill_context_lens=to_dev(prefill_ctx, torch.int32),
        prefill_block_tables=tables([r.block_table for r in prefills]),
        prefill_max_q_len=max((len(r.token_ids) for r in prefills), default=0),
        prefill_max_context_len=max(prefill_ctx, default=0),
        num_decodes=len(decodes),
        decode_context_lens=to_dev(decode_ctx, torch.int32),
        decode_block_tables=tables([r.block_table for r in decodes]),
        decode_max_context_len=max(decode_ctx, default=0),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=to_dev(input_ids, torch.int64), positions=to_dev(positions, torch.int64),
        md=md, logits_indices=to_dev(logits_idx, torch.int64),
    )


def allocate_kv_caches(*, spec: KVCacheSpec, num_blocks: int, block_size: int,
                       device: torch.device) -> KVCaches:
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    # Zeroed, not empty: padded block-table entries point at block 0 and must not hold NaN.
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device),
         torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]


def measure_num_kv_blocks(*, model: CausalLM, spec: KVCacheSpec, device: torch.device,
                          block_size: int, kv_memory_fraction: float,
                          max_num_batched_tokens: int, max_num_seqs: int,
                          max_model_len: int, extra_bytes_per_block: int = 0) -> int:
    """The KV pool size for this device (see :mod:`.kv_budget`); ``extra_bytes_per_block``:
    another model's KV laid over the same blocks (a speculative draft model)."""
    max_useful = max_num_seqs * -(-max_model_len // block_size) + 1
    if device.type != "cuda":
        budget = cpu_kv_budget_bytes(kv_memory_fraction=kv_memory_fraction)
        return num_blocks_for_budget(budget_bytes=budget, spec=spec, block_size=block_size,
                                     max_useful_blocks=max_useful, extra_bytes_per_block=extra_bytes_per_block)
    num_tokens = min(max_num_batched_tokens, max_model_len)
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    caches = allocate_kv_caches(spec=spec, num_blocks=num_blocks, block_size=block_size, device=device)
    inputs = build_step_inputs(
        prefills=[PrefillRow(token_ids=[0] * num_tokens, start_position=0,
                             block_table=list(range(num_blocks)))],
        decodes=[], sample_prefill=[1], block_size=block_size, device=device)
    with torch.inference_mode():
        hidden = model.forward(input_ids=inputs.input_ids, positions=inputs.positions,
                               kv_caches=caches, md=inputs.md)
        if getattr(model, "has_head", True):  # a pipeline stage before the last has no LM head
            model.compute_logits(hidden[:1].expand(min(max_num_seqs, num_tokens), -1).contiguous())
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    cache_bytes = spec.bytes_per_block(block_size=block_size) * num_blocks
    del caches, inputs, hidden
    torch.cuda.empty_cache()
    activation_peak = max(peak - cache_bytes, 0)
    budget = cuda_kv_budget_bytes(device=device, kv_memory_fraction=kv_memory_fraction,
                                  activation_peak_bytes=activation_peak)
    log.info("KV budget: %.2f GiB (activation peak %.2f GiB)", budget / 2**30, activation_peak / 2**30)
    return num_blocks_for_budget(budget_bytes=budget, spec=spec, block_size=block_size,
                                 max_useful_blocks=max_useful, extra_bytes_per_block=extra_bytes_per_block)


@dataclass(frozen=True, kw_only=True)
class LaunchedStep:
    """A step queued on the device: its sampled sequences and their pending tokens."""

    sample_seqs: list[Sequence]
    pending: PendingSample


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler."""

    def __init__(self, *, model: CausalLM, spec: KVCacheSpec, device: torch.device,
                 block_size: int, num_blocks: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.eos_token_ids = sorted(eos_token_ids)
        self.spec = spec
        self.wire_spec = spec
        """The KV layout blocks travel in (read/write_block): this spec, or the whole model's
        heads when this runner holds a tensor-parallel shard."""
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(spec=spec, num_blocks=num_blocks,
                                            block_size=block_size, device=device)
        self.sampler = Sampler(device=device)

    def read_block(self, block_id: int) -> bytes:
        """Export hook: one block's K/V as bytes, ordered ``[layer][K, V][token][head][dim]``.

        Bytes are copied as they are (through ``uint8`` views), whatever the cache dtype: an
        fp8 block travels as its fp8 bytes, never re-encoded.
        """
        self._check_block_id(block_id)
        parts = torch.stack([
            torch.stack((k[block_id].view(torch.uint8), v[block_id].view(torch.uint8)))
            for k, v in self.kv_caches
        ])
        return parts.contiguous().cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | memoryview) -> None:
        """Import hook: fill one block from :meth:`read_block`'s byte layout."""
        self._check_block_id(block_id)
        k0 = self.kv_caches[0][0][block_id].view(torch.uint8)
        shape = (len(self.kv_caches), 2, *k0.shape)
        expected = self.spec.bytes_per_block(block_size=self.block_size)
        if len(data) != expected:
            raise ValueError(f"a KV block has {expected} bytes, got {len(data)}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        values = raw.view(shape).to(self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[block_id].view(torch.uint8).copy_(values[layer, 0])
            v[block_id].view(torch.uint8).copy_(values[layer, 1])

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside [0, {self.num_blocks})")

    def block_reader(self, block_ids: list[int]) -> Callable[[int], bytes]:
        """Export hook, called on the engine thread: ``reader(i)`` gives block ``block_ids[i]``
        in :meth:`read_block`'s layout, later and from any thread (blocks kept for export are
        not written meanwhile)."""
        ids = list(block_ids)
        return lambda index: self.read_block(ids[index])

    def step_rows(self, sched: SchedulerOutput) -> tuple[StepRows, list[Sequence]]:
        """The rows of ``sched`` and the sequence of every sampled row, in order (a sequence
        verifying ``k`` speculative proposals has ``1 + k`` consecutive rows)."""
        prefills: list[PrefillRow] = []
        sample_prefill: list[int] = []
        sample_seqs: list[Sequence] = []
        for chunk in sched.prefills:
            seq = chunk.seq
            start = chunk.start_position
            prefills.append(PrefillRow(
                token_ids=seq.token_ids[start:start + chunk.num_tokens], start_position=start,
                block_table=seq.block_table))
            samples = chunk.samples
            sample_prefill.append(int(samples))
            if samples:
                sample_seqs.append(seq)
        # decodes with proposals run as extend chunks after the prefills: their last token and
        # the proposals, every row sampled
        decodes: list[DecodeRow] = []
        plain: list[Sequence] = []
        for seq in sched.decodes:
            if seq.spec_token_ids:
                prefills.append(PrefillRow(token_ids=[seq.token_ids[-1], *seq.spec_token_ids],
                                           start_position=seq.num_tokens - 1, block_table=seq.block_table))
                sample_prefill.append(1 + len(seq.spec_token_ids))
                sample_seqs.extend([seq] * (1 + len(seq.spec_token_ids)))
            else:
                decodes.append(DecodeRow(token_id=seq.token_ids[-1], position=seq.num_tokens - 1,
                                         block_table=seq.block_table))
                plain.append(seq)
        sample_seqs.extend(plain)
        return StepRows(prefills=prefills, decodes=decodes, sample_prefill=sample_prefill), sample_seqs

    def prepare(self, sched: SchedulerOutput) -> tuple[StepInputs, list[Sequence]]:
        """Model inputs for ``sched`` and the sequence of every sampled row, in order."""
        rows, sample_seqs = self.step_rows(sched)
        return rows.build(block_size=self.block_size, device=self.device), sample_seqs

    def execute(self, sched: SchedulerOutput) -> tuple[list[Sequence], SamplerOutput]:
        """Run one step; returns the sampled sequences and their new tokens."""
        launched = self.launch(sched)
        return launched.sample_seqs, launched.pending.resolve()

    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queue one step's forward and sampling on the device without waiting for it.

        On CUDA the host is free until :meth:`LaunchedStep` ``.pending.resolve()``; on CPU
        the work is done by the time this returns.
        """
        rows, sample_seqs = self.step_rows(sched)
        self.before_forward(rows)
        with torch.inference_mode():
            logits = self.forward_logits(rows)
            if logits is None or not sample_seqs:
                return LaunchedStep(sample_seqs=[], pending=PendingSample(
                    token_ids=torch.empty(0, dtype=torch.long), params=[]))
            pending = self.sampler.launch(
                logits=logits, request_ids=[s.request_id for s in sample_seqs],
                params=[s.params for s in sample_seqs],
                banned_token_ids=self._banned_token_ids(sample_seqs))
        return LaunchedStep(sample_seqs=sample_seqs, pending=pending)

    def forward_logits(self, rows: StepRows) -> torch.Tensor | None:
        """Run the model on ``rows``; fp32 logits of the sampled rows (None when none is)."""
        inputs = rows.build(block_size=self.block_size, device=self.device)
        hidden = self.model.forward(input_ids=inputs.input_ids, positions=inputs.positions,
                                    kv_caches=self.kv_caches, md=inputs.md)
        if not inputs.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def before_forward(self, rows: StepRows) -> None:
        """Called with each step's rows before its forward (a tensor-parallel driver sends
        them to the other ranks here)."""

    def _banned_token_ids(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Stop/eos tokens of requests that have not reached ``min_tokens`` yet."""
        banned: list[list[int]] | None = None
        for i, seq in enumerate(seqs):
            params = seq.params
            if params.min_tokens > seq.num_output_tokens:
                if banned is None:
                    banned = [[] for _ in seqs]
                eos = [] if params.ignore_eos else self.eos_token_ids
                banned[i] = sorted(set(params.stop_token_ids) | set(eos))
        return banned
