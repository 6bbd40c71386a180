"""A worker rank's own side of the KV handoff: its KV endpoint (prefill) and its puller (decode).

Why: rank 0 used to gather every rank's layers and heads for an export and broadcast every
imported block to the ranks, so all KV crossed rank 0 twice more than needed. Now each rank
moves its own slice (:mod:`.kv_slices`): a prefill rank serves its snapshot of each export on
port ``--kv-port + its index within the pod``, at its pod's address (each pod of a multi-pod
group advertises its own), under the same handoff key as rank 0's endpoint (the same
:class:`~...transfer.TcpKVServer`, so the same checks); a decode rank pulls the slice it owns
and reports to the driver through the group's store (:func:`report_key`), so a pull never
holds the control channel, and workers keep executing steps while they pull.

The transfers run on a thread with its own event loop; a worker's main thread only hands
them work. Exports are snapshots (the driver may reuse the blocks once it unpins them); they
are freed when the driver releases the request (:class:`~.control.DropExports`), or by their
own lease (a little longer than the driver's) if that message never comes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import Future

import torch

from splitserve_contract import ENV_POD_IP, Role, ServeArgs

from ...transfer import (
    ExportedKV,
    HandoffAuth,
    HandoffKey,
    KVExportRegistry,
    KVLayout,
    TcpKVConnector,
    TcpKVServer,
)
from ...transfer.wire import byte_view
from ..step_inputs import KVCaches
from .control import KVPart
from .group import ParallelGroup
from .kv_slices import PullOrder, PullReport, pull_part, snapshot, wire_layout

log = logging.getLogger(__name__)

LEASE_GRACE_SECONDS = 30.0
"""A worker's snapshot outlives the driver's lease by this much, if no release comes."""


def report_key(pull_id: str, rank: int) -> str:
    """The store key where ``rank`` puts its :class:`~.kv_slices.PullReport` of ``pull_id``."""
    return f"kvpull/{pull_id}/{rank}"


def advertised_host(host: str) -> str:
    """The address other pods reach a socket bound to ``host`` at: a wildcard is no address,
    so the pod's own IP (``$POD_IP``), else loopback."""
    if host in ("0.0.0.0", "::", ""):
        return os.environ.get(ENV_POD_IP) or "127.0.0.1"
    return host


def handoff_auth(args: ServeArgs) -> HandoffAuth:
    """The pool's handoff policy, as rank 0's endpoint enforces it."""
    return HandoffAuth(key=HandoffKey.from_file(args.handoff_key_file) if args.handoff_key_file else None)


class RankKV:
    """One worker rank's KV endpoint and puller (see the module docstring)."""

    def __init__(
        self, *, args: ServeArgs, group: ParallelGroup, part: KVPart, layout: KVLayout, local_index: int
    ) -> None:
        self._args = args
        self._group = group
        self._layout = layout
        self.mine = part.slice(stage=group.stage, tp_rank=group.tp_rank)
        self._auth = handoff_auth(args)
        self._registry = KVExportRegistry(ttl_seconds=args.kv_ttl_seconds + LEASE_GRACE_SECONDS)
        self._connector = TcpKVConnector(auth=self._auth)
        self._port = args.kv_port + local_index if args.kv_port else 0
        self._server: TcpKVServer | None = None
        self.endpoint = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"rank{group.rank}-kv", daemon=True)
        self._thread.start()

    @classmethod
    def for_rank(
        cls, args: ServeArgs, *, group: ParallelGroup, part: KVPart, dtype: torch.dtype, head_dim: int, local_index: int
    ) -> RankKV | None:
        """The rank's handoff side for a prefill or decode pod (None when aggregated); a
        prefill rank's endpoint is listening when this returns."""
        if args.role not in (Role.PREFILL.value, Role.DECODE.value):
            return None
        from ..kv_budget import KVCacheSpec

        spec = KVCacheSpec(
            num_layers=part.num_layers,
            num_kv_heads=part.layout.config.num_key_value_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
        rank = cls(
            args=args,
            group=group,
            part=part,
            local_index=local_index,
            layout=wire_layout(spec, block_size=args.block_size, compat_hash=args.compat_hash),
        )
        if args.role == Role.PREFILL.value:
            rank.serve()
        return rank

    def serve(self) -> None:
        """Listen on this rank's KV port (raises OSError when it cannot)."""
        try:
            server = self._start_server(self._port)
        except OSError as exc:  # taken (several pods' ports on one host): any port will do, the export says which
            if not self._port:
                raise
            log.warning(
                "rank %d cannot listen on KV port %d (%s); using a free port", self._group.rank, self._port, exc
            )
            server = self._start_server(0)
        self._server = server
        self.endpoint = f"{advertised_host(self._args.host)}:{server.port}"
        log.info("rank %d serves %s of exported KV on %s", self._group.rank, self.mine.describe(), self.endpoint)

    def _start_server(self, port: int) -> TcpKVServer:
        server = TcpKVServer(
            registry=self._registry,
            layout=self._layout,
            host=self._args.host,
            port=port,
            auth=self._auth,
            holds=self.mine,
        )
        asyncio.run_coroutine_threadsafe(server.start(), self._loop).result()
        return server

    def export(self, *, request_id: str, block_ids: list[int], num_tokens: int, caches: KVCaches) -> str:
        """Snapshot and serve this rank's part of ``block_ids``; returns the endpoint it is
        served on. Raises RuntimeError when this rank serves no KV."""
        if self._server is None:
            raise RuntimeError(f"rank {self._group.rank} has no KV endpoint (role {self._args.role})")
        blocks = snapshot(caches, block_ids)
        self._registry.add(
            ExportedKV(
                request_id=request_id,
                num_tokens=num_tokens,
                num_blocks=len(block_ids),
                read_block=lambda index: byte_view(blocks[index].numpy()),
                release=lambda: None,
            )
        )
        return self.endpoint

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._registry.release(request_id)

    def pull(self, order: PullOrder, caches: KVCaches) -> Future[None]:
        """Start pulling this rank's part of ``order`` into ``caches``; the report goes to the
        store under :func:`report_key` (also when the pull failed)."""
        return asyncio.run_coroutine_threadsafe(self._pull(order, caches), self._loop)

    async def _pull(self, order: PullOrder, caches: KVCaches) -> None:
        try:
            report = await pull_part(
                order, connector=self._connector, caches=caches, mine=self.mine, rank=self._group.rank
            )
        except Exception as exc:  # a bug must not leave the driver waiting for ever
            log.exception("rank %d: KV pull %s failed", self._group.rank, order.pull_id)
            report = PullReport(rank=self._group.rank, ok=False, code="protocol", message=str(exc))
        await asyncio.to_thread(self._group.store.set, report_key(order.pull_id, self._group.rank), report.to_json())

    def close(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(timeout=5)
        self._registry.release_all()
        self._loop.call_soon_threadsafe(self._loop.stop)
