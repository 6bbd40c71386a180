"""Turns a :class:`SchedulerOutput` into tensors, runs the model and samples.

The runner owns the model and the paged KV cache (per layer a ``(k_cache, v_cache)`` pair
of ``[num_blocks, block_size, num_kv_heads, head_dim]`` on the device). Inputs are built on
the host (prefill chunks first, then decodes, as
:class:`~splitserve_runtime.ops.interface.AttentionMetadata` requires) and copied in one
go, pinned and non-blocking on CUDA, so the only host/device synchronisation per step is
reading the sampled token ids.

Decode rows travel as columns (:class:`~.step_inputs.DecodeRows`, gathered from the block
manager's :class:`~.block_tables.BlockTables`); the rows and the tensors they become are
:mod:`.step_inputs`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from .block_tables import BlockTables
from .cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphBackend
from .kv_budget import (
    KVCacheSpec,
    cpu_kv_budget_bytes,
    cuda_kv_budget_bytes,
    num_blocks_for_budget,
)
from .sampler import PendingSample, Sampler, SamplerOutput
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .step_inputs import (
    CausalLM,
    DecodeRow,
    DecodeRows,
    KVCaches,
    PrefillRow,
    StepInputs,
    StepRows,
    build_step_inputs,
)

log = logging.getLogger(__name__)

_num_computed = attrgetter("num_computed_tokens")
_block_row = attrgetter("block_row")
_request_id = attrgetter("request_id")
_params = attrgetter("params")


def allocate_kv_caches(*, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device) -> KVCaches:
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    # Zeroed, not empty: padded block-table entries point at block 0 and must not hold NaN.
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]


def measure_num_kv_blocks(
    *,
    model: CausalLM,
    spec: KVCacheSpec,
    device: torch.device,
    block_size: int,
    kv_memory_fraction: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    extra_bytes_per_block: int = 0,
) -> int:
    """The KV pool size for this device (see :mod:`.kv_budget`); ``extra_bytes_per_block``:
    another model's KV laid over the same blocks (a speculative draft model)."""
    max_useful = max_num_seqs * -(-max_model_len // block_size) + 1
    if device.type != "cuda":
        budget = cpu_kv_budget_bytes(kv_memory_fraction=kv_memory_fraction)
        return num_blocks_for_budget(
            budget_bytes=budget,
            spec=spec,
            block_size=block_size,
            max_useful_blocks=max_useful,
            extra_bytes_per_block=extra_bytes_per_block,
        )
    num_tokens = min(max_num_batched_tokens, max_model_len)
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    caches = allocate_kv_caches(spec=spec, num_blocks=num_blocks, block_size=block_size, device=device)
    inputs = build_step_inputs(
        prefills=[PrefillRow(token_ids=[0] * num_tokens, start_position=0, block_table=list(range(num_blocks)))],
        decodes=[],
        sample_prefill=[1],
        block_size=block_size,
        device=device,
    )
    with torch.inference_mode():
        hidden = model.forward(input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=caches, md=inputs.md)
        if getattr(model, "has_head", True):  # a pipeline stage before the last has no LM head
            model.compute_logits(hidden[:1].expand(min(max_num_seqs, num_tokens), -1).contiguous())
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    cache_bytes = spec.bytes_per_block(block_size=block_size) * num_blocks
    del caches, inputs, hidden
    torch.cuda.empty_cache()
    activation_peak = max(peak - cache_bytes, 0)
    budget = cuda_kv_budget_bytes(
        device=device, kv_memory_fraction=kv_memory_fraction, activation_peak_bytes=activation_peak
    )
    log.info("KV budget: %.2f GiB (activation peak %.2f GiB)", budget / 2**30, activation_peak / 2**30)
    return num_blocks_for_budget(
        budget_bytes=budget,
        spec=spec,
        block_size=block_size,
        max_useful_blocks=max_useful,
        extra_bytes_per_block=extra_bytes_per_block,
    )


@dataclass(frozen=True, kw_only=True)
class LaunchedStep:
    """A step queued on the device: its sampled sequences and their pending tokens."""

    sample_seqs: list[Sequence]
    pending: PendingSample


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler."""

    def __init__(
        self,
        *,
        model: CausalLM,
        spec: KVCacheSpec,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.eos_token_ids = sorted(eos_token_ids)
        self.spec = spec
        self.wire_spec = spec
        """The KV layout blocks travel in (read/write_block): this spec, or the whole model's
        heads when this runner holds a tensor-parallel shard."""
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(spec=spec, num_blocks=num_blocks, block_size=block_size, device=device)
        self.sampler = Sampler(device=device)
        self.block_tables: BlockTables | None = None
        """The block manager's table mirror (set by the engine); without it decode tables are
        built from the sequences' lists."""
        self.decode_graphs: DecodeGraphs | None = None
        """Replayable pure-decode forwards (:meth:`capture_decode_graphs`); None: all eager."""

    def read_block(self, block_id: int) -> bytes:
        """Export hook: one block's K/V as bytes, ordered ``[layer][K, V][token][head][dim]``.

        Bytes are copied as they are (through ``uint8`` views), whatever the cache dtype: an
        fp8 block travels as its fp8 bytes, never re-encoded.
        """
        self._check_block_id(block_id)
        parts = torch.stack(
            [torch.stack((k[block_id].view(torch.uint8), v[block_id].view(torch.uint8))) for k, v in self.kv_caches]
        )
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
            prefills.append(
                PrefillRow(
                    token_ids=seq.token_ids[start : start + chunk.num_tokens],
                    start_position=start,
                    block_table=seq.block_table,
                )
            )
            samples = chunk.samples
            sample_prefill.append(int(samples))
            if samples:
                sample_seqs.append(seq)
        plain = sched.decodes
        if sched.num_speculative:
            # decodes with proposals run as extend chunks after the prefills: their last token
            # and the proposals, every row sampled
            plain = []
            for seq in sched.decodes:
                if seq.spec_token_ids:
                    prefills.append(
                        PrefillRow(
                            token_ids=[seq.token_ids[-1], *seq.spec_token_ids],
                            start_position=seq.num_tokens - 1,
                            block_table=seq.block_table,
                        )
                    )
                    sample_prefill.append(1 + len(seq.spec_token_ids))
                    sample_seqs.extend([seq] * (1 + len(seq.spec_token_ids)))
                else:
                    plain.append(seq)
        sample_seqs.extend(plain)
        return (
            StepRows(prefills=prefills, decodes=self.decode_rows(plain), sample_prefill=sample_prefill),
            sample_seqs,
        )

    def decode_rows(self, seqs: list[Sequence]) -> DecodeRows:
        """The decode rows of ``seqs`` (each with one uncomputed token, at position
        ``num_computed_tokens``): token id, position and block table, as columns."""
        n = len(seqs)
        positions = np.fromiter(map(_num_computed, seqs), dtype=np.int64, count=n)
        token_ids = np.array([seq.token_ids[-1] for seq in seqs], dtype=np.int64)
        tables = self.block_tables
        if tables is None:
            return DecodeRows.from_rows(
                [
                    DecodeRow(token_id=int(t), position=int(p), block_table=seq.block_table)
                    for t, p, seq in zip(token_ids, positions, seqs, strict=True)
                ]
            )
        rows = np.fromiter(map(_block_row, seqs), dtype=np.intp, count=n)
        width = int(positions.max()) // self.block_size + 1 if n else 0
        return DecodeRows(token_ids=token_ids, positions=positions, block_tables=tables.gather(rows, width=width))

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
                return LaunchedStep(
                    sample_seqs=[], pending=PendingSample(token_ids=torch.empty(0, dtype=torch.long), params=[])
                )
            pending = self.sample(logits, sample_seqs)
        return LaunchedStep(sample_seqs=sample_seqs, pending=pending)

    def sample(self, logits: torch.Tensor, sample_seqs: list[Sequence]) -> PendingSample:
        """Queue sampling of one logits row per entry of ``sample_seqs``."""
        request_ids, params, banned = self.sample_args(sample_seqs)
        return self.sampler.launch(logits=logits, request_ids=request_ids, params=params, banned_token_ids=banned)

    def sample_args(self, seqs: list[Sequence]) -> tuple[list[str], list[SamplingParams], list[list[int]] | None]:
        """The sampler's per-row arguments for ``seqs``: request ids, params, banned ids."""
        return list(map(_request_id, seqs)), list(map(_params, seqs)), self._banned_token_ids(seqs)

    def forward_logits(self, rows: StepRows) -> torch.Tensor | None:
        """Run the model on ``rows``; fp32 logits of the sampled rows (None when none is).
        A pure-decode step that a captured bucket holds replays its graph."""
        graphs = self.decode_graphs
        if graphs is not None and not rows.prefills and rows.decodes:
            decodes = rows.decodes if isinstance(rows.decodes, DecodeRows) else DecodeRows.from_rows(rows.decodes)
            if graphs.fits(decodes):
                return self.model.compute_logits(graphs.forward(decodes))
        inputs = rows.build(block_size=self.block_size, device=self.device)
        hidden = self.model.forward(
            input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=self.kv_caches, md=inputs.md
        )
        if not inputs.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def capture_decode_graphs(
        self, *, max_model_len: int, buckets: Seq[int], backend: GraphBackend | None = None
    ) -> None:
        """Capture one decode graph per batch size in ``buckets`` (:mod:`.cuda_graphs`) and
        route pure-decode steps through them. ``backend``: how forwards are captured (default:
        CUDA graphs, an error off CUDA or with a backend whose kernels sync with the host;
        :class:`~.cuda_graphs.EagerReplay` runs the same padded static-buffer path without graphs)."""
        if type(self).forward_logits is not ModelRunner.forward_logits:
            raise ValueError("CUDA graphs are not available with tensor or pipeline parallelism yet")
        if backend is None:
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, this engine runs on {self.device}")
            ops_name = getattr(getattr(self.model, "ops", None), "name", "triton")
            if ops_name != "triton":
                raise ValueError(
                    f"CUDA graphs need the triton attention backend, not {ops_name!r} "
                    "(its KV write synchronises with the host)"
                )
            backend = CudaGraphBackend(self.device)
        graphs = DecodeGraphs(
            model=self.model,
            kv_caches=self.kv_caches,
            buckets=buckets,
            max_model_len=max_model_len,
            block_size=self.block_size,
            device=self.device,
            backend=backend,
        )
        graphs.capture()
        self.decode_graphs = graphs

    def before_forward(self, rows: StepRows) -> None:
        """Called with each step's rows before its forward (a tensor-parallel driver sends
        them to the other ranks here)."""

    def _banned_token_ids(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Stop/eos tokens of requests that have not reached ``min_tokens`` yet."""
        banned: list[list[int]] | None = None
        for i, seq in enumerate(seqs):
            params = seq.params
            # the row samples output token num_output_tokens + pending + 1
            if params.min_tokens and params.min_tokens > seq.num_output_tokens + seq.num_pending_tokens:
                if banned is None:
                    banned = [[] for _ in seqs]
                eos = [] if params.ignore_eos else self.eos_token_ids
                banned[i] = sorted(set(params.stop_token_ids) | set(eos))
        return banned
