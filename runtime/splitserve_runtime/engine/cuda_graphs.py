"""Pure-decode steps replayed from CUDA graphs, one graph per batch-size bucket (``--cuda-graphs``).

Why: a decode step of a small batch is launch-bound. The forward of a 32-layer model is
several hundred kernel launches, each costing Python, the Triton launcher and the driver a
few microseconds, while at batch 1 the kernels themselves only stream the weights once.
Replaying a captured graph submits the whole forward in one call.

What runs in a graph: the model's forward (hidden states) of a step in which every row is a
decode of one token. Prefill, chunked-prefill and mixed steps, speculative verification (its
rows are extend chunks) and batches above the largest bucket stay eager. The LM head and
sampling run eagerly on the real rows' hidden states.

How: a batch of ``n`` decodes runs in the graph of the smallest bucket ``>= n``
(:func:`decode_buckets`: 1, 2, 4, then every multiple of 8). Its inputs are copied into
static buffers (:class:`DecodeBuffers`) that every graph reads: one int64 and one int32
buffer sized for the largest bucket, of which bucket ``b`` uses the first elements, so a
step is two host-to-device copies. The ``b - n`` padded rows have slot -1 (both KV write
backends skip negative slots, so they write nothing), context length 1 and a block table of
zeros (they read one token of block 0, which is zero-initialised or holds some sequence's
finite K/V); their outputs are dropped, and no row of a decode forward reads another row.
The attention metadata of a bucket is fixed: its block tables are as wide as
``max_model_len`` needs and its ``decode_max_context_len`` is that width's capacity, so the
decode kernel's split count is chosen once, for the longest context (each sequence divides
its own context among the splits; empty splits drop out).

Graphs are captured largest bucket first into one shared memory pool, each after a warm-up
run (Triton compiles its kernels, cuBLAS picks its algorithms) on the capture stream.

The seam: a :class:`GraphBackend` turns a forward into a replay. :class:`CudaGraphBackend`
captures a real graph; :class:`EagerReplay` reruns the same forward on the same static
buffers and metadata, so the CPU tests prove that the padded static-buffer path gives the
normal path's tokens and writes no KV for padding, without ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from ..ops.interface import AttentionMetadata
from .step_inputs import CausalLM, DecodeRows, KVCaches, decode_slot_mapping

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4)
"""Buckets below the first multiple of :data:`BUCKET_STEP`."""
BUCKET_STEP = 8
"""Above :data:`SMALL_BUCKETS`, one bucket per multiple of this (at most 7 padded rows)."""
MAX_GRAPH_BATCH = 512
"""The default largest bucket: larger batches are compute-bound, launches cost them little,
and each bucket is one more capture at start-up."""


def decode_buckets(max_batch_size: int, *, cap: int = MAX_GRAPH_BATCH) -> tuple[int, ...]:
    """The default buckets for batches up to ``max_batch_size`` (at most ``cap``): 1, 2, 4,
    then every multiple of 8, the last one the first that holds ``min(max_batch_size, cap)``."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"the largest CUDA graph batch must be an integer >= 1, got {max_batch_size!r}")
    largest = min(max_batch_size, cap)
    sizes: list[int] = []
    candidate = 0
    while candidate < largest:
        small = [b for b in SMALL_BUCKETS if b > candidate]
        candidate = small[0] if small else (candidate // BUCKET_STEP + 1) * BUCKET_STEP
        sizes.append(candidate)
    return tuple(sizes)


def check_buckets(sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` as sorted buckets; a clear error for an empty list, a size below 1, a non-integer
    or a repeated size."""
    if not sizes:
        raise ValueError("CUDA graph batch sizes: at least one is needed")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"CUDA graph batch sizes must be integers >= 1, got {size!r}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"CUDA graph batch sizes repeat a size: {list(sizes)}")
    return tuple(sorted(sizes))


def bucket_for(num_decodes: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``num_decodes`` rows; None when there is none (no rows,
    or more than the largest bucket: the step runs eagerly)."""
    if num_decodes < 1:
        return None
    index = bisect.bisect_left(buckets, num_decodes)
    return buckets[index] if index < len(buckets) else None


class DecodeBuffers:
    """The static inputs every decode graph reads, sized for the largest bucket.

    ``wide`` (int64) holds, for bucket ``b``, input ids ``[0, b)``, positions ``[b, 2b)`` and
    the slot mapping ``[2b, 3b)``; ``narrow`` (int32) the context lengths ``[0, b)`` and the
    ``[b, width]`` block tables after them. A bucket's views are fixed at capture; a step
    writes the bucket's ids, positions, slots and context lengths, and the table columns its
    rows use."""

    def __init__(self, *, max_batch_size: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        if max_model_len < 1 or block_size < 1:
            raise ValueError(f"max_model_len ({max_model_len}) and block_size ({block_size}) must be >= 1")
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)
        """Block-table columns: enough for a sequence of ``max_model_len`` tokens."""
        self.device = device
        self.wide = torch.zeros(3 * max_batch_size, dtype=torch.int64, device=device)
        self.narrow = torch.zeros(max_batch_size * (1 + self.width), dtype=torch.int32, device=device)
        self._no_prefill_i32 = torch.zeros(1, dtype=torch.int32, device=device)

    def views(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of bucket ``bucket`` (views of the buffers)."""
        b, width = bucket, self.width
        if 3 * b > self.wide.numel():
            raise ValueError(f"bucket {b} is larger than the buffers' {self.wide.numel() // 3} rows")
        empty = self._no_prefill_i32
        md = AttentionMetadata(
            slot_mapping=self.wide[2 * b : 3 * b],
            num_prefills=0,
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=empty[:1],
            prefill_context_lens=empty[:0],
            prefill_block_tables=empty[:0].view(0, 1),
            prefill_max_q_len=0,
            prefill_max_context_len=0,
            num_decodes=b,
            decode_context_lens=self.narrow[:b],
            decode_block_tables=self.narrow[b : b * (1 + width)].view(b, width),
            decode_max_context_len=width * self.block_size,
            block_size=self.block_size,
        )
        return self.wide[:b], self.wide[b : 2 * b], md

    def pad(self, bucket: int) -> None:
        """Make every row of bucket ``bucket`` a padded row."""
        b = bucket
        self.wide[: 2 * b].zero_()
        self.wide[2 * b : 3 * b].fill_(-1)
        self.narrow[:b].fill_(1)
        self.narrow[b : b * (1 + self.width)].zero_()

    def fits(self, rows: DecodeRows) -> bool:
        """Whether every row's position lies inside the buffers' block tables."""
        return not len(rows) or int(rows.positions.max()) < self.width * self.block_size

    def fill(self, rows: DecodeRows, bucket: int) -> None:
        """Write ``rows`` into bucket ``bucket``'s inputs, the rows after them as padding
        (id 0, position 0, slot -1, context length 1, block table of zeros)."""
        n, b, width = len(rows), bucket, self.width
        if not 0 < n <= b:
            raise ValueError(f"{n} decode rows do not fit bucket {b}")
        if not self.fits(rows):
            raise ValueError(f"a decode position is beyond max_model_len ({width * self.block_size} tokens)")
        wide = np.zeros(3 * b, dtype=np.int64)
        wide[:n] = rows.token_ids
        wide[b : b + n] = rows.positions
        slots = wide[2 * b :]
        slots[n:] = -1
        decode_slot_mapping(rows, block_size=self.block_size, out=slots[:n])
        context_lens = np.ones(b, dtype=np.int32)
        np.add(rows.positions, 1, out=context_lens[:n], casting="unsafe")
        # Only the columns this batch uses travel (a 128k-token max_model_len has thousands):
        # a row reads the columns below its context length only, so those past them may keep
        # an earlier step's (valid) block ids.
        used = min(rows.block_tables.shape[1], width)
        tables = np.zeros((b, used), dtype=np.int32)
        tables[:n] = rows.block_tables[:, :used]
        self._copy(self.wide[: 3 * b], wide)
        self._copy(self.narrow[:b], context_lens)
        self._copy(self.narrow[b : b * (1 + width)].view(b, width)[:, :used], tables)

    def _copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        host = torch.from_numpy(src)
        if self.device.type == "cuda":
            host = host.pin_memory()  # the caching host allocator keeps it until the copy ran
        dst.copy_(host, non_blocking=True)


class GraphBackend(Protocol):
    """Turns a forward over the static buffers into its replay."""

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]: ...


class EagerReplay:
    """The replay is the forward itself: the graph path without graphs (CPU, tests)."""

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        return forward


class CudaGraphBackend:
    """Captures each forward as a ``torch.cuda.CUDAGraph`` on one stream, all graphs in one
    memory pool (captured largest first, the smaller ones reuse its blocks)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            forward()  # warm-up: Triton compiles, cuBLAS chooses, allocations settle
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            forward()
        torch.cuda.synchronize(self.device)
        self.graphs.append(graph)
        return graph.replay


class DecodeGraphs:
    """One replayable decode forward per bucket over shared static buffers; see the module
    docstring. :meth:`capture` first, then :meth:`forward` for each pure-decode step that
    :meth:`fits`."""

    def __init__(
        self,
        *,
        model: CausalLM,
        kv_caches: KVCaches,
        buckets: Sequence[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        backend: GraphBackend,
    ) -> None:
        self.buckets = check_buckets(buckets)
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.buffers = DecodeBuffers(
            max_batch_size=self.buckets[-1],
            max_model_len=max_model_len,
            block_size=block_size,
            device=device,
        )
        self.hidden: torch.Tensor | None = None
        """The forward's output rows, shared by every bucket (bucket ``b`` writes ``[:b]``)."""
        self._replays: dict[int, Callable[[], None]] = {}

    def capture(self) -> None:
        """Size the shared output with one eager forward of the largest bucket (all padding:
        no KV is written), then capture every bucket, largest first."""
        started = time.perf_counter()
        largest = self.buckets[-1]
        with torch.inference_mode():
            ids, positions, md = self.buffers.views(largest)
            self.buffers.pad(largest)
            hidden = self.model.forward(input_ids=ids, positions=positions, kv_caches=self.kv_caches, md=md)
            if hidden.dim() != 2 or hidden.shape[0] != largest:
                raise ValueError(f"CUDA graphs need a forward that returns [rows, hidden], got {tuple(hidden.shape)}")
            self.hidden = torch.empty_like(hidden)
            for bucket in reversed(self.buckets):
                self.buffers.pad(bucket)  # the warm-up and capture runs write no KV
                self._replays[bucket] = self.backend.capture(self._forward_of(bucket))
        log.info(
            "decode graphs for batch sizes %s captured in %.1f s",
            list(self.buckets),
            time.perf_counter() - started,
        )

    def _forward_of(self, bucket: int) -> Callable[[], None]:
        ids, positions, md = self.buffers.views(bucket)
        model, caches, hidden = self.model, self.kv_caches, self.hidden
        assert hidden is not None

        def forward() -> None:
            with torch.inference_mode():
                hidden[:bucket].copy_(model.forward(input_ids=ids, positions=positions, kv_caches=caches, md=md))

        return forward

    def fits(self, rows: DecodeRows) -> bool:
        """Whether ``rows`` run in a graph (a bucket holds them, their positions fit)."""
        return bucket_for(len(rows), self.buckets) is not None and self.buffers.fits(rows)

    def forward(self, rows: DecodeRows) -> torch.Tensor:
        """Hidden states ``[len(rows), hidden]`` of one pure-decode step (a view of the shared
        output, valid until the next replay is queued)."""
        bucket = bucket_for(len(rows), self.buckets) or 0
        replay = self._replays.get(bucket)
        if replay is None or self.hidden is None:
            raise ValueError(f"no captured decode graph holds {len(rows)} rows (buckets {list(self.buckets)})")
        self.buffers.fill(rows, bucket)
        replay()
        return self.hidden[: len(rows)]
