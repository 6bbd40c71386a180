"""Decode role: take a request whose prompt KV a prefill pod computed, and decode it here.

:meth:`KVImporter.accept` is where handoff parameters enter the decode pod: parsed once
(:meth:`~splitserve_contract.handoff.HandoffParams.from_json`; malformed is a ValueError, a
client's 400) and authenticated once (:meth:`~..transfer.HandoffAuth.verify_params`: signed
with the pool's key over the bytes that arrived, not expired, this pod's compat hash; without a
key, a loopback endpoint; with or without one, computed for exactly the prompt this pod
tokenized), raising :class:`~..engine.errors.HandoffRefused` (a 403) otherwise. What passes is a
:class:`VerifiedHandoff`, the only thing :meth:`KVImporter.generate` takes: nothing is
connected to, reserved or indexed for parameters that did not pass.

:meth:`KVImporter.generate` reserves blocks for the verified prompt (leading blocks this pod
already holds in its prefix cache are reused and not pulled; no room waits in
:class:`~.pending.PendingImports`), pulls the missing ones (:mod:`.pull`), then activates the
request with the prefill pod's first token and streams the rest. Reserved blocks are not
indexed in the prefix cache until activation, so a failed or partial transfer leaves no corrupt
block behind: the reservation is freed. The request is not lost then: the decode pod logs the
failure (WARNING, with the transfer error code; the connector counts it in the
transfer-failure metric) and computes the prompt plus the prefill pod's first token itself, as
an ordinary queued request that continues after that token (streamed once, as after a pull).
The same seeded request decodes the same tokens as on an aggregated pod: the decode side
advances the request's generator past the draw the prefill pod made.

Imported blocks are indexed in the prefix cache (at activation) under the block hashes of the
token ids the reservation was made for: the verified prompt, whose digest matched the signed
one, so KV computed for one prompt is never findable under another prompt's hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from splitserve_contract.handoff import FIRST_TOKEN_ID, HandoffParams

from ..engine.async_engine import AsyncEngine
from ..engine.errors import HandoffRefused, KVTransferFailed, QueueFull
from ..engine.handoff import ImportReservation
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.stop_checker import StopChecker
from ..transfer import HandoffAuth, HandoffRejected
from .background import BackgroundTasks
from .layout import KVRanks
from .pending import IMPORT_WAIT_SECONDS, PendingImports
from .pull import KVPuller, PinnedExport

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class VerifiedHandoff:
    """Handoff parameters that passed :meth:`KVImporter.accept` for ``prompt_token_ids`` (the
    prompt as it was when its digest matched the signed one); ``ranks``: the parallel prefill
    pod's layout, parsed."""

    params: HandoffParams
    ranks: KVRanks | None
    prompt_token_ids: tuple[int, ...]


class KVImporter:
    """The decode role of a handoff engine."""

    def __init__(
        self, *, engine: AsyncEngine, auth: HandoffAuth, compat_hash: str, puller: KVPuller, background: BackgroundTasks
    ) -> None:
        self._engine = engine
        self._auth = auth
        self._compat_hash = compat_hash
        self._puller = puller
        self._background = background
        self._pending = PendingImports(engine)

    # ------------------------------------------------------------------ where params come in
    def accept(self, raw: Mapping[str, Any] | HandoffParams, *, prompt_token_ids: Sequence[int]) -> VerifiedHandoff:
        """Parse and authenticate handoff parameters once, for the prompt this pod tokenized.
        Raises ValueError (malformed, or a first token outside this pod's vocabulary) or
        HandoffRefused (not from a prefill pod of this pool, or for another prompt)."""
        params = raw if isinstance(raw, HandoffParams) else HandoffParams.from_json(raw)
        ranks = None if params.kv_layout is None else KVRanks.from_json(dict(params.kv_layout))
        prompt = tuple(prompt_token_ids)  # a snapshot: what is checked is what is imported
        try:
            self._auth.verify_params(params, compat_hash=self._compat_hash, prompt_token_ids=prompt)
        except HandoffRejected as exc:
            log.warning("refused handoff parameters naming %r (code %s)", params.remote_endpoint[:100], exc.code)
            raise HandoffRefused(code=exc.code, message=str(exc)) from None
        first = params.first_token_id
        if not 0 <= first < self._engine.engine.vocab_size:
            raise ValueError(f"kv_transfer_params.{FIRST_TOKEN_ID} {first} is outside the vocabulary")
        return VerifiedHandoff(params=params, ranks=ranks, prompt_token_ids=prompt)

    # ------------------------------------------------------------------ the import
    async def generate(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        source: VerifiedHandoff,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pull the prompt's KV named by ``source`` and continue decoding here. A prompt other
        than the verified one is refused before anything is connected to; a request refused or
        failed after that (a KV-capacity 400, no room in time, a failed pull, a client gone)
        releases the export on the prefill pod at once rather than leave it pinned there for
        the lease (``--kv-ttl-seconds``)."""
        core = self._engine.engine
        started = time.monotonic()
        export = PinnedExport(
            params=source.params,
            ranks=source.ranks,
            first_block=math.ceil(len(prompt_token_ids) / core.block_manager.block_size),
        )
        try:
            if tuple(prompt_token_ids) != source.prompt_token_ids:  # not what was verified
                export.settled = True  # the endpoint is not connected to for this prompt
                raise HandoffRefused(
                    code="prompt_mismatch",
                    message=(
                        "KV handoff refused (prompt_mismatch): the handoff parameters were verified for another prompt"
                    ),
                )
            self._engine.engine.check_request(prompt_token_ids=list(source.prompt_token_ids), params=params)
            async with contextlib.aclosing(
                self._import(request_id=request_id, source=source, params=params, export=export, started=started)
            ) as outputs:
                async for out in outputs:
                    yield out
        finally:
            if not export.settled:  # refused or failed before the pull: unpin it there now
                self._puller.release_soon(export)

    async def _import(
        self,
        *,
        request_id: str,
        source: VerifiedHandoff,
        params: SamplingParams,
        export: PinnedExport,
        started: float,
    ) -> AsyncGenerator[RequestOutput, None]:
        """:meth:`generate` once the prompt is the verified one; settles ``export`` (pulls or
        releases it) on every path that gets that far."""
        core = self._engine.engine
        prompt_token_ids = list(source.prompt_token_ids)  # from here on: the verified tokens only
        first = source.params.first_token_id
        num_prompt = len(prompt_token_ids)
        num_remote_blocks = math.ceil(num_prompt / core.block_manager.block_size)
        token_reason = StopChecker(params=params, eos_token_ids=core.eos_token_ids, detokenizer=None).check_token(
            token_id=first, num_output_tokens=1
        )
        if token_reason is not None:  # the first token already ends it: nothing to decode
            await self._puller.release(source.params, first_block=num_remote_blocks)
            export.settled = True
            text = "" if token_reason == "stop" else self._engine.tokenizer.decode([first])
            yield _first_output(
                request_id=request_id,
                first=first,
                text=text,
                finish_reason=token_reason,
                num_prompt=num_prompt,
                num_cached=0,
                started=started,
            )
            return
        reservation = await self._reserve(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, first=first
        )
        if reservation == "stop":
            await self._puller.release(source.params, first_block=num_remote_blocks)
            export.settled = True
            yield _first_output(
                request_id=request_id,
                first=first,
                text="",
                finish_reason="stop",
                num_prompt=num_prompt,
                num_cached=0,
                started=started,
            )
            return
        num_cached = reservation.num_cached_tokens
        text = reservation.imported_text
        try:
            stream = await self._pull_and_activate(
                request_id=request_id,
                params=params,
                export=export,
                reservation=reservation,
                num_prompt=num_prompt,
                num_remote_blocks=num_remote_blocks,
            )
        except KVTransferFailed as exc:  # the reservation is freed; the prompt is still here
            log.warning(
                "KV pull for request %s from %s failed (code %s): %s; computing the prompt on this pod",
                request_id,
                source.params.remote_endpoint,
                exc.code,
                exc,
            )
            stream, text = await self._recompute_locally(
                request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, first=first
            )
            num_cached = 0
        yield _first_output(
            request_id=request_id,
            first=first,
            text=text,
            finish_reason=None,
            num_prompt=num_prompt,
            num_cached=num_cached,
            started=started,
        )
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    async def _reserve(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first: int,
    ) -> ImportReservation | Literal["stop"]:
        """Reserve blocks for the prompt plus ``first``; "stop" when a stop string inside the
        first token already finishes the request. Raises QueueFull when no room is found
        within IMPORT_WAIT_SECONDS (the engine thread wakes this as soon as there is)."""
        num_prompt = len(prompt_token_ids)

        def reserve(c: LLMEngine) -> ImportReservation | Literal["stop"] | None:
            try:
                return c.reserve_imported_request(
                    request_id=request_id,
                    token_ids=[*prompt_token_ids, first],
                    num_prompt_tokens=num_prompt,
                    params=params,
                    num_imported_tokens=num_prompt,
                )
            except ValueError as exc:
                if "already finish" in str(exc):  # a stop string inside the first token
                    return "stop"
                raise

        try:
            reservation = await self._pending.reserve(reserve, wait_seconds=IMPORT_WAIT_SECONDS)
        except BaseException:  # cancelled while it waited: free whatever it reserved
            self._engine.abort(request_id)
            raise
        if reservation is None:
            core = self._engine.engine
            raise QueueFull(
                num_waiting=core.scheduler.num_waiting,
                max_queue_len=core.config.max_queue_len,
                retry_after_seconds=1.0,
                reason=f"no room (KV blocks or batch slots) for a {num_prompt}-token prompt "
                f"from prefill within {IMPORT_WAIT_SECONDS:.0f} s",
            )
        return reservation

    async def _pull_and_activate(
        self,
        *,
        request_id: str,
        params: SamplingParams,
        export: PinnedExport,
        reservation: ImportReservation,
        num_prompt: int,
        num_remote_blocks: int,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pull the KV into ``reservation`` and activate the request; return its stream. Any
        failure aborts the reservation, which frees its blocks (engine thread)."""
        activated = False
        try:
            await self._puller.pull(
                export=export, reservation=reservation, num_prompt=num_prompt, num_remote_blocks=num_remote_blocks
            )
            stream, _ = await self._open_and_run(
                request_id, lambda core: _activate(core, request_id=request_id, params=params)
            )
            activated = True
        finally:
            if not activated:
                self._engine.abort(request_id)
        return stream

    async def _recompute_locally(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first: int,
    ) -> tuple[AsyncGenerator[RequestOutput, None], str]:
        """The pull failed: compute the prompt plus the prefill pod's first token here, as an
        ordinary queued request that continues after ``first`` (which is not sampled or
        streamed again, so greedy and seeded requests decode what the pull would have given).
        Returns the request's stream and the first token's text. (A stop string inside the
        first token was already handled by :meth:`_reserve`.)"""
        num_prompt = len(prompt_token_ids)

        def add(core: LLMEngine) -> str:
            text = core.add_resumed_request(
                request_id=request_id, token_ids=[*prompt_token_ids, first], num_prompt_tokens=num_prompt, params=params
            )
            _skip_prefill_draw(core, request_id=request_id, params=params)
            return text

        return await self._open_and_run(request_id, add)

    async def _open_and_run(
        self,
        request_id: str,
        start: Callable[[LLMEngine], T],
    ) -> tuple[AsyncGenerator[RequestOutput, None], T]:
        """Open the request's output stream, then run ``start(core)`` on the engine thread to
        let the engine schedule it; on failure the request is aborted and its stream drained."""
        engine = self._engine
        stream = engine.open_stream(request_id)
        try:
            result = await asyncio.shield(engine.call(start))
        except BaseException:
            engine.abort(request_id)
            self._background.spawn(_consume(stream))
            raise
        return stream, result


def _activate(core: LLMEngine, *, request_id: str, params: SamplingParams) -> None:
    _skip_prefill_draw(core, request_id=request_id, params=params)
    core.activate_imported_request(request_id)


def _skip_prefill_draw(core: LLMEngine, *, request_id: str, params: SamplingParams) -> None:
    if params.seed is not None and params.temperature > 0:  # the prefill pod drew one
        # noise row for the first token; draw it here too so the seed's sequence lines up
        core.runner.sampler.skip_draw(request_id, seed=params.seed)


def _first_output(
    *,
    request_id: str,
    first: int,
    text: str,
    finish_reason: str | None,
    num_prompt: int,
    num_cached: int,
    started: float,
) -> RequestOutput:
    finished = finish_reason is not None
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[first],
        new_text=text,
        new_logprobs=None,
        finished=finished,
        finish_reason=finish_reason,
        num_prompt_tokens=num_prompt,
        num_output_tokens=1,
        num_cached_tokens=num_cached,
        ttft_seconds=time.monotonic() - started,
        e2e_seconds=(time.monotonic() - started) if finished else None,
    )


async def _consume(stream: AsyncGenerator[RequestOutput, None]) -> None:
    """Drain an aborted stream so the engine forgets its queue."""
    with contextlib.suppress(Exception):
        async with contextlib.aclosing(stream):
            async for _ in stream:
                pass
