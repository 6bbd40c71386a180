"""``HandoffEngine``: an :class:`~.async_engine.AsyncEngine` that takes part in the prefill →
decode KV handoff (the pull protocol of ``contract.KV_TRANSFER_PARAMS_FIELD``).

Prefill role: :meth:`HandoffEngine.generate_for_export` runs the prompt (prefix caching as
usual) with ``keep_kv``, so the engine pins its blocks when it finishes; an engine-thread hook
then registers an :class:`~..transfer.ExportedKV` in the
lease-holding :class:`~..transfer.KVExportRegistry` that the :class:`~..transfer.TcpKVServer`
on the KV port serves. Registering happens *on the engine thread* inside the same ``call``
that reads the kept blocks, so a client that vanishes at that moment cannot strand pinned
blocks: the export exists and its lease frees it. Blocks are read for the wire from the event
loop thread while the engine keeps stepping; that is safe because pinned blocks of a finished
request are never written again. ``release`` (RELEASE from the decode pod, or the lease) hands
the unpin back to the engine thread.

Decode role: :meth:`HandoffEngine.generate_from_remote` reserves blocks for the prompt
(leading blocks this pod already holds in its prefix cache are reused and not pulled), pulls
the missing ones with the connector straight into the reserved blocks, then activates the
request with the prefill pod's first token and streams the rest. Reserved blocks are not
indexed in the prefix cache until activation, so a failed or partial transfer leaves no
corrupt block behind: the reservation is freed (never registered in the prefix cache). The
request is not lost then: the decode pod logs the failure (WARNING, with the transfer error
code; the connector counts it in the transfer-failure metric) and computes the prompt plus the
prefill pod's first token itself, as an ordinary queued request that continues after that
token (streamed once, as after a pull). Only a pull that delivers KV for another number of
tokens than the prompt has raises :class:`~.errors.KVTransferFailed`.
The same seeded request decodes the same tokens as on an aggregated pod: the decode side
advances the request's generator past the draw the prefill pod made.

Parallel pods (tensor and/or pipeline parallelism) move KV rank to rank, never through rank 0
(:mod:`.parallel.kv_slices`): a parallel prefill pod's export has every rank snapshot its own
layers and KV heads for its own KV endpoint, and its handoff parameters carry the layout
(``kv_layout``: tp, pp, and each rank's endpoint and slice; absent at TP = PP = 1, so those
parameters keep their single-endpoint shape and the router never looks inside them). A decode
pod with ranks, or fed by a prefill pod with ranks, has every rank pull the slice it owns from
the prefill ranks that hold it, in parallel, into its own cache; the driver collects their
reports, fails the whole pull (so the request is computed here) if any rank failed, and then
releases the export on the prefill pod's main endpoint (rank 0 unpins, and has its ranks drop
their snapshots). Two single-process pods keep the one-connection path.

Authentication (:mod:`..transfer.auth`): the prefill role signs the handoff parameters it
answers with, including the digest of the prompt tokens whose KV it kept; the decode role acts
only on parameters that pass :meth:`HandoffEngine.accept_remote` (signed with the pool's key,
not expired, this pod's compat hash; without a key, a loopback endpoint; with or without one,
computed for exactly the prompt this pod tokenized) and checks them again before it reserves or
connects anything, raising :class:`~.errors.HandoffRefused` (a client error) otherwise. The KV
connection itself is authenticated both ways by the transport.

Imported blocks are indexed in the prefix cache (at activation) under the block hashes of the
token ids the reservation was made for; those are the very token ids the prompt digest was
checked against (:class:`_VerifiedImport`), so KV computed for one prompt is never findable
under another prompt's hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from splitserve_contract.block_hash import prompt_digest

from ..transfer import (
    ExportedKV,
    HandoffAuth,
    HandoffRejected,
    KVExportRegistry,
    KVLayout,
    KVSlice,
    RankSource,
    TcpKVConnector,
    TcpKVServer,
    TransferError,
)
from ..transfer.slices import MAX_RANK_SOURCES
from ..transfer.wire import byte_view
from .async_engine import AsyncEngine
from .delegate import DelegatingEngine
from .errors import EngineDead, HandoffRefused, KVTransferFailed, QueueFull
from .handoff import ImportReservation
from .llm_engine import LLMEngine
from .outputs import FINISH_ABORT, FINISH_ERROR, RequestOutput
from .parallel.kv_slices import PullOrder, PullReport, pull_part, wire_layout
from .parallel.runner import ParallelRunner
from .sampling_params import SamplingParams
from .stop_checker import StopChecker

log = logging.getLogger(__name__)

KV_FETCH_TIMEOUT_SECONDS = 10.0
"""Decode role: the longest silence from the prefill pod's KV server before a pull fails."""
IMPORT_WAIT_SECONDS = 10.0
"""Decode role: how long an imported prompt waits for KV blocks or a batch slot before 429
(well inside the prefill pod's KV lease, --kv-ttl-seconds, 30 s by default)."""
IMPORT_RETRY_SECONDS = 0.02
RANK_PULL_HISTORY = 256
"""Decode role: how many rank pull reports :attr:`HandoffEngine.rank_pulls` keeps."""

NOTHING_TO_RELEASE_CODES = frozenset({"connect_failed", "unknown_request", "unauthorized"})
"""Decode role: transfer error codes after which a RELEASE is pointless (the prefill pod cannot
be reached, no longer holds the export, or does not accept this pod)."""

TransferObserver = Callable[[int, float, bool], None]
"""(bytes, seconds, succeeded) after each transfer: the server's KV transfer metrics."""


@dataclass(frozen=True, kw_only=True)
class RemotePrefill:
    """Where a decode request's KV lives (the prefill pod's ``kv_transfer_params``)."""

    remote_endpoint: str
    remote_request_id: str
    num_prompt_tokens: int
    first_token_id: int
    compat_hash: str = ""
    prompt_digest: str = ""
    """``splitserve_contract.block_hash.prompt_digest`` of the prompt the KV was computed for
    ("": none, which the decode side refuses)."""
    expires_at: int = 0
    """Unix seconds after which the parameters are refused (with a handoff key; 0: none)."""
    signature: str = ""
    """The prefill pod's HMAC over the other fields (:mod:`..transfer.auth`; "": unsigned)."""
    kv_layout: KVRanks | None = None
    """A parallel prefill pod's ranks (None: one endpoint, ``remote_endpoint``, holds it all)."""

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemotePrefill:
        """Parse the handoff object; raises ValueError naming the bad field."""
        def field(name: str, kind: type, default: Any = None) -> Any:
            value = params.get(name, default)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{name} must be a {kind.__name__}, got {value!r}")
            return value
        layout = params.get("kv_layout")
        return cls(remote_endpoint=field("remote_endpoint", str),
                   remote_request_id=field("remote_request_id", str),
                   num_prompt_tokens=field("num_prompt_tokens", int),
                   first_token_id=field("first_token_id", int),
                   compat_hash=field("compat_hash", str, ""),
                   prompt_digest=field("prompt_digest", str, ""),
                   expires_at=field("expires_at", int, 0),
                   signature=field("signature", str, ""),
                   kv_layout=None if layout is None else KVRanks.from_json(layout))

    def to_params(self) -> dict[str, Any]:
        """The wire object; the signed fields only when signed, the layout only when the
        prefill pod has ranks (the single-endpoint shape as before)."""
        params: dict[str, Any] = {
            "remote_endpoint": self.remote_endpoint, "remote_request_id": self.remote_request_id,
            "num_prompt_tokens": self.num_prompt_tokens, "first_token_id": self.first_token_id,
            "compat_hash": self.compat_hash}
        if self.prompt_digest:
            params["prompt_digest"] = self.prompt_digest
        if self.kv_layout is not None:
            params["kv_layout"] = self.kv_layout.to_json()
        if self.signature:
            params.update(expires_at=self.expires_at, signature=self.signature)
        return params

    def sources(self, layout: KVLayout) -> tuple[RankSource, ...]:
        """Where each slice of the blocks is: the ranks, or the one endpoint holding it all."""
        if self.kv_layout is not None:
            return self.kv_layout.ranks
        return (RankSource(endpoint=self.remote_endpoint, slice=KVSlice.whole(layout)),)


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
        if not isinstance(body, dict):
            raise ValueError(f"kv_transfer_params.kv_layout must be an object, got {body!r}")
        tp, pp, ranks = body.get("tp"), body.get("pp"), body.get("ranks")
        if type(tp) is not int or type(pp) is not int or tp < 1 or pp < 1:
            raise ValueError(f"kv_transfer_params.kv_layout needs tp and pp >= 1, got {tp!r} and {pp!r}")
        if not isinstance(ranks, list) or len(ranks) != tp * pp or len(ranks) > MAX_RANK_SOURCES:
            raise ValueError(f"kv_transfer_params.kv_layout.ranks must list the {tp} x {pp} ranks")
        try:
            return cls(tp=tp, pp=pp, ranks=tuple(RankSource.from_json(rank) for rank in ranks))
        except ValueError as exc:
            raise ValueError(f"kv_transfer_params.kv_layout.ranks: {exc}") from None


def kv_layout_of(core: LLMEngine, *, compat_hash: str) -> KVLayout:
    """The wire layout of ``core``'s KV blocks (``ModelRunner.read_block``'s byte order)."""
    return wire_layout(core.runner.wire_spec, block_size=core.block_manager.block_size, compat_hash=compat_hash)


class HandoffEngine(DelegatingEngine):
    """Delegates the :class:`~splitserve_runtime.server.engine_client.EngineClient` surface
    to an AsyncEngine and adds the two handoff entry points. ``role``: prefill or decode."""

    def __init__(self, *, engine: AsyncEngine, role: str, compat_hash: str, kv_host: str,
                 kv_port: int, kv_endpoint: str, kv_ttl_seconds: float,
                 observer: TransferObserver | None = None,
                 fetch_timeout_seconds: float = KV_FETCH_TIMEOUT_SECONDS,
                 auth: HandoffAuth | None = None) -> None:
        """``auth``: the pool's handoff key policy (default: no key, loopback only)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"HandoffEngine serves the prefill or decode role, not {role!r}")
        super().__init__(engine=engine)
        self._engine: AsyncEngine = engine
        self.role = role
        self.compat_hash = compat_hash
        self.kv_endpoint = kv_endpoint
        self._kv_host = kv_host
        self._kv_port = kv_port
        self._observer = observer
        self._fetch_timeout_seconds = fetch_timeout_seconds
        self._kv_ttl_seconds = kv_ttl_seconds
        self.registry = KVExportRegistry(ttl_seconds=kv_ttl_seconds)
        self.auth = auth if auth is not None else HandoffAuth(key=None)
        self._server: TcpKVServer | None = None
        self._connector = TcpKVConnector(observer=self._observe, auth=self.auth)
        self._release_connector = TcpKVConnector(auth=self.auth)
        """Releases pull nothing: not transfers, so not observed (a release that fails after a
        failed pull must not count that failure twice)."""
        self._layout: KVLayout | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.rank_pulls: deque[PullReport] = deque(maxlen=RANK_PULL_HISTORY)
        """Decode role: the latest rank-by-rank pulls' reports (which prefill ranks each rank
        connected to, the bytes it received)."""

    # ------------------------------------------------------------------ EngineClient
    @property
    def num_unclaimed_exports(self) -> int:
        """Prefill role: requests whose KV waits for a decode pod's pull (drain waits for them)."""
        return len(self.registry)

    def set_observer(self, observer: TransferObserver) -> None:
        """Where transfer metrics go (set before :meth:`start`)."""
        self._observer = observer

    async def start(self) -> None:
        await self._engine.start()
        self._loop = asyncio.get_running_loop()
        self._layout = kv_layout_of(self._engine.engine, compat_hash=self.compat_hash)
        if self.role == "prefill":
            runner = self._engine.engine.runner
            holds = runner.rank_slices()[0] if isinstance(runner, ParallelRunner) else None
            self._server = TcpKVServer(registry=self.registry, layout=self._layout, host=self._kv_host,
                                       port=self._kv_port, observer=self._observe, auth=self.auth,
                                       holds=holds)
            await self._server.start()
            log.info("KV server on %s:%d (lease %.0f s)", self._kv_host, self._server.port,
                     self._kv_ttl_seconds)

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.stop()
        self.registry.release_all()
        await self._engine.shutdown()

    def generate(self, *, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self._engine.generate(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                     params=params)


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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        """Forget a finished background task and retrieve its outcome: a release that finds the
        engine stopped (shutdown) is expected; anything else is logged, not left to asyncio's
        "Task exception was never retrieved" at garbage collection."""
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, EngineDead):
            log.debug("background KV task skipped, the engine is stopped: %s", exc)
        elif exc is not None:
            log.warning("background KV task failed: %r", exc)

    # ------------------------------------------------------------------ prefill role
    async def generate_for_export(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        on_export: Callable[[RemotePrefill], None],
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run the prompt, keep its KV and export it; ``on_export`` receives the handoff
        parameters before the finished output is yielded."""
        engine = self._engine
        exported: _Export | None = None
        try:
            async with contextlib.aclosing(engine.generate(
                    request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                    keep_kv=True)) as stream:
                async for out in stream:
                    if out.finished and out.finish_reason not in (FINISH_ABORT, FINISH_ERROR):
                        first = (out.new_token_ids or [-1])[-1]
                        exported = await asyncio.shield(engine.call(
                            lambda core: self._export(core, request_id=request_id)))
                        num_prompt = len(prompt_token_ids)
                        if (exported is None or first < 0
                                or exported.token_ids[:num_prompt] != prompt_token_ids):
                            log.warning("request %s finished (%s) without kept KV of its prompt to "
                                        "export", request_id, out.finish_reason)
                            raise KVTransferFailed(code="export_failed",
                                                   message=f"no kept KV for request {request_id!r}")
                        # the digest names the prompt tokens whose KV is kept: what was prefilled
                        on_export(RemotePrefill.from_params(self.auth.sign(RemotePrefill(
                            remote_endpoint=self.kv_endpoint, remote_request_id=request_id,
                            num_prompt_tokens=num_prompt, first_token_id=first,
                            compat_hash=self.compat_hash,
                            prompt_digest=prompt_digest(exported.token_ids[:num_prompt]),
                            kv_layout=exported.layout).to_params(),
                            lifetime_seconds=self._kv_ttl_seconds)))
                    yield out
        finally:
            if exported is None:  # it may have finished (and pinned) while we were cancelled
                self._spawn(engine.call(lambda core: core.release_kept_kv(request_id)))

    def _export(self, core: LLMEngine, *, request_id: str) -> _Export | None:
        """On the engine thread: hand the kept blocks of ``request_id`` to the registry (a
        parallel runner's ranks each serve their own part; see the module docstring)."""
        kept = core.kept_kv(request_id)
        if kept is None:
            return None
        block_ids = list(kept.block_ids)
        runner = core.runner
        layout: KVRanks | None = None
        read_block: Callable[[int], memoryview]
        if isinstance(runner, ParallelRunner):
            try:
                mine, endpoints = runner.export_blocks(request_id=request_id, block_ids=block_ids,
                                                       num_tokens=kept.num_tokens)
            except RuntimeError as exc:
                log.warning("cannot export the KV of request %s: %s", request_id, exc)
                return None
            slices = runner.rank_slices()
            layout = KVRanks(tp=runner.group.tp_size, pp=runner.group.num_stages, ranks=tuple(
                RankSource(endpoint=endpoint, slice=part)
                for endpoint, part in zip([self.kv_endpoint, *endpoints], slices, strict=True)))

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
            loop.call_soon_threadsafe(self._spawn, self._engine.call(
                lambda c: self._release_export(c, request_id=request_id)))

        self.registry.add(ExportedKV(request_id=request_id, num_tokens=kept.num_tokens,
                                     num_blocks=len(block_ids), read_block=read_block,
                                     release=release))
        return _Export(layout=layout, token_ids=kept.token_ids)  # never written again

    @staticmethod
    def _release_export(core: LLMEngine, *, request_id: str) -> None:
        """Engine thread: unpin the blocks, and have the ranks free their snapshots."""
        core.release_kept_kv(request_id)
        if isinstance(core.runner, ParallelRunner):
            core.runner.drop_export(request_id)

    # ------------------------------------------------------------------ decode role
    def accept_remote(self, params: dict[str, Any], *, prompt_token_ids: Sequence[int]) -> RemotePrefill:
        """The handoff parameters of a request whose prompt this pod tokenized as
        ``prompt_token_ids``, if this pod may act on them. Raises ValueError (malformed, or a
        first token outside this pod's vocabulary) or :class:`~.errors.HandoffRefused` (not
        from a prefill pod of this pool, or computed for another prompt; see
        :mod:`..transfer.auth`). Nothing is connected to before this passes."""
        source = RemotePrefill.from_params(params)
        self._authenticate(source, prompt_token_ids=prompt_token_ids)
        self._check_first_token(source)
        return source

    def _authenticate(self, source: RemotePrefill, *, prompt_token_ids: Sequence[int]) -> None:
        try:
            self.auth.check_params(source.to_params(), compat_hash=self.compat_hash,
                                   prompt_token_ids=prompt_token_ids)
        except HandoffRejected as exc:
            log.warning("refused handoff parameters naming %r (code %s)", source.remote_endpoint[:100],
                        exc.code)
            raise HandoffRefused(code=exc.code, message=str(exc)) from None

    async def generate_from_remote(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        source: RemotePrefill,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pull the prompt's KV from ``source`` and continue decoding here. Parameters that fail
        authentication are refused before anything is connected to; a request refused or failed
        after they passed (a KV-capacity 400, no room in time, a failed pull, a client gone)
        releases the export on the prefill pod at once rather than leave it pinned there for
        the lease (``--kv-ttl-seconds``)."""
        core = self._engine.engine
        started = time.monotonic()
        export = _PinnedExport(source=source,
                               first_block=math.ceil(len(prompt_token_ids) / core.block_manager.block_size))
        try:
            try:
                verified = self._check_remote(prompt_token_ids=prompt_token_ids, params=params, source=source)
            except HandoffRefused:  # not trusted: the endpoint they name is never connected to
                export.settled = True
                raise
            async with contextlib.aclosing(self._import_remote(
                    request_id=request_id, verified=verified, params=params, export=export,
                    started=started)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            if not export.settled:  # refused or failed before the pull: unpin it there now
                self._release_soon(export)

    async def _import_remote(
        self, *, request_id: str, verified: _VerifiedImport, params: SamplingParams,
        export: _PinnedExport, started: float,
    ) -> AsyncGenerator[RequestOutput, None]:
        """:meth:`generate_from_remote` once the handoff is verified; settles ``export`` (pulls
        or releases it) on every path that gets that far."""
        core = self._engine.engine
        source = export.source
        prompt_token_ids = list(verified.prompt_token_ids)  # from here on: the verified tokens only
        first = verified.first_token_id
        num_prompt = len(prompt_token_ids)
        num_remote_blocks = math.ceil(num_prompt / core.block_manager.block_size)
        token_reason = StopChecker(params=params, eos_token_ids=core.eos_token_ids,
                                   detokenizer=None).check_token(token_id=first, num_output_tokens=1)
        if token_reason is not None:  # the first token already ends it: nothing to decode
            await self._release_remote(source, first_block=num_remote_blocks)
            export.settled = True
            text = "" if token_reason == "stop" else self.tokenizer.decode([first])
            yield self._first_output(request_id=request_id, first=first, text=text, finish_reason=token_reason,
                                     num_prompt=num_prompt, num_cached=0, started=started)
            return
        reservation = await self._reserve_import(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                                 params=params, first=first)
        if reservation == "stop":
            await self._release_remote(source, first_block=num_remote_blocks)
            export.settled = True
            yield self._first_output(request_id=request_id, first=first, text="", finish_reason="stop",
                                     num_prompt=num_prompt, num_cached=0, started=started)
            return
        num_cached = reservation.num_cached_tokens
        text = reservation.imported_text
        try:
            stream = await self._import_and_activate(request_id=request_id, params=params, export=export,
                                                     reservation=reservation, num_prompt=num_prompt,
                                                     num_remote_blocks=num_remote_blocks)
        except KVTransferFailed as exc:  # the reservation is freed; the prompt is still here
            log.warning("KV pull for request %s from %s failed (code %s): %s; computing the prompt "
                        "on this pod", request_id, source.remote_endpoint, exc.code, exc)
            stream, text = await self._recompute_locally(request_id=request_id,
                                                         prompt_token_ids=prompt_token_ids,
                                                         params=params, first=first)
            num_cached = 0
        yield self._first_output(request_id=request_id, first=first, text=text,
                                 finish_reason=None, num_prompt=num_prompt,
                                 num_cached=num_cached, started=started)
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    def _check_remote(self, *, prompt_token_ids: list[int], params: SamplingParams,
                      source: RemotePrefill) -> _VerifiedImport:
        """Validate the request and the handoff against this pod (again: no path reaches the
        connector or the prefix cache unchecked); return the verified prompt and first token."""
        prompt = tuple(prompt_token_ids)  # a snapshot: what is checked is what is imported
        self._authenticate(source, prompt_token_ids=prompt)
        self._engine.engine.check_request(prompt_token_ids=list(prompt), params=params)
        return _VerifiedImport(prompt_token_ids=prompt, first_token_id=self._check_first_token(source))

    def _check_first_token(self, source: RemotePrefill) -> int:
        first = source.first_token_id
        if not 0 <= first < self._engine.engine.vocab_size:
            raise ValueError(f"kv_transfer_params.first_token_id {first} is outside the vocabulary")
        return first

    async def _reserve_import(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first: int,
    ) -> ImportReservation | Literal["stop"]:
        """Reserve blocks for the prompt plus ``first``; "stop" when a stop string inside the
        first token already finishes the request. Raises QueueFull when no room is found
        within IMPORT_WAIT_SECONDS."""
        engine = self._engine
        num_prompt = len(prompt_token_ids)

        def reserve(c: LLMEngine) -> ImportReservation | Literal["stop"] | None:
            try:
                return c.reserve_imported_request(
                    request_id=request_id, token_ids=[*prompt_token_ids, first], num_prompt_tokens=num_prompt,
                    params=params, num_imported_tokens=num_prompt)
            except ValueError as exc:
                if "already finish" in str(exc):  # a stop string inside the first token
                    return "stop"
                raise

        # A full KV cache or batch is usually momentary (running requests finish): wait a
        # bounded time for room rather than answering 429 at once; the prefill pod holds the
        # KV under a longer lease meanwhile.
        deadline = time.monotonic() + IMPORT_WAIT_SECONDS
        while True:
            try:
                reservation = await engine.call(reserve)
            except BaseException:  # cancelled while it ran: free whatever it reserved
                engine.abort(request_id)
                raise
            if reservation is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(IMPORT_RETRY_SECONDS)
        if reservation is None:
            core = engine.engine
            raise QueueFull(num_waiting=core.scheduler.num_waiting, max_queue_len=core.config.max_queue_len,
                            retry_after_seconds=1.0,
                            reason=f"no room (KV blocks or batch slots) for a {num_prompt}-token prompt "
                                   f"from prefill within {IMPORT_WAIT_SECONDS:.0f} s")
        return reservation

    async def _import_and_activate(
        self, *, request_id: str, params: SamplingParams, export: _PinnedExport,
        reservation: ImportReservation, num_prompt: int, num_remote_blocks: int,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pull the KV into ``reservation`` and activate the request; return its stream. Any
        failure aborts the reservation, which frees its blocks (engine thread)."""
        activated = False
        try:
            await self._pull_kv(export=export, reservation=reservation, num_prompt=num_prompt,
                                num_remote_blocks=num_remote_blocks)
            stream = await self._activate_stream(request_id=request_id, params=params)
            activated = True
        finally:
            if not activated:
                self._engine.abort(request_id)
        return stream

    async def _recompute_locally(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first: int,
    ) -> tuple[AsyncGenerator[RequestOutput, None], str]:
        """The pull failed: compute the prompt plus the prefill pod's first token here, as an
        ordinary queued request that continues after ``first`` (which is not sampled or
        streamed again, so greedy and seeded requests decode what the pull would have given).
        Returns the request's stream and the first token's text. (A stop string inside the
        first token was already handled by :meth:`_reserve_import`.)"""
        engine = self._engine
        num_prompt = len(prompt_token_ids)

        def add(core: LLMEngine) -> str:
            text = core.add_resumed_request(request_id=request_id, token_ids=[*prompt_token_ids, first],
                                            num_prompt_tokens=num_prompt, params=params)
            self._skip_prefill_draw(core, request_id=request_id, params=params)
            return text

        stream = engine.open_stream(request_id)
        try:
            text = await asyncio.shield(engine.call(add))
        except BaseException:
            engine.abort(request_id)
            self._spawn(_consume(stream))
            raise
        return stream, text

    async def _pull_kv(self, *, export: _PinnedExport, reservation: ImportReservation,
                       num_prompt: int, num_remote_blocks: int) -> None:
        """Fetch the blocks this pod lacks from the prefill pod straight into the reservation;
        the export is settled when this returns or raises KVTransferFailed."""
        source = export.source
        block_ids = reservation.block_ids
        runner = self._engine.engine.runner
        if source.kv_layout is not None or isinstance(runner, ParallelRunner):
            await self._pull_by_rank(export=export, reservation=reservation, num_prompt=num_prompt,
                                     num_remote_blocks=num_remote_blocks)
            return

        def on_block(index: int, data: memoryview) -> None:
            if not reservation.first_block_index <= index < num_remote_blocks:
                raise TransferError(code="protocol", message=f"block {index} outside the prompt")
            runner.write_block(block_ids[index], data)  # reserved: the engine thread ignores it

        try:
            result = await self._connector.fetch(
                endpoint=source.remote_endpoint, request_id=source.remote_request_id,
                first_block=reservation.first_block_index, layout=self.layout, on_block=on_block,
                timeout_seconds=self._fetch_timeout_seconds, expected_num_tokens=num_prompt)
        except TransferError as exc:
            if exc.code in NOTHING_TO_RELEASE_CODES:
                export.settled = True
            else:  # cut off mid-pull: the prefill pod still pins it (in the background: it may be gone)
                self._release_soon(export)
            raise KVTransferFailed(code=exc.code, message=exc.message) from None
        export.settled = True  # a fetch that returns has sent RELEASE
        if (result.num_tokens != num_prompt
                or result.num_blocks != num_remote_blocks - reservation.first_block_index):
            self._observe(0, 0.0, False)
            raise KVTransferFailed(code="prompt_mismatch", message=(
                f"the prefill pod sent {result.num_blocks} blocks of {result.num_tokens} tokens, "
                f"the prompt has {num_prompt}"))

    async def _pull_by_rank(self, *, export: _PinnedExport, reservation: ImportReservation,
                            num_prompt: int, num_remote_blocks: int) -> None:
        """Every rank of this pod pulls the slice it owns from the prefill ranks holding it;
        then the export is released on the prefill pod's main endpoint."""
        source = export.source
        runner = self._engine.engine.runner
        first_block = reservation.first_block_index
        order = PullOrder(pull_id=uuid.uuid4().hex, request_id=source.remote_request_id,
                          sources=source.sources(self.layout), first_block=first_block,
                          block_ids=tuple(reservation.block_ids[first_block:num_remote_blocks]),
                          num_tokens=num_prompt, layout=self.layout, timeout_seconds=self._fetch_timeout_seconds)
        if order.block_ids:
            if isinstance(runner, ParallelRunner):
                reports = await runner.pull(order, connector=self._connector)
                for report in reports[1:]:  # rank 0's transfers count in its connector
                    self._observe(report.num_bytes, report.seconds, report.ok)
            else:
                reports = [await pull_part(order, connector=self._connector, caches=runner.kv_caches, rank=0,
                                           mine=KVSlice.whole(self.layout))]
            self.rank_pulls.extend(reports)
            failed = next((report for report in reports if not report.ok), None)
            if failed is not None:  # free the prefill pod's blocks now (in the background: it may be gone)
                self._release_soon(export)
                raise KVTransferFailed(code=failed.code, message=f"decode rank {failed.rank}: {failed.message}")
        await self._release_remote(source, first_block=num_remote_blocks)
        export.settled = True

    async def _activate_stream(self, *, request_id: str,
                               params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Open the request's output stream, then let the engine schedule it."""
        engine = self._engine
        stream = engine.open_stream(request_id)
        try:
            await asyncio.shield(engine.call(lambda c: self._activate(c, request_id=request_id,
                                                                      params=params)))
        except BaseException:
            engine.abort(request_id)
            self._spawn(_consume(stream))
            raise
        return stream

    @staticmethod
    def _activate(core: LLMEngine, *, request_id: str, params: SamplingParams) -> None:
        HandoffEngine._skip_prefill_draw(core, request_id=request_id, params=params)
        core.activate_imported_request(request_id)

    @staticmethod
    def _skip_prefill_draw(core: LLMEngine, *, request_id: str, params: SamplingParams) -> None:
        if params.seed is not None and params.temperature > 0:  # the prefill pod drew one
            # noise row for the first token; draw it here too so the seed's sequence lines up
            core.runner.sampler.skip_draw(request_id, seed=params.seed)

    def _release_soon(self, export: _PinnedExport) -> None:
        """Release ``export`` on the prefill pod in the background (the caller may be
        cancelled, or in a generator's ``finally``); it is settled from here on."""
        export.settled = True
        self._spawn(self._release_remote(export.source, first_block=export.first_block))

    async def _release_remote(self, source: RemotePrefill, *, first_block: int) -> None:
        """Pull nothing, but tell the prefill pod to unpin now (else its lease does)."""
        try:
            await self._release_connector.fetch(
                endpoint=source.remote_endpoint, request_id=source.remote_request_id,
                first_block=first_block, layout=self.layout,
                on_block=lambda _i, _d: None, timeout_seconds=self._fetch_timeout_seconds,
                expected_num_tokens=source.num_prompt_tokens)
        except TransferError as exc:
            log.warning("could not release KV of %s on %s: %s", source.remote_request_id,
                        source.remote_endpoint, exc)

    @staticmethod
    def _first_output(*, request_id: str, first: int, text: str, finish_reason: str | None,
                      num_prompt: int, num_cached: int, started: float) -> RequestOutput:
        finished = finish_reason is not None
        return RequestOutput(request_id=request_id, new_token_ids=[first], new_text=text, new_logprobs=None,
                             finished=finished, finish_reason=finish_reason, num_prompt_tokens=num_prompt,
                             num_output_tokens=1, num_cached_tokens=num_cached,
                             ttft_seconds=time.monotonic() - started,
                             e2e_seconds=(time.monotonic() - started) if finished else None)


@dataclass(frozen=True)
class _Export:
    """A request's KV is exported; ``layout``: the ranks serving it (None: this endpoint alone);
    ``token_ids``: the tokens whose KV it is."""

    layout: KVRanks | None
    token_ids: list[int]


@dataclass(kw_only=True)
class _PinnedExport:
    """Decode role: the prefill pod's export of one import, pinned there until this pod pulls
    it (the pull's RELEASE unpins it) or releases it; ``settled`` once either is done or under
    way, or when there is nothing to release (parameters not trusted, a prefill pod that
    cannot be reached or no longer holds it). ``first_block``: where a pull of nothing starts
    (past the prompt's blocks), the release's FETCH."""

    source: RemotePrefill
    first_block: int
    settled: bool = False


@dataclass(frozen=True, kw_only=True)
class _VerifiedImport:
    """A handoff checked against the prompt (:meth:`HandoffEngine._check_remote`): the prompt's
    token ids as they were when their digest matched the signed one, and the first token. The
    import reserves (and so, at activation, indexes in the prefix cache) exactly these tokens."""

    prompt_token_ids: tuple[int, ...]
    first_token_id: int


async def _consume(stream: AsyncGenerator[RequestOutput, None]) -> None:
    """Drain an aborted stream so the engine forgets its queue."""
    with contextlib.suppress(Exception):
        async with contextlib.aclosing(stream):
            async for _ in stream:
                pass
