"""One rank's part of the KV handoff: its slice of exported blocks, and pulling the slice it owns.

Why here and not in :mod:`...transfer`: this is where the transport meets a rank's torch KV
cache (``[block][token][local head][dim]`` per layer). A prefill rank snapshots its part of
the exported blocks into host memory once (:func:`snapshot`; its KV endpoint serves the
snapshot, so the blocks may be reused whenever the driver unpins them); a decode rank plans
which prefill rank holds each of its (layer, KV head) slices (:func:`~...transfer.plan_pulls`),
pulls them all at once, each straight into a host staging buffer
(a :class:`~...transfer.BlockDestination`: no copy after the socket's), and scatters the
staging into its cache blocks with one indexed copy per layer and K/V, after every piece
arrived whole (so a failed pull writes nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence

import torch

from ...transfer import KVConnector, KVLayout, KVSlice, RankSource, TransferError, plan_pulls
from ...transfer.wire import byte_view
from ..kv_budget import KVCacheSpec
from ..step_inputs import KVCaches


def wire_layout(spec: KVCacheSpec, *, block_size: int, compat_hash: str) -> KVLayout:
    """The whole-model wire layout of blocks with ``spec`` (a whole-model spec: every layer and
    KV head)."""
    return KVLayout(
        num_layers=spec.num_layers,
        block_size=block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=str(spec.dtype).removeprefix("torch."),
        dtype_bytes=torch.empty((), dtype=spec.dtype).element_size(),
        compat_hash=compat_hash,
    )


def snapshot(caches: KVCaches, block_ids: Sequence[int]) -> torch.Tensor:
    """This rank's part of ``block_ids`` on the host, one contiguous block after the other:
    ``[block][local layer][K, V][token][local head][dim bytes]`` (the wire order of its slice)."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0][0].device)
    parts = torch.stack(
        [
            torch.stack((k.index_select(0, index).view(torch.uint8), v.index_select(0, index).view(torch.uint8)), dim=1)
            for k, v in caches
        ],
        dim=1,
    )
    return parts.cpu().contiguous()


@dataclasses.dataclass(frozen=True)
class PullOrder:
    """What every decode rank pulls for one request (the driver broadcasts it)."""

    pull_id: str
    request_id: str
    """The prefill pod's request id."""
    sources: tuple[RankSource, ...]
    """The prefill ranks, in rank order."""
    first_block: int
    block_ids: tuple[int, ...]
    """Local destination of remote blocks ``first_block, first_block + 1, ...``."""
    num_tokens: int
    layout: KVLayout
    timeout_seconds: float


@dataclasses.dataclass(frozen=True)
class PullReport:
    """How one decode rank's part of a pull went."""

    rank: int
    ok: bool
    code: str = ""
    message: str = ""
    num_bytes: int = 0
    """Block bytes received (this rank's share of the blocks)."""
    sources: tuple[int, ...] = ()
    """Indexes of the prefill ranks this rank connected to."""
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PullReport:
        body = json.loads(text)
        return cls(**{**body, "sources": tuple(body["sources"])})


class _Staging:
    """A :class:`~...transfer.BlockDestination` over one host tensor ``[block][slice bytes]``."""

    def __init__(self, *, first_block: int, num_blocks: int, block_nbytes: int, pin: bool) -> None:
        self.first_block = first_block
        self.tensor = torch.empty((num_blocks, block_nbytes), dtype=torch.uint8, pin_memory=pin)
        self._view = byte_view(self.tensor.numpy())
        self._block_nbytes = block_nbytes

    def buffers(self, index: int) -> Sequence[memoryview]:
        start = (index - self.first_block) * self._block_nbytes
        if not 0 <= start < len(self._view):
            raise TransferError(code="protocol", message=f"block {index} outside the pull")
        return [self._view[start : start + self._block_nbytes]]

    def received(self, index: int) -> None:
        pass


async def pull_part(
    order: PullOrder, *, connector: KVConnector, caches: KVCaches, mine: KVSlice, rank: int
) -> PullReport:
    """Pull ``mine`` (this rank's global layers and KV heads, which its caches hold) of every
    block of ``order`` from the prefill ranks that hold it, in parallel, then write it into
    ``caches``. Never raises for a failed transfer: the report says what failed."""
    started = time.perf_counter()
    try:
        plan = plan_pulls(mine, order.sources, layout=order.layout, spread=rank)
    except TransferError as exc:
        return PullReport(rank=rank, ok=False, code=exc.code, message=exc.message)
    whole = KVSlice.whole(order.layout)
    device = caches[0][0].device
    stagings = [
        _Staging(
            first_block=order.first_block,
            num_blocks=len(order.block_ids),
            block_nbytes=part.block_nbytes(order.layout),
            pin=device.type == "cuda",
        )
        for _, part in plan
    ]

    async def pull(source: int, part: KVSlice, staging: _Staging) -> int:
        result = await connector.fetch(
            endpoint=order.sources[source].endpoint,
            request_id=order.request_id,
            first_block=order.first_block,
            layout=order.layout,
            on_block=staging,
            timeout_seconds=order.timeout_seconds,
            expected_num_tokens=order.num_tokens,
            slice=None if part == whole else part,
            release=False,
        )
        if result.num_blocks != len(order.block_ids):
            raise TransferError(
                code="prompt_mismatch",
                message=(f"prefill rank {source} sent {result.num_blocks} blocks, {len(order.block_ids)} were due"),
            )
        return result.num_bytes

    results = await asyncio.gather(
        *(pull(source, part, staging) for (source, part), staging in zip(plan, stagings, strict=True)),
        return_exceptions=True,
    )
    sources = tuple(source for source, _ in plan)
    for result in results:
        if isinstance(result, TransferError):
            return PullReport(rank=rank, ok=False, code=result.code, message=result.message, sources=sources)
        if isinstance(result, BaseException):
            return PullReport(
                rank=rank, ok=False, code="protocol", message=f"{type(result).__name__}: {result}", sources=sources
            )
    write_part(
        caches,
        mine=mine,
        plan=[part for _, part in plan],
        stagings=[s.tensor for s in stagings],
        block_ids=order.block_ids,
        layout=order.layout,
    )
    return PullReport(
        rank=rank,
        ok=True,
        num_bytes=sum(r for r in results if isinstance(r, int)),
        sources=sources,
        seconds=time.perf_counter() - started,
    )


def write_part(
    caches: KVCaches,
    *,
    mine: KVSlice,
    plan: Sequence[KVSlice],
    stagings: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    layout: KVLayout,
) -> None:
    """Scatter each pulled slice (``stagings[i]``: ``[block][plan[i]'s wire bytes]``) into
    ``block_ids`` of ``caches`` (which hold ``mine``)."""
    device = caches[0][0].device
    index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    dim_bytes = layout.head_dim * layout.dtype_bytes
    for part, staging in zip(plan, stagings, strict=True):
        values = staging.view(len(block_ids), part.num_layers, 2, layout.block_size, part.num_heads, dim_bytes)
        values = values.to(device, non_blocking=True)
        heads = slice(part.head_start - mine.head_start, part.head_end - mine.head_start)
        for offset in range(part.num_layers):
            k, v = caches[part.layer_start - mine.layer_start + offset]
            k.view(torch.uint8)[index, :, heads] = values[:, offset, 0]
            v.view(torch.uint8)[index, :, heads] = values[:, offset, 1]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
