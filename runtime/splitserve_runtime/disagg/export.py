"""Prefill role: compute a prompt, keep its KV and export it for a decode pod to pull.

:meth:`KVExporter.generate` runs the prompt (prefix caching as usual) with ``keep_kv``, so the
engine pins its blocks when it finishes; an engine-thread call then registers an
:class:`~..transfer.ExportedKV` in the lease-holding :class:`~..transfer.KVExportRegistry`
that the :class:`~..transfer.TcpKVServer` on the KV port serves. Registering happens *on the
engine thread* inside the same call that reads the kept blocks, so a client that vanishes at
that moment cannot strand pinned blocks: the export exists and its lease frees it. Blocks are
read for the wire from the event loop thread while the engine keeps stepping; that is safe
because pinned blocks of a finished request are never written again. ``release`` (RELEASE from
the decode pod, or the lease) hands the unpin back to the engine thread.

A parallel prefill pod's export has every rank snapshot its own layers and KV heads for its own
KV endpoint (:mod:`..engine.parallel.kv_slices`); the handoff parameters then carry the ranks
(:mod:`.layout`). The parameters are built once, typed
(:class:`~splitserve_contract.handoff.HandoffParams`), signed over their canonical bytes with
the digest of the prompt tokens whose KV is kept (:mod:`..transfer.auth`), and answered as
they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from splitserve_contract.block_hash import prompt_digest
from splitserve_contract.handoff import HandoffParams

from ..engine.async_engine import AsyncEngine
from ..engine.errors import KVTransferFailed
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import FINISH_ABORT, FINISH_ERROR, RequestOutput
from ..engine.parallel.runner import ParallelRunner
from ..engine.sampling_params import SamplingParams
from ..transfer import ExportedKV, HandoffAuth, KVExportRegistry, RankSource
from ..transfer.wire import byte_view
from .background import BackgroundTasks
from .layout import KVRanks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Export:
    """A request's KV is exported; ``ranks``: the ranks serving it (None: this endpoint alone);
    ``token_ids``: the tokens whose KV it is."""

    ranks: KVRanks | None
    token_ids: list[int]


class KVExporter:
    """The prefill role of a handoff engine."""

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        registry: KVExportRegistry,
        auth: HandoffAuth,
        kv_endpoint: str,
        compat_hash: str,
        kv_ttl_seconds: float,
        background: BackgroundTasks,
    ) -> None:
        self._engine = engine
        self._registry = registry
        self._auth = auth
        self.kv_endpoint = kv_endpoint
        """The KV server's address as decode pods reach it (rank 0's, on a parallel pod)."""
        self._compat_hash = compat_hash
        self._kv_ttl_seconds = kv_ttl_seconds
        self._background = background
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that engine-thread releases are handed back to."""
        self._loop = loop

    async def generate(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_export: Callable[[HandoffParams], None],
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run the prompt, keep its KV and export it; ``on_export`` receives the signed handoff
        parameters before the finished output is yielded."""
        engine = self._engine
        exported: _Export | None = None
        try:
            async with contextlib.aclosing(
                engine.generate(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, keep_kv=True)
            ) as stream:
                async for out in stream:
                    if out.finished and out.finish_reason not in (FINISH_ABORT, FINISH_ERROR):
                        exported = await asyncio.shield(
                            engine.call(lambda core: self._export(core, request_id=request_id))
                        )
                        on_export(
                            self._handoff(
                                request_id=request_id, out=out, exported=exported, prompt_token_ids=prompt_token_ids
                            )
                        )
                    yield out
        finally:
            if exported is None:  # it may have finished (and pinned) while we were cancelled
                self._background.spawn(engine.call(lambda core: core.release_kept_kv(request_id)))

    def _handoff(
        self, *, request_id: str, out: RequestOutput, exported: _Export | None, prompt_token_ids: list[int]
    ) -> HandoffParams:
        """The signed parameters of a finished export; KVTransferFailed when there is none."""
        first = (out.new_token_ids or [-1])[-1]
        num_prompt = len(prompt_token_ids)
        if exported is None or first < 0 or exported.token_ids[:num_prompt] != prompt_token_ids:
            log.warning(
                "request %s finished (%s) without kept KV of its prompt to export", request_id, out.finish_reason
            )
            raise KVTransferFailed(code="export_failed", message=f"no kept KV for request {request_id!r}")
        # the digest names the prompt tokens whose KV is kept: what was prefilled
        return self._auth.sign_params(
            HandoffParams(
                remote_endpoint=self.kv_endpoint,
                remote_request_id=request_id,
                num_prompt_tokens=num_prompt,
                first_token_id=first,
                compat_hash=self._compat_hash,
                prompt_digest=prompt_digest(exported.token_ids[:num_prompt]),
                kv_layout=None if exported.ranks is None else exported.ranks.to_json(),
            ),
            lifetime_seconds=self._kv_ttl_seconds,
        )

    def _export(self, core: LLMEngine, *, request_id: str) -> _Export | None:
        """On the engine thread: hand the kept blocks of ``request_id`` to the registry (a
        parallel runner's ranks each serve their own part; see the module docstring)."""
        kept = core.kept_kv(request_id)
        if kept is None:
            return None
        block_ids = list(kept.block_ids)
        runner = core.runner
        ranks: KVRanks | None = None
        read_block: Callable[[int], memoryview]
        if isinstance(runner, ParallelRunner):
            try:
                mine, endpoints = runner.export_blocks(
                    request_id=request_id, block_ids=block_ids, num_tokens=kept.num_tokens
                )
            except RuntimeError as exc:
                log.warning("cannot export the KV of request %s: %s", request_id, exc)
                return None
            slices = runner.rank_slices()
            ranks = KVRanks(
                tp=runner.group.tp_size,
                pp=runner.group.num_stages,
                ranks=tuple(
                    RankSource(endpoint=endpoint, slice=part)
                    for endpoint, part in zip([self.kv_endpoint, *endpoints], slices, strict=True)
                ),
            )

            def read_block(index: int) -> memoryview:
                return byte_view(mine[index].numpy())
        else:
            reader = runner.block_reader(block_ids)

            def read_block(index: int) -> memoryview:
                return memoryview(reader(index))

        def release() -> None:
            loop = self._loop
            if loop is None or loop.is_closed():
                return
            loop.call_soon_threadsafe(
                self._background.spawn, self._engine.call(lambda c: self._release_export(c, request_id=request_id))
            )

        self._registry.add(
            ExportedKV(
                request_id=request_id,
                num_tokens=kept.num_tokens,
                num_blocks=len(block_ids),
                read_block=read_block,
                release=release,
            )
        )
        return _Export(ranks=ranks, token_ids=kept.token_ids)  # never written again

    @staticmethod
    def _release_export(core: LLMEngine, *, request_id: str) -> None:
        """Engine thread: unpin the blocks, and have the ranks free their snapshots."""
        core.release_kept_kv(request_id)
        if isinstance(core.runner, ParallelRunner):
            core.runner.drop_export(request_id)
