"""Messages from the driver (rank 0) to the other ranks, and the KV block layouts they move.

Each message is one pickled object broadcast over the host-side gloo group: a step's rows (each
rank builds the same inputs from them and runs its part of the forward), a request to read KV
blocks (every rank sends its layers' and heads' part, rank 0 assembles the whole-model
layout), KV blocks to write (every rank keeps its part), the KV handoff's messages (export:
every rank snapshots its part of a request's blocks for its own KV endpoint; drop: forget it;
pull: every decode rank pulls its part from the prefill ranks, see :mod:`.kv_slices`), a ping
(the driver's keepalive while idle: a worker waits for the next message in a collective that
would otherwise time out, and a ping tells the driver at once when a rank's connection is
gone), or stop. The whole-model layout is the single-process runner's
``[layer][K, V][token][head][dim]``, so pools with different tensor- and pipeline-parallel
sizes exchange the same bytes.

ReadBlocks and WriteBlocks (the whole model through rank 0) serve the in-process engine API
(``block_reader``/``write_block``); the serving handoff moves each rank's slice directly.
"""

from __future__ import annotations

import dataclasses

import torch

from ...model.pipeline import PipelineStage
from ...model.tensor_parallel import TensorParallelLayout
from ...transfer import KVSlice
from ..step_inputs import KVCaches, StepRows
from .group import ParallelGroup
from .kv_slices import PullOrder


@dataclasses.dataclass(frozen=True)
class Step:
    rows: StepRows


@dataclasses.dataclass(frozen=True)
class ReadBlocks:
    block_ids: list[int]


@dataclasses.dataclass(frozen=True)
class WriteBlocks:
    blocks: dict[int, bytes]
    """Block id → the whole-model layout's bytes."""


@dataclasses.dataclass(frozen=True)
class ExportBlocks:
    """Snapshot this rank's part of ``block_ids`` (a finished prefill of ``num_tokens``) and
    serve it as ``request_id`` on this rank's KV endpoint; every rank answers with its endpoint
    (or an error) in an all-gather."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class DropExports:
    """The driver released these exports: free their snapshots."""

    request_ids: list[str]


@dataclasses.dataclass(frozen=True)
class PullBlocks:
    """Pull this rank's part of ``order`` into its cache; the rank reports through the store."""

    order: PullOrder


@dataclasses.dataclass(frozen=True)
class Ping:
    pass


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


Message = Step | ReadBlocks | WriteBlocks | ExportBlocks | DropExports | PullBlocks | Ping | Stop


@dataclasses.dataclass(frozen=True)
class KVPart:
    """Which part of the whole-model KV cache a rank holds: layers of its stage, heads of its
    tensor-parallel rank."""

    layout: TensorParallelLayout
    """Heads (the same split on every stage)."""
    stage: PipelineStage | None
    """Layers (None: all)."""

    def layers(self, stage: int) -> tuple[int, int]:
        if self.stage is None:
            return 0, self.layout.config.num_hidden_layers
        return self.stage.layer_range(stage)

    def slice(self, *, stage: int, tp_rank: int) -> KVSlice:
        """The global layers and KV heads held by (``stage``, ``tp_rank``)."""
        first, last = self.layers(stage)
        start = self.layout.kv_head_start(tp_rank)
        return KVSlice(first, last, start, start + self.layout.num_kv_heads_of(tp_rank))

    @property
    def num_layers(self) -> int:
        return self.stage.config.num_hidden_layers if self.stage is not None else self.layout.config.num_hidden_layers


def send(group: ParallelGroup, message: Message) -> None:
    """Driver side: broadcast ``message`` to every rank."""
    group.broadcast_object(message)


def receive(group: ParallelGroup) -> Message:
    """Worker side: the driver's next message (blocks until it comes)."""
    message = group.broadcast_object()
    if not isinstance(message, Message):
        raise RuntimeError(f"parallel driver sent {type(message).__name__}, not a message")
    return message


def local_blocks(caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """This rank's part of ``block_ids`` as bytes on the host: ``[local layer, 2, n, token, local head, dim bytes]``."""
    index = torch.tensor(block_ids, dtype=torch.long, device=caches[0][0].device)
    return torch.stack(
        [
            torch.stack((k.index_select(0, index).view(torch.uint8), v.index_select(0, index).view(torch.uint8)))
            for k, v in caches
        ]
    ).cpu()


def gather_blocks(group: ParallelGroup, part: KVPart, caches: KVCaches, block_ids: list[int]) -> list[bytes] | None:
    """Every rank: send this rank's part of ``block_ids``; rank 0 gets each block in the
    whole-model layout (None elsewhere)."""
    mine = local_blocks(caches, block_ids)
    parts: list[torch.Tensor] = group.all_gather_object(mine)
    if not group.is_driver:
        return None
    layout = part.layout
    num_heads = layout.config.num_key_value_heads
    whole = mine.new_empty((part.num_layers, *mine.shape[1:4], num_heads, mine.shape[-1]))
    for stage in range(group.num_stages):
        start, end = part.layers(stage)
        for head in range(num_heads):
            owner = layout.kv_head_owner(head)
            local = head - layout.kv_head_start(owner)
            whole[start:end, :, :, :, head] = parts[stage * group.tp_size + owner][:, :, :, :, local]
    return [whole[:, :, i].contiguous().numpy().tobytes() for i in range(len(block_ids))]


def write_blocks(group: ParallelGroup, part: KVPart, caches: KVCaches, blocks: dict[int, bytes]) -> None:
    """Keep this rank's part of each whole-model-layout block."""
    k0 = caches[0][0]
    block_size, local_heads = k0.shape[1], k0.shape[2]
    head_bytes = k0[0, 0, 0].view(torch.uint8).numel()
    start = part.layout.kv_head_start(group.tp_rank)
    first, last = part.layers(group.stage)
    shape = (part.num_layers, 2, block_size, part.layout.config.num_key_value_heads, head_bytes)
    for block_id, data in blocks.items():
        values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(shape)
        values = values[first:last, :, :, start : start + local_heads].to(k0.device)
        for layer, (k, v) in enumerate(caches):
            k[block_id].view(torch.uint8).copy_(values[layer, 0])
            v[block_id].view(torch.uint8).copy_(values[layer, 1])
