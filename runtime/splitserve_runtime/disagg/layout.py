"""Where a request's KV sits on the prefill side, as the handoff names it.

A single-process prefill pod holds all of a request's KV behind one endpoint, the handoff
parameters' ``remote_endpoint``. A parallel one (tensor and/or pipeline parallelism) has every
rank serve its own layers and KV heads on its own KV endpoint; the parameters then carry the
ranks (``kv_layout``: tp, pp, each rank's endpoint and slice; absent at TP = PP = 1, so those
parameters keep their single-endpoint shape and the router never looks inside them). The
contract keeps ``kv_layout`` opaque (:class:`~splitserve_contract.handoff.HandoffParams`): its
content is this runtime's, parsed here once (:meth:`KVRanks.from_json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve_contract.handoff import KV_LAYOUT

from ..engine.llm_engine import LLMEngine
from ..engine.parallel.kv_slices import wire_layout
from ..transfer import KVLayout, KVSlice, RankSource
from ..transfer.slices import MAX_RANK_SOURCES


@dataclass(frozen=True, kw_only=True)
class KVRanks:
    """A parallel prefill pod's layout: its sizes and every rank's endpoint and slice, in rank
    order (rank 0's endpoint is the pod's ``remote_endpoint``)."""

    tp: int
    pp: int
    ranks: tuple[RankSource, ...]

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "ranks": [rank.to_json() for rank in self.ranks]}

    @classmethod
    def from_json(cls, body: object) -> KVRanks:
        """Raises ValueError naming what is wrong."""
        where = f"kv_transfer_params.{KV_LAYOUT}"
        if not isinstance(body, dict):
            raise ValueError(f"{where} must be an object, got {body!r}")
        tp, pp, ranks = body.get("tp"), body.get("pp"), body.get("ranks")
        if type(tp) is not int or type(pp) is not int or tp < 1 or pp < 1:
            raise ValueError(f"{where} needs tp and pp >= 1, got {tp!r} and {pp!r}")
        if not isinstance(ranks, list) or len(ranks) != tp * pp or len(ranks) > MAX_RANK_SOURCES:
            raise ValueError(f"{where}.ranks must list the {tp} x {pp} ranks")
        try:
            return cls(tp=tp, pp=pp, ranks=tuple(RankSource.from_json(rank) for rank in ranks))
        except ValueError as exc:
            raise ValueError(f"{where}.ranks: {exc}") from None


def rank_sources(*, endpoint: str, ranks: KVRanks | None, layout: KVLayout) -> tuple[RankSource, ...]:
    """Where each slice of the blocks is: the ranks, or the one endpoint holding it all."""
    if ranks is not None:
        return ranks.ranks
    return (RankSource(endpoint=endpoint, slice=KVSlice.whole(layout)),)


def kv_layout_of(core: LLMEngine, *, compat_hash: str) -> KVLayout:
    """The wire layout of ``core``'s KV blocks (``ModelRunner.read_block``'s byte order)."""
    return wire_layout(core.runner.wire_spec, block_size=core.block_manager.block_size, compat_hash=compat_hash)
