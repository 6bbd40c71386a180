"""Parts of a KV block: which layers and KV heads a rank holds, and which one a puller asks for.

Why: with tensor and pipeline parallelism each rank's cache holds only its stage's layers and
its share of the KV heads. Funnelling every block through rank 0 in the whole-model layout
(gather on the prefill pod, broadcast on the decode pod) moves every byte twice more than
needed and serialises the ranks; instead every prefill rank serves its own part and every
decode rank pulls the part it owns, straight from the prefill ranks that hold it.

A :class:`KVSlice` is a rectangle of (global) layers × KV heads; on the wire a block's slice
keeps the whole-model byte order restricted to it: ``[layer][K, V][token][head][dim]``. A
:class:`RankSource` names one prefill rank's endpoint and the slice it holds, and
:func:`plan_pulls` says which slice to take from which rank: every (layer, head) a puller owns
exactly once, a KV head that several ranks hold (replicated when a pool's tensor-parallel size
exceeds the model's KV heads) from one of them (decode ranks spread over the replicas).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .connector import KVLayout, TransferError
from .wire import byte_view

MAX_RANK_SOURCES = 1024
"""More prefill ranks than this in one handoff is refused as malformed."""


@dataclass(frozen=True)
class KVSlice:
    """Global layers ``[layer_start, layer_end)`` × KV heads ``[head_start, head_end)``."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int

    @classmethod
    def whole(cls, layout: KVLayout) -> KVSlice:
        return cls(0, layout.num_layers, 0, layout.num_kv_heads)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start

    def block_nbytes(self, layout: KVLayout) -> int:
        """Bytes of one block's slice on the wire."""
        return 2 * self.num_layers * layout.block_size * self.num_heads * layout.head_dim * layout.dtype_bytes

    def fits(self, layout: KVLayout) -> bool:
        """Non-empty and inside ``layout``."""
        return (
            0 <= self.layer_start < self.layer_end <= layout.num_layers
            and 0 <= self.head_start < self.head_end <= layout.num_kv_heads
        )

    def contains(self, other: KVSlice) -> bool:
        return (
            self.layer_start <= other.layer_start
            and other.layer_end <= self.layer_end
            and self.head_start <= other.head_start
            and other.head_end <= self.head_end
        )

    def intersect(self, other: KVSlice) -> KVSlice | None:
        part = KVSlice(
            max(self.layer_start, other.layer_start),
            min(self.layer_end, other.layer_end),
            max(self.head_start, other.head_start),
            min(self.head_end, other.head_end),
        )
        return part if part.layer_start < part.layer_end and part.head_start < part.head_end else None

    def to_json(self) -> dict[str, list[int]]:
        return {"layers": [self.layer_start, self.layer_end], "heads": [self.head_start, self.head_end]}

    @classmethod
    def from_json(cls, body: object) -> KVSlice:
        """Parse ``{"layers": [a, b], "heads": [c, d]}``; raises TransferError (protocol)."""

        def pair(name: str) -> tuple[int, int]:
            value = body.get(name) if isinstance(body, Mapping) else None
            if (
                not isinstance(value, list)
                or len(value) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            ):
                raise TransferError(code="protocol", message=f"KV slice {name} is {value!r}, not [start, end]")
            return value[0], value[1]

        (layer_start, layer_end), (head_start, head_end) = pair("layers"), pair("heads")
        return cls(layer_start, layer_end, head_start, head_end)

    def describe(self) -> str:
        return f"layers {self.layer_start}..{self.layer_end - 1}, KV heads {self.head_start}..{self.head_end - 1}"


def extract(
    data: memoryview, *, layout: KVLayout, held: KVSlice, wanted: KVSlice, out: memoryview | None = None
) -> memoryview:
    """The bytes of ``wanted`` out of one block's bytes of ``held`` (which contains it): the
    block itself when they are equal, else a copy of the sub-rectangle, into ``out`` (writable,
    ``wanted.block_nbytes`` long) when given. Reusing ``out`` matters: a fresh megabyte per block
    costs the page faults of new memory, which made a sliced pull as slow as a whole one."""
    if wanted == held:
        return data
    dim_bytes = layout.head_dim * layout.dtype_bytes
    block = np.frombuffer(data, dtype=np.uint8).reshape(
        held.num_layers, 2, layout.block_size, held.num_heads, dim_bytes
    )
    layers = slice(wanted.layer_start - held.layer_start, wanted.layer_end - held.layer_start)
    heads = slice(wanted.head_start - held.head_start, wanted.head_end - held.head_start)
    part = block[layers, :, :, heads]
    if out is None:
        return byte_view(np.ascontiguousarray(part))
    np.copyto(np.frombuffer(out, dtype=np.uint8).reshape(part.shape), part)
    return out


@dataclass(frozen=True)
class RankSource:
    """One prefill rank: where its KV endpoint is and which slice of every block it holds."""

    endpoint: str
    slice: KVSlice

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, **self.slice.to_json()}

    @classmethod
    def from_json(cls, body: object) -> RankSource:
        """Raises ValueError naming what is wrong."""
        endpoint = body.get("endpoint") if isinstance(body, Mapping) else None
        if not isinstance(endpoint, str) or not endpoint:
            raise ValueError(f"a KV rank needs an endpoint (host:port), got {endpoint!r}")
        try:
            return cls(endpoint=endpoint, slice=KVSlice.from_json(body))
        except TransferError as exc:
            raise ValueError(exc.message) from None


def plan_pulls(
    mine: KVSlice, sources: Sequence[RankSource], *, layout: KVLayout, spread: int = 0
) -> list[tuple[int, KVSlice]]:
    """Which slice of ``mine`` to pull from which source (its index), each (layer, head)
    exactly once. Ranks of one pool hold either the same heads or disjoint ones, on the same
    layers or disjoint ones, so each source's share is one rectangle; a slice that several
    sources hold alike (a replicated KV head) comes from one of them, replica ``spread`` (modulo
    their number: decode ranks pass their rank, so they spread over the replicas). Raises
    TransferError (layout_mismatch) when a source's slice does not fit ``layout`` or the
    sources do not cover ``mine``."""
    if not mine.fits(layout):
        raise TransferError(code="layout_mismatch", message=f"{mine.describe()} is outside the KV layout")
    for index, source in enumerate(sources):
        if not source.slice.fits(layout):
            raise TransferError(
                code="layout_mismatch",
                message=(f"prefill rank {index} holds {source.slice.describe()}, outside the KV layout"),
            )
    replicas: dict[KVSlice, list[int]] = {}
    for index, source in enumerate(sources):
        replicas.setdefault(source.slice, []).append(index)
    plan: list[tuple[int, KVSlice]] = []
    for held, indexes in replicas.items():
        index = indexes[spread % len(indexes)]
        part = mine.intersect(held)
        if part is None or any(taken.contains(part) for _, taken in plan):
            continue
        if any(part.intersect(taken) is not None for _, taken in plan):
            raise TransferError(
                code="layout_mismatch",
                message=(f"prefill rank {index}'s {held.describe()} overlaps another rank's part"),
            )
        plan.append((index, part))
    covered = sum(part.num_layers * part.num_heads for _, part in plan)
    if covered != mine.num_layers * mine.num_heads:
        raise TransferError(code="layout_mismatch", message=(f"the prefill ranks do not hold all of {mine.describe()}"))
    return plan
