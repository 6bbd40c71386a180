"""``HandoffEngine``: an :class:`~..engine.async_engine.AsyncEngine` that takes part in the
prefill → decode KV handoff (:mod:`splitserve_contract.handoff`).

It owns what a prefill or decode pod has beyond an aggregated one: the handoff key policy
(:mod:`..transfer.auth`), the KV server and its lease registry (prefill), the connectors
(decode), and the background tasks that release KV. The work itself is done by the role's
collaborator, one job each: :class:`~.export.KVExporter` (compute, keep, export, sign) and
:class:`~.decode_import.KVImporter` (accept once, reserve, pull via :mod:`.pull`, decode).
The KV connection itself is authenticated both ways by the transport.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from splitserve_contract.handoff import HandoffParams

from ..engine.async_engine import AsyncEngine
from ..engine.delegate import DelegatingEngine
from ..engine.outputs import RequestOutput
from ..engine.parallel.kv_slices import PullReport
from ..engine.parallel.runner import ParallelRunner
from ..engine.sampling_params import SamplingParams
from ..transfer import HandoffAuth, KVExportRegistry, KVLayout, TcpKVConnector, TcpKVServer
from .background import BackgroundTasks
from .decode_import import KVImporter, VerifiedHandoff
from .export import KVExporter
from .layout import kv_layout_of
from .pull import KV_FETCH_TIMEOUT_SECONDS, KVPuller, TransferObserver

log = logging.getLogger(__name__)


class HandoffEngine(DelegatingEngine):
    """Delegates the :class:`~splitserve_runtime.server.engine_client.EngineClient` surface
    to an AsyncEngine and adds the two handoff entry points. ``role``: prefill or decode."""

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        role: str,
        compat_hash: str,
        kv_host: str,
        kv_port: int,
        kv_endpoint: str,
        kv_ttl_seconds: float,
        observer: TransferObserver | None = None,
        fetch_timeout_seconds: float = KV_FETCH_TIMEOUT_SECONDS,
        auth: HandoffAuth | None = None,
    ) -> None:
        """``auth``: the pool's handoff key policy (default: no key, loopback only)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"HandoffEngine serves the prefill or decode role, not {role!r}")
        super().__init__(engine=engine)
        self._engine: AsyncEngine = engine
        self.role = role
        self.compat_hash = compat_hash
        self._kv_host = kv_host
        self._kv_port = kv_port
        self._observer = observer
        self._kv_ttl_seconds = kv_ttl_seconds
        self.registry = KVExportRegistry(ttl_seconds=kv_ttl_seconds)
        self.auth = auth if auth is not None else HandoffAuth(key=None)
        self.background = BackgroundTasks()
        self._server: TcpKVServer | None = None
        self._layout: KVLayout | None = None
        self._exporter = KVExporter(
            engine=engine,
            registry=self.registry,
            auth=self.auth,
            kv_endpoint=kv_endpoint,
            compat_hash=compat_hash,
            kv_ttl_seconds=kv_ttl_seconds,
            background=self.background,
        )
        self._puller = KVPuller(
            engine=engine,
            connector=TcpKVConnector(observer=self._observe, auth=self.auth),
            release_connector=TcpKVConnector(auth=self.auth),
            layout=lambda: self.layout,
            observe=self._observe,
            background=self.background,
            fetch_timeout_seconds=fetch_timeout_seconds,
        )
        self._importer = KVImporter(
            engine=engine, auth=self.auth, compat_hash=compat_hash, puller=self._puller, background=self.background
        )

    # ------------------------------------------------------------------ EngineClient
    @property
    def kv_endpoint(self) -> str:
        """Prefill role: the KV server's address the handoff parameters name."""
        return self._exporter.kv_endpoint

    @kv_endpoint.setter
    def kv_endpoint(self, endpoint: str) -> None:
        self._exporter.kv_endpoint = endpoint

    @property
    def num_unclaimed_exports(self) -> int:
        """Prefill role: requests whose KV waits for a decode pod's pull (drain waits for them)."""
        return len(self.registry)

    @property
    def rank_pulls(self) -> deque[PullReport]:
        """Decode role: the latest rank-by-rank pulls' reports (:attr:`.pull.KVPuller.rank_pulls`)."""
        return self._puller.rank_pulls

    def set_observer(self, observer: TransferObserver) -> None:
        """Where transfer metrics go (set before :meth:`start`)."""
        self._observer = observer

    async def start(self) -> None:
        await self._engine.start()
        self._exporter.start(asyncio.get_running_loop())
        self._layout = kv_layout_of(self._engine.engine, compat_hash=self.compat_hash)
        if self.role == "prefill":
            runner = self._engine.engine.runner
            holds = runner.rank_slices()[0] if isinstance(runner, ParallelRunner) else None
            self._server = TcpKVServer(
                registry=self.registry,
                layout=self._layout,
                host=self._kv_host,
                port=self._kv_port,
                observer=self._observe,
                auth=self.auth,
                holds=holds,
            )
            await self._server.start()
            log.info("KV server on %s:%d (lease %.0f s)", self._kv_host, self._server.port, self._kv_ttl_seconds)

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.stop()
        self.registry.release_all()
        await self._engine.shutdown()

    def generate(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        return self._engine.generate(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params)

    @property
    def kv_server_port(self) -> int:
        return self._server.port if self._server is not None else self._kv_port

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError("the engine is not started")
        return self._layout

    def _observe(self, num_bytes: int, seconds: float, ok: bool) -> None:
        if self._observer is not None:
            self._observer(num_bytes, seconds, ok)

    # ------------------------------------------------------------------ the handoff
    def generate_for_export(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_export: Callable[[HandoffParams], None],
    ) -> AsyncGenerator[RequestOutput, None]:
        """Prefill role: :meth:`.export.KVExporter.generate`."""
        return self._exporter.generate(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, on_export=on_export
        )

    def accept_remote(
        self, params: Mapping[str, Any] | HandoffParams, *, prompt_token_ids: Sequence[int]
    ) -> VerifiedHandoff:
        """Decode role, where the parameters come in: :meth:`.decode_import.KVImporter.accept`."""
        return self._importer.accept(params, prompt_token_ids=prompt_token_ids)

    def generate_from_remote(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        source: VerifiedHandoff,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Decode role: :meth:`.decode_import.KVImporter.generate`."""
        return self._importer.generate(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, source=source
        )
