"""The driver's model runner: the single-process runner plus what the other ranks must see.

Before each forward it broadcasts the step's rows (the other ranks run their part of the
forward: the same one for tensor parallelism, the next stages for pipeline parallelism), and
it moves KV blocks in the whole-model layout: an export gathers the
blocks from every rank at once on the engine thread (the transfer thread then serves the
snapshot), and imported blocks written from the transfer thread are queued and sent to every
rank before the next forward, on the engine thread, so control messages never interleave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..kv_budget import KVCacheSpec
from ..model_runner import CausalLM, ModelRunner, StepRows
from . import control
from .group import ParallelGroup
from .launcher import Workers
from .worker import RankModel


class ParallelRunner(ModelRunner):
    """Rank 0's runner over its own part of the model; see the module docstring."""

    def __init__(self, *, model: CausalLM, spec: KVCacheSpec, device: torch.device, block_size: int,
                 num_blocks: int, eos_token_ids: frozenset[int] = frozenset(),
                 group: ParallelGroup, loaded: RankModel, workers: Workers) -> None:
        super().__init__(model=model, spec=spec, device=device, block_size=block_size,
                         num_blocks=num_blocks, eos_token_ids=eos_token_ids)
        self.group = group
        self.loaded = loaded
        self.part = loaded.part
        self.workers = workers
        self.wire_spec = KVCacheSpec(num_layers=self.part.num_layers,
                                     num_kv_heads=self.part.layout.config.num_key_value_heads,
                                     head_dim=spec.head_dim, dtype=spec.dtype)
        self._lock = threading.Lock()
        self._pending_writes: dict[int, bytes] = {}

    def before_forward(self, rows: StepRows) -> None:
        self._flush_writes()
        control.send(self.group, control.Step(rows=rows))

    def forward_logits(self, rows: StepRows) -> torch.Tensor | None:
        return self.loaded.forward_logits(self.group, rows=rows, caches=self.kv_caches, block_size=self.block_size)

    def block_reader(self, block_ids: list[int]) -> Callable[[int], bytes]:
        for block_id in block_ids:
            self._check_block_id(block_id)
        self._flush_writes()
        control.send(self.group, control.ReadBlocks(block_ids=list(block_ids)))
        blocks = control.gather_blocks(self.group, self.part, self.kv_caches, list(block_ids))
        assert blocks is not None  # the driver receives them
        return blocks.__getitem__

    def read_block(self, block_id: int) -> bytes:
        return self.block_reader([block_id])(0)

    def write_block(self, block_id: int, data: bytes | memoryview) -> None:
        """Queue one whole-model-layout block; every rank gets it before the next forward."""
        self._check_block_id(block_id)
        expected = self.wire_spec.bytes_per_block(block_size=self.block_size)
        if len(data) != expected:
            raise ValueError(f"a KV block has {expected} bytes, got {len(data)}")
        with self._lock:
            self._pending_writes[block_id] = bytes(data)

    def _flush_writes(self) -> None:
        with self._lock:
            blocks, self._pending_writes = self._pending_writes, {}
        if blocks:
            control.send(self.group, control.WriteBlocks(blocks=blocks))
            control.write_blocks(self.group, self.part, self.kv_caches, blocks)

    def close(self) -> None:
        """Tell the other ranks to stop and wait for them to exit."""
        control.send(self.group, control.Stop())
        self.workers.stop()
