"""Decode role: move a verified handoff's KV from the prefill pod into reserved blocks.

Two single-process pods keep one connection: the blocks this pod lacks stream straight into
the reservation (``ModelRunner.write_block``; reserved blocks are ignored by the engine thread
until activation). A decode pod with ranks, or fed by a prefill pod with ranks, has every rank
pull the slice it owns from the prefill ranks that hold it, in parallel, into its own cache
(:mod:`..engine.parallel.kv_slices`); the driver collects their reports, fails the whole pull
if any rank failed, and then releases the export on the prefill pod's main endpoint.

Every path settles the prefill pod's export (:class:`PinnedExport`): pulled (the pull's
RELEASE unpins it), released in the background after a failure, or nothing to release (the pod
cannot be reached or no longer holds it), so it is never left pinned for the whole lease.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve_contract.handoff import HandoffParams

from ..engine.async_engine import AsyncEngine
from ..engine.errors import KVTransferFailed
from ..engine.handoff import ImportReservation
from ..engine.parallel.kv_slices import PullOrder, PullReport, pull_part
from ..engine.parallel.runner import ParallelRunner
from ..transfer import KVLayout, KVSlice, TcpKVConnector, TransferError
from .background import BackgroundTasks
from .layout import KVRanks, rank_sources

log = logging.getLogger(__name__)

KV_FETCH_TIMEOUT_SECONDS = 10.0
"""The longest silence from the prefill pod's KV server before a pull fails."""
RANK_PULL_HISTORY = 256
"""How many rank pull reports :attr:`KVPuller.rank_pulls` keeps."""
NOTHING_TO_RELEASE_CODES = frozenset({"connect_failed", "unknown_request", "unauthorized"})
"""Transfer error codes after which a RELEASE is pointless (the prefill pod cannot be reached,
no longer holds the export, or does not accept this pod)."""

TransferObserver = Callable[[int, float, bool], None]
"""(bytes, seconds, succeeded) after each transfer: the server's KV transfer metrics."""


@dataclass(kw_only=True)
class PinnedExport:
    """The prefill pod's export of one import, pinned there until this pod pulls it (the pull's
    RELEASE unpins it) or releases it; ``settled`` once either is done or under way, or when
    there is nothing to release (parameters not trusted, a prefill pod that cannot be reached
    or no longer holds it). ``first_block``: where a pull of nothing starts (past the prompt's
    blocks), the release's FETCH."""

    params: HandoffParams
    ranks: KVRanks | None
    first_block: int
    settled: bool = False


class KVPuller:
    """The decode role's transfers: pulls and releases over the KV connectors."""

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        connector: TcpKVConnector,
        release_connector: TcpKVConnector,
        layout: Callable[[], KVLayout],
        observe: TransferObserver,
        background: BackgroundTasks,
        fetch_timeout_seconds: float,
    ) -> None:
        self._engine = engine
        self._connector = connector
        self._release_connector = release_connector
        """Releases pull nothing: not transfers, so not observed (a release that fails after a
        failed pull must not count that failure twice)."""
        self._layout = layout
        self._observe = observe
        self._background = background
        self._fetch_timeout_seconds = fetch_timeout_seconds
        self.rank_pulls: deque[PullReport] = deque(maxlen=RANK_PULL_HISTORY)
        """The latest rank-by-rank pulls' reports (which prefill ranks each rank connected to,
        the bytes it received)."""

    async def pull(
        self, *, export: PinnedExport, reservation: ImportReservation, num_prompt: int, num_remote_blocks: int
    ) -> None:
        """Fetch the blocks this pod lacks from the prefill pod straight into the reservation;
        the export is settled when this returns or raises KVTransferFailed."""
        runner = self._engine.engine.runner
        if export.ranks is not None or isinstance(runner, ParallelRunner):
            await self._pull_by_rank(
                export=export, reservation=reservation, num_prompt=num_prompt, num_remote_blocks=num_remote_blocks
            )
            return
        source = export.params
        block_ids = reservation.block_ids

        def on_block(index: int, data: memoryview) -> None:
            if not reservation.first_block_index <= index < num_remote_blocks:
                raise TransferError(code="protocol", message=f"block {index} outside the prompt")
            runner.write_block(block_ids[index], data)  # reserved: the engine thread ignores it

        try:
            result = await self._connector.fetch(
                endpoint=source.remote_endpoint,
                request_id=source.remote_request_id,
                first_block=reservation.first_block_index,
                layout=self._layout(),
                on_block=on_block,
                timeout_seconds=self._fetch_timeout_seconds,
                expected_num_tokens=num_prompt,
            )
        except TransferError as exc:
            if exc.code in NOTHING_TO_RELEASE_CODES:
                export.settled = True
            else:  # cut off mid-pull: the prefill pod still pins it (in the background: it may be gone)
                self.release_soon(export)
            raise KVTransferFailed(code=exc.code, message=exc.message) from None
        export.settled = True  # a fetch that returns has sent RELEASE
        if result.num_tokens != num_prompt or result.num_blocks != num_remote_blocks - reservation.first_block_index:
            self._observe(0, 0.0, False)
            raise KVTransferFailed(
                code="prompt_mismatch",
                message=(
                    f"the prefill pod sent {result.num_blocks} blocks of {result.num_tokens} tokens, "
                    f"the prompt has {num_prompt}"
                ),
            )

    async def _pull_by_rank(
        self, *, export: PinnedExport, reservation: ImportReservation, num_prompt: int, num_remote_blocks: int
    ) -> None:
        """Every rank of this pod pulls the slice it owns from the prefill ranks holding it;
        then the export is released on the prefill pod's main endpoint."""
        source = export.params
        runner = self._engine.engine.runner
        layout = self._layout()
        first_block = reservation.first_block_index
        order = PullOrder(
            pull_id=uuid.uuid4().hex,
            request_id=source.remote_request_id,
            sources=rank_sources(endpoint=source.remote_endpoint, ranks=export.ranks, layout=layout),
            first_block=first_block,
            block_ids=tuple(reservation.block_ids[first_block:num_remote_blocks]),
            num_tokens=num_prompt,
            layout=layout,
            timeout_seconds=self._fetch_timeout_seconds,
        )
        if order.block_ids:
            if isinstance(runner, ParallelRunner):
                reports = await runner.pull(order, connector=self._connector)
                for report in reports[1:]:  # rank 0's transfers count in its connector
                    self._observe(report.num_bytes, report.seconds, report.ok)
            else:
                reports = [
                    await pull_part(
                        order, connector=self._connector, caches=runner.kv_caches, rank=0, mine=KVSlice.whole(layout)
                    )
                ]
            self.rank_pulls.extend(reports)
            failed = next((report for report in reports if not report.ok), None)
            if failed is not None:  # free the prefill pod's blocks now (in the background: it may be gone)
                self.release_soon(export)
                raise KVTransferFailed(code=failed.code, message=f"decode rank {failed.rank}: {failed.message}")
        await self.release(source, first_block=num_remote_blocks)
        export.settled = True

    def release_soon(self, export: PinnedExport) -> None:
        """Release ``export`` on the prefill pod in the background (the caller may be
        cancelled, or in a generator's ``finally``); it is settled from here on."""
        export.settled = True
        self._background.spawn(self.release(export.params, first_block=export.first_block))

    async def release(self, source: HandoffParams, *, first_block: int) -> None:
        """Pull nothing, but tell the prefill pod to unpin now (else its lease does)."""
        try:
            await self._release_connector.fetch(
                endpoint=source.remote_endpoint,
                request_id=source.remote_request_id,
                first_block=first_block,
                layout=self._layout(),
                on_block=lambda _i, _d: None,
                timeout_seconds=self._fetch_timeout_seconds,
                expected_num_tokens=source.num_prompt_tokens,
            )
        except TransferError as exc:
            log.warning("could not release KV of %s on %s: %s", source.remote_request_id, source.remote_endpoint, exc)
