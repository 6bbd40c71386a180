"""Prefill -> decode KV cache transfer.

A prefill pod keeps the KV blocks of a finished prompt pinned under a lease and serves them on
the KV port; the decode pod that takes the request pulls only the blocks it does not already
hold (its own prefix cache covers the rest) and writes them into its paged cache. The
connector interface (:class:`~.connector.KVConnector`) hides the transport: the TCP
implementation here runs anywhere (CPU tests, loopback, cross-node), a GPU transport
(NCCL, CUDA IPC, RDMA) can replace it without touching the engine or the router.
:mod:`.auth` decides who may take part: pods holding the InferenceService's handoff key, or
loopback peers when there is none. The TCP transport moves blocks without per-block copies in
Python (:mod:`.wire`: gathered sends of the blocks' own memory; :mod:`.receive`: scattered
receives straight into a :class:`~.connector.BlockDestination`), CRC-checked (:mod:`.framing`).
With tensor or pipeline parallelism every rank serves, and pulls, only its own layers and KV
heads (:mod:`.slices`), straight between the ranks that hold them.
"""

from .auth import HandoffAuth, HandoffKey, HandoffRejected
from .connector import (
    BlockDestination,
    BlockSink,
    FetchResult,
    KVConnector,
    KVLayout,
    TransferError,
)
from .registry import ExportedKV, KVExportRegistry
from .slices import KVSlice, RankSource, plan_pulls
from .tcp import TcpKVConnector, TcpKVServer

__all__ = [
    "BlockDestination",
    "BlockSink",
    "ExportedKV",
    "FetchResult",
    "HandoffAuth",
    "HandoffKey",
    "HandoffRejected",
    "KVConnector",
    "KVExportRegistry",
    "KVLayout",
    "KVSlice",
    "RankSource",
    "TcpKVConnector",
    "TcpKVServer",
    "TransferError",
    "plan_pulls",
]
