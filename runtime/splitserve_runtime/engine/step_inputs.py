"""A step's batch on the host and the tensors it becomes: rows, columns, attention metadata.

Why a module of its own: the runner (:mod:`.model_runner`), the decode graphs
(:mod:`.cuda_graphs`), the draft model (:mod:`.draft`) and the parallel ranks
(:mod:`.parallel`) all build model inputs the same way; with the rows here none of them
imports another to reach them (the runner and the graphs once imported each other).

Decode rows travel as columns (:class:`DecodeRows`: numpy arrays of token ids, positions and
block-table rows), so a step of hundreds of decodes builds its slot mapping, context lengths
and padded block tables with a few vectorised operations instead of Python work per sequence
and block. Prefill chunks (few per step, long) stay rows of lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from ..ops.interface import AttentionMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class CausalLM(Protocol):
    """What the runner needs from a model (the Llama model and the null model have it)."""

    def forward(
        self, *, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, md: AttentionMetadata
    ) -> torch.Tensor: ...

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
class DecodeRows:
    """Decode rows as columns: ``token_ids`` and ``positions`` (int64, one per row) and
    ``block_tables`` (int32 ``[rows, width]``, zero-padded). Sliced like a list of
    :class:`DecodeRow` (a pipeline's micro-batches); iterating yields :class:`DecodeRow`."""

    token_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    block_tables: npt.NDArray[np.int32]

    def __post_init__(self) -> None:
        n = len(self.positions)
        if len(self.token_ids) != n or self.block_tables.ndim != 2 or self.block_tables.shape[0] != n:
            raise ValueError("decode rows need one token id, position and block-table row each")

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index: slice) -> DecodeRows:
        return DecodeRows(
            token_ids=self.token_ids[index], positions=self.positions[index], block_tables=self.block_tables[index]
        )

    def __iter__(self) -> Iterator[DecodeRow]:
        for token_id, position, table in zip(
            self.token_ids.tolist(), self.positions.tolist(), self.block_tables.tolist(), strict=True
        ):
            yield DecodeRow(token_id=token_id, position=position, block_table=table)

    @classmethod
    def from_rows(cls, rows: Seq[DecodeRow]) -> DecodeRows:
        width = max((len(r.block_table) for r in rows), default=0)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            tables[i, : len(r.block_table)] = r.block_table
        return cls(
            token_ids=np.array([r.token_id for r in rows], dtype=np.int64),
            positions=np.array([r.position for r in rows], dtype=np.int64),
            block_tables=tables,
        )


@dataclass(slots=True, kw_only=True)
class StepRows:
    """One step's batch on the host: what :func:`build_step_inputs` turns into tensors (and
    what a tensor-parallel driver sends its ranks, so each builds the same inputs)."""

    prefills: list[PrefillRow]
    decodes: list[DecodeRow] | DecodeRows
    sample_prefill: list[int]

    def build(self, *, block_size: int, device: torch.device) -> StepInputs:
        return build_step_inputs(
            prefills=self.prefills,
            decodes=self.decodes,
            sample_prefill=self.sample_prefill,
            block_size=block_size,
            device=device,
        )


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    logits_indices: torch.Tensor
    """Rows of the hidden states whose logits are sampled, in :attr:`sample_seqs` order."""


def decode_slot_mapping(rows: DecodeRows, *, block_size: int, out: npt.NDArray[np.int64]) -> None:
    """Write each decode row's KV slot (``block * block_size + offset`` of its position) to ``out``."""
    positions = rows.positions
    blocks = rows.block_tables[np.arange(len(rows)), positions // block_size].astype(np.int64)
    np.add(blocks * block_size, positions % block_size, out=out)


def build_step_inputs(
    *,
    prefills: list[PrefillRow],
    decodes: Seq[DecodeRow] | DecodeRows,
    sample_prefill: list[int],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """Flatten rows into model inputs; ``sample_prefill[i]`` is how many trailing rows of
    chunk i are sampled: 0, 1 (a chunk that reaches the end of its sequence; ``True`` works),
    or ``1 + k`` for a decode verifying ``k`` speculative proposals. Every decode row is sampled.

    Every int64 input lands in one host buffer and every int32 one in another; the tensors are
    views of the two (two conversions, and two copies to the device, per step)."""
    dec = decodes if isinstance(decodes, DecodeRows) else DecodeRows.from_rows(decodes)
    num_prefills = len(prefills)
    num_decodes = len(dec)
    q_lens = [len(row.token_ids) for row in prefills]
    num_prefill_tokens = sum(q_lens)
    num_tokens = num_prefill_tokens + num_decodes
    num_sampled_prefill = sum(int(n) for n in sample_prefill)
    if len(sample_prefill) != num_prefills:
        raise ValueError(f"{len(sample_prefill)} sample counts for {num_prefills} prefill rows")
    num_logits = num_sampled_prefill + num_decodes
    prefill_width = max((len(r.block_table) for r in prefills), default=1)
    decode_width = dec.block_tables.shape[1] if num_decodes else 1

    # int64: input ids | positions | slot mapping | logits indices
    wide = np.empty(3 * num_tokens + num_logits, dtype=np.int64)
    ids, pos, slots, logits = (
        wide[:num_tokens],
        wide[num_tokens : 2 * num_tokens],
        wide[2 * num_tokens : 3 * num_tokens],
        wide[3 * num_tokens :],
    )
    # int32: cu_seqlens | prefill context lens | decode context lens | prefill tables | decode tables
    p_end = 2 * num_prefills + 1
    d_end = p_end + num_decodes
    pt_end = d_end + num_prefills * prefill_width
    narrow = np.empty(pt_end + num_decodes * decode_width, dtype=np.int32)
    cu_seqlens, prefill_ctx = narrow[: num_prefills + 1], narrow[num_prefills + 1 : p_end]
    decode_ctx = narrow[p_end:d_end]
    prefill_tables = narrow[d_end:pt_end].reshape(num_prefills, prefill_width)
    decode_tables = narrow[pt_end:].reshape(num_decodes, decode_width)

    cu_seqlens[0] = 0
    offset = logit = 0
    max_context = 0
    for i, (row, samples) in enumerate(zip(prefills, sample_prefill, strict=True)):
        n = q_lens[i]
        start = row.start_position
        end = offset + n
        ids[offset:end] = row.token_ids
        p = pos[offset:end]
        p[:] = np.arange(start, start + n)
        table = np.asarray(row.block_table, dtype=np.int64)
        slots[offset:end] = table[p // block_size] * block_size + p % block_size
        cu_seqlens[i + 1] = end
        prefill_ctx[i] = start + n
        max_context = max(max_context, start + n)
        k = int(samples)
        logits[logit : logit + k] = np.arange(end - k, end)
        logit += k
        prefill_tables[i, : len(row.block_table)] = row.block_table
        prefill_tables[i, len(row.block_table) :] = 0
        offset = end
    if num_decodes:
        d_pos = dec.positions
        ids[offset:] = dec.token_ids
        pos[offset:] = d_pos
        decode_slot_mapping(dec, block_size=block_size, out=slots[offset:])
        np.add(d_pos, 1, out=decode_ctx, casting="unsafe")
        logits[logit:] = np.arange(offset, offset + num_decodes)
        decode_tables[:] = dec.block_tables
    host_wide = torch.from_numpy(wide)
    host_narrow = torch.from_numpy(narrow)
    if device.type == "cuda":
        host_wide = host_wide.pin_memory().to(device, non_blocking=True)
        host_narrow = host_narrow.pin_memory().to(device, non_blocking=True)
    t_ids, t_pos = host_wide[:num_tokens], host_wide[num_tokens : 2 * num_tokens]
    t_slots, t_logits = host_wide[2 * num_tokens : 3 * num_tokens], host_wide[3 * num_tokens :]
    t_cu, t_pctx, t_dctx = (
        host_narrow[: num_prefills + 1],
        host_narrow[num_prefills + 1 : p_end],
        host_narrow[p_end:d_end],
    )
    t_ptab, t_dtab = host_narrow[d_end:pt_end], host_narrow[pt_end:]
    md = AttentionMetadata(
        slot_mapping=t_slots,
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        prefill_cu_seqlens_q=t_cu,
        prefill_context_lens=t_pctx,
        prefill_block_tables=t_ptab.view(num_prefills, prefill_width),
        prefill_max_q_len=max(q_lens, default=0),
        prefill_max_context_len=max_context,
        num_decodes=num_decodes,
        decode_context_lens=t_dctx,
        decode_block_tables=t_dtab.view(num_decodes, decode_width),
        decode_max_context_len=int(dec.positions.max()) + 1 if num_decodes else 0,
        block_size=block_size,
    )
    return StepInputs(input_ids=t_ids, positions=t_pos, md=md, logits_indices=t_logits)
