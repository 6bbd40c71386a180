"""One step through the pipeline stages, in micro-batches.

The schedule: every rank splits the step's rows into the same micro-batches (contiguous runs
of rows, balanced by token count; at most ``MICRO_BATCHES_PER_STAGE × stages`` of them) and
runs them in order, GPipe-style within the step: stage ``s`` computes micro-batch ``m`` while
stage ``s + 1`` computes ``m - 1``, the sends are asynchronous, and the last stage sends each
micro-batch's logits to the driver as soon as it has them. A step with ``M`` micro-batches
over ``S`` stages takes about ``(M + S - 1)`` micro-batch times instead of ``M × S``: the
bubble is ``(S - 1) / (M + S - 1)``, 20% for 2 stages and 4 micro-batches.

Why within a step rather than several steps in flight (vLLM's virtual engines): the scheduler,
the block manager, prefix caching, chunked prefill, preemption and speculation stay exactly
as they are, one batch per step, and every token is the unsplit model's. The cost is that a
step with a single sequence has no second micro-batch to overlap (one decode stream uses one
stage at a time), which is the case pipeline parallelism serves worst anyway.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...ops.interface import AttentionMetadata
from ..step_inputs import KVCaches, StepRows
from .group import ParallelGroup


class StageModel(Protocol):
    """A pipeline stage's model (:class:`~splitserve_runtime.model.llama.LlamaForCausalLM`)."""

    def forward(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        md: AttentionMetadata,
        carried: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


MICRO_BATCHES_PER_STAGE = 2


def split_rows(rows: StepRows, *, parts: int) -> list[StepRows]:
    """``rows`` cut into at most ``parts`` contiguous runs of rows of similar token counts
    (prefill rows keep coming before decode rows in each run, as the model requires)."""
    sizes = [len(r.token_ids) for r in rows.prefills] + [1] * len(rows.decodes)
    total = sum(sizes)
    parts = max(1, min(parts, len(sizes)))
    bounds: list[int] = []
    done = 0
    for index, size in enumerate(sizes):
        done += size
        if len(bounds) < parts - 1 and done >= total * (len(bounds) + 1) / parts and index < len(sizes) - 1:
            bounds.append(index + 1)
    edges = [0, *bounds, len(sizes)]
    num_prefills = len(rows.prefills)
    out = []
    for start, end in zip(edges, edges[1:], strict=False):
        p_start, p_end = min(start, num_prefills), min(end, num_prefills)
        d_start, d_end = max(start - num_prefills, 0), max(end - num_prefills, 0)
        out.append(
            StepRows(
                prefills=rows.prefills[p_start:p_end],
                decodes=rows.decodes[d_start:d_end],
                sample_prefill=rows.sample_prefill[p_start:p_end],
            )
        )
    return out


def run_step(
    group: ParallelGroup,
    *,
    model: StageModel,
    caches: KVCaches,
    rows: StepRows,
    block_size: int,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """This rank's part of one step; on the driver the logits of every sampled row, in row
    order (None when no row is sampled); None elsewhere."""
    device = group.device
    batches = split_rows(rows, parts=MICRO_BATCHES_PER_STAGE * group.num_stages)
    pending: list[tuple[object, torch.Tensor]] = []  # async sends and the tensors they read
    sampled: list[int] = []
    for tag, batch in enumerate(batches):
        inputs = batch.build(block_size=block_size, device=device)
        sampled.append(int(inputs.logits_indices.numel()))
        carried = None
        if not group.is_first_stage:
            carried = torch.empty((2, inputs.input_ids.numel(), hidden_size), dtype=dtype, device=device)
            group.prev_link.recv([carried], 0, tag).wait()
        out = model.forward(
            input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=caches, md=inputs.md, carried=carried
        )
        if not group.is_last_stage:
            out = out.contiguous()
            pending.append((group.next_link.send([out], 1, tag), out))
        elif sampled[-1]:
            logits = model.compute_logits(out[inputs.logits_indices]).contiguous()
            if group.tp_rank == 0:
                pending.append((group.logits_link.send([logits], 0, tag), logits))
    result = None
    if group.rank == 0 and any(sampled):
        parts = []
        for tag, count in enumerate(sampled):
            if count:
                part = torch.empty((count, vocab_size), dtype=torch.float32, device=device)
                group.logits_link.recv([part], 1, tag).wait()
                parts.append(part)
        result = torch.cat(parts)
    for work, _ in pending:
        work.wait()  # type: ignore[attr-defined]
    return result
