"""``LLMEngine``: the synchronous engine core — add requests, step, collect outputs.

One :meth:`LLMEngine.step` = schedule (:mod:`.scheduler`) → run the model and sample
(:mod:`.model_runner`) → append tokens, check stop conditions (:mod:`.stop_checker`) and
emit one :class:`~.outputs.RequestOutput` delta per request that produced something. The
engine is single-threaded by design; :mod:`.async_engine` drives it from a background
thread for the server.

**Asynchronous scheduling** (``EngineConfig.async_scheduling``, :mod:`.step_overlap`): one
step stays in flight; step n+1 is scheduled, built and launched while step n runs, then step
n's tokens are appended and their outputs built while step n+1 runs. Each :meth:`LLMEngine.step`
still returns the outputs of one model step. A request that step n ends computes one extra
row in step n+1, which is dropped.

Without it, on CUDA the per-token text work (detokenization, stop strings, building outputs)
of step n runs while step n+1 computes on the device ("output overlap"): token-id checks
(eos, stop tokens, lengths) still happen at once, so only a request ended by a stop string
computes one token too many, which is dropped.

The engine's other jobs live beside it: the per-token path from sampled ids to outputs in
:mod:`.engine_request`, speculative propose/verify in :mod:`.speculative` (its
:class:`~.speculative.SpeculativeDecoder`), the stats snapshot in :mod:`.stats`.

:meth:`LLMEngine.from_args` builds the whole stack from ``ServeArgs`` (:mod:`.loading`).
The prefill → decode KV handoff hooks (``keep_kv``, ``reserve_imported_request`` …) are
described in :mod:`.handoff`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from splitserve_contract import ServeArgs

from .admission import check_request, warn_if_kv_cache_short
from .block_manager import BlockManager
from .config import EngineConfig
from .cuda_graphs import decode_buckets
from .draft import DraftModel
from .engine_request import EngineRequest, TokenOutputs, output_of
from .errors import DuplicateRequestId
from .handoff import ImportReservation, KeptKV
from .kv_budget import KVCacheSpec
from .loading import engine_from_args
from .model_runner import ModelRunner, measure_num_kv_blocks
from .outputs import FINISH_ABORT, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .speculative import Emitted, SpeculativeConfig, SpeculativeDecoder
from .stats import EngineStats, engine_stats
from .step_inputs import CausalLM
from .step_overlap import ForwardThread, InFlightStep, resolve_async_scheduling
from .step_overlap import launch as launch_async
from .step_work import StepCounters, StepWork, step_work
from .stop_checker import DetokenizerFactory, StopChecker

log = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING


class LLMEngine:
    """Synchronous engine; not thread-safe (one thread calls every method)."""

    def __init__(
        self,
        *,
        model: CausalLM,
        kv_spec: KVCacheSpec,
        vocab_size: int,
        config: EngineConfig,
        device: torch.device,
        eos_token_ids: Iterable[int] = (),
        detokenizer_factory: DetokenizerFactory | None = None,
        model_name: str = "",
        tokenizer: object | None = None,
        overlap_output_processing: bool | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_model: CausalLM | None = None,
        draft_kv_spec: KVCacheSpec | None = None,
        runner_factory: Callable[..., ModelRunner] = ModelRunner,
    ) -> None:
        self.config = config
        self.speculative = speculative or SpeculativeConfig()
        if (self.speculative.method == "draft") != (draft_model is not None and draft_kv_spec is not None):
            raise ValueError("speculative method draft needs a draft model (and only it does)")
        self.overlap_output_processing = (
            device.type == "cuda" if overlap_output_processing is None else overlap_output_processing
        )
        self._outputs = TokenOutputs(finish=self._finish)
        self._kept_kv: dict[str, KeptKV] = {}
        self._reserved: dict[str, tuple[EngineRequest, int]] = {}  # request, imported tokens
        self.device = device
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._detokenizer_factory = detokenizer_factory
        torch.manual_seed(config.seed)
        draft_bytes = draft_kv_spec.bytes_per_block(block_size=config.block_size) if draft_kv_spec else 0
        num_blocks = config.num_kv_blocks or measure_num_kv_blocks(
            model=model,
            spec=kv_spec,
            device=device,
            block_size=config.block_size,
            kv_memory_fraction=config.kv_memory_fraction,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            extra_bytes_per_block=draft_bytes,
        )
        draft = (
            DraftModel(
                model=draft_model,
                spec=draft_kv_spec,
                device=device,
                block_size=config.block_size,
                num_blocks=num_blocks,
            )
            if draft_model is not None and draft_kv_spec is not None
            else None
        )
        self.block_manager = BlockManager(
            num_blocks=num_blocks, block_size=config.block_size, enable_prefix_caching=config.prefix_caching
        )
        self.scheduler = Scheduler(
            config=SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                chunked_prefill=config.chunked_prefill,
            ),
            block_manager=self.block_manager,
        )
        self.runner = runner_factory(
            model=model,
            spec=kv_spec,
            device=device,
            block_size=config.block_size,
            num_blocks=num_blocks,
            eos_token_ids=self.eos_token_ids,
        )
        self.runner.block_tables = self.block_manager.tables
        self.speculation = SpeculativeDecoder(
            self.speculative, draft=draft, max_model_len=config.max_model_len, sampler=self.runner.sampler
        )
        if config.cuda_graphs:
            self.runner.capture_decode_graphs(
                max_model_len=config.max_model_len, buckets=decode_buckets(config.max_num_seqs)
            )
        self.async_scheduling = resolve_async_scheduling(
            config.async_scheduling, speculative=self.speculative, runner=self.runner
        )
        """Whether steps are scheduled one ahead of the model (see :mod:`.step_overlap`)."""
        self._inflight: InFlightStep | None = None
        self._forward_thread = ForwardThread() if self.async_scheduling and device.type != "cuda" else None
        self._requests: dict[str, EngineRequest] = {}
        self.on_close: list[Callable[[], None]] = []
        """Run by :meth:`close` (a tensor-parallel engine stops its worker ranks there)."""
        self._steps_total = 0
        self._step_counters = StepCounters()
        self._finished_work: list[StepWork] = []
        """The steps the current :meth:`step` call finished (timed by it, :mod:`.step_work`)."""
        self._launched_work: deque[StepWork] = deque()
        """Asynchronous scheduling: the work of the steps launched and not finished, oldest first."""
        self.stalled = False
        """Whether the last :meth:`step` could do nothing (every waiting or preempted request
        waits for KV blocks held elsewhere): until a request is added, aborted or released,
        stepping again changes nothing, so a driver may wait for one instead of spinning."""
        log.info("engine ready: %d KV blocks of %d tokens on %s", num_blocks, config.block_size, device)
        warn_if_kv_cache_short(num_blocks=num_blocks, block_size=config.block_size, max_model_len=config.max_model_len)

    @property
    def forward_busy_seconds(self) -> float | None:
        """Asynchronous scheduling on the CPU: the forward thread's busy time so far
        (:attr:`.step_overlap.ForwardThread.busy_seconds`); None without a forward thread."""
        return self._forward_thread.busy_seconds if self._forward_thread is not None else None

    def close(self) -> None:
        """Release what outlives the object (worker processes); the engine is unusable after."""
        if self._forward_thread is not None:
            self._forward_thread.close()
        callbacks, self.on_close = self.on_close, []
        for callback in callbacks:
            callback()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_args(cls, args: ServeArgs) -> LLMEngine:
        """Resolve the model URI and build model, tokenizer and engine (see :mod:`.loading`)."""
        return engine_from_args(args, engine_class=cls)

    # ------------------------------------------------------------------ requests
    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds: a request of ``prompt + max_tokens`` tokens fits
        when ``prompt + max_tokens - 1`` do (the last sampled token is never cached)."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def check_request(self, *, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Admission checks that need no engine state (safe from any thread; :mod:`.admission`)."""
        check_request(
            prompt_token_ids=prompt_token_ids,
            params=params,
            vocab_size=self.vocab_size,
            max_model_len=self.config.max_model_len,
            has_tokenizer=self._detokenizer_factory is not None,
            block_manager=self.block_manager,
        )

    def add_request(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time_s: float | None = None,
        keep_kv: bool = False,
    ) -> None:
        """Queue a request. ``keep_kv``: pin its KV when it finishes (see :mod:`.handoff`)."""
        request = self._new_request(
            request_id=request_id,
            token_ids=prompt_token_ids,
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            arrival_time_s=arrival_time_s,
        )
        request.keep_kv = keep_kv
        self._requests[request_id] = request
        self.scheduler.add(request)

    def _new_request(
        self,
        *,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        arrival_time_s: float | None,
    ) -> EngineRequest:
        if request_id in self._requests or request_id in self._reserved:
            raise DuplicateRequestId(f"request id {request_id!r} is already in flight")
        prompt = list(token_ids[:num_prompt_tokens])
        self.check_request(prompt_token_ids=prompt, params=params)
        detok = self._detokenizer_factory(prompt) if self._detokenizer_factory else None
        return EngineRequest.create(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s,
            stop=StopChecker(params=params, eos_token_ids=self.eos_token_ids, detokenizer=detok),
            max_model_len=self.config.max_model_len,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks; returns its final output (None if unknown)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            self.cancel_imported_request(request_id)
            return None
        self._outputs.drop_pending(request_id)
        self.scheduler.abort(request_id)
        self._release_sampler(request_id)
        return output_of(
            request,
            new_token_ids=[],
            new_logprobs=None,
            finish_reason=FINISH_ABORT,
            now=time.monotonic(),
            ttft=None,
            itl=[],
        )

    def has_unfinished(self) -> bool:
        """Requests in flight, or outputs not yet returned."""
        return bool(self._requests) or bool(self._outputs.pending)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one model step and return the outputs it produced.

        With output overlap, the text of step n's tokens (detokenization, stop strings,
        :class:`RequestOutput`) is processed during step n+1 while the device computes, and
        returned by that call; a request a stop string ends that way has its one extra token
        dropped. Without it (the CPU default) every output is returned by its own step.
        With asynchronous scheduling the call returns the outputs of the step launched by the
        call before (or by this one, when none was in flight) and leaves the next in flight.

        A call that finished a step is timed as a whole for the engine-step counters
        (:mod:`.step_work`); a call that finds nothing to do counts nothing.
        """
        started = time.monotonic()
        self._finished_work.clear()
        outputs = self._step_async() if self.async_scheduling else self._step_sync()
        if self._finished_work:
            self._step_counters.add(self._finished_work, seconds=time.monotonic() - started)
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, append: one step, synchronously."""
        speculation = self.speculation
        proposed = speculation.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if proposed:
            proposed = speculation.keep_scheduled(proposed, sched)
        outputs = self._scheduler_finished(sched)
        if sched.is_empty:
            outputs.extend(self._outputs.process_pending())
            self.stalled = not (outputs or sched.preempted or sched.finished)
            return outputs
        self.stalled = False
        self._finished_work.append(step_work(sched))  # counted if the step completes
        launched = self.runner.launch(sched)
        if self.overlap_output_processing:
            outputs.extend(self._outputs.process_pending())  # runs while the device computes
        result = launched.pending.resolve()
        failed = self._outputs.fail_non_finite(launched.sample_seqs, result.non_finite_rows)
        if proposed:
            emitted = speculation.verify(launched.sample_seqs, result.token_ids, result.logprobs)
        self.scheduler.on_step_done(sched)
        self._steps_total += 1
        now = time.monotonic()
        if proposed:
            self._append_verified(proposed, emitted, now=now)
        else:
            self._outputs.append(
                launched.sample_seqs,
                result.token_ids,
                result.logprobs,
                now=now,
                outputs=None if self.overlap_output_processing else outputs,
            )
        if not self.overlap_output_processing:
            outputs.extend(self._outputs.process_pending())
        outputs.extend(failed)
        return outputs

    def _append_verified(self, proposed: list[Sequence], emitted: list[Emitted], *, now: float) -> None:
        """Append a verified step's tokens one at a time (their text waits, as with output
        overlap), committing the blocks that accepted tokens fill as they are appended."""
        verified = {id(seq) for seq in proposed}
        for seq, token_id, logprob in emitted:
            if seq.is_finished:  # a stop string (or a stop token) ended it already
                continue
            if id(seq) in verified:
                self.block_manager.commit(seq, num_tokens=min(seq.num_computed_tokens, seq.num_tokens))
            self._outputs.append([seq], [token_id], [logprob], now=now, outputs=None)
        for seq in proposed:
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.commit(seq)

    def _step_async(self) -> list[RequestOutput]:
        """Keep one step in flight: schedule and launch the next, then finish the one before."""
        inflight = self._inflight
        outputs: list[RequestOutput] = []
        if inflight is None:
            sched = self.scheduler.schedule()
            outputs = self._scheduler_finished(sched)
            if sched.is_empty:
                self.stalled = not (outputs or sched.preempted or sched.finished)
                return outputs
            inflight = self._launch_async(sched, after=None)
        self.stalled = False
        # while `inflight` runs: the next step, with its tokens pending
        sched = self.scheduler.schedule()
        outputs.extend(self._scheduler_finished(sched))
        self._inflight = None if sched.is_empty else self._launch_async(sched, after=inflight)
        # then `inflight`'s tokens, while the next step runs
        result = inflight.resolve()
        failed = self._outputs.fail_non_finite(inflight.sample_seqs, result.non_finite_rows)
        self._steps_total += 1
        self._finished_work.append(self._launched_work.popleft())
        bm = self.block_manager
        if bm.enable_prefix_caching:  # index the blocks the step filled, before a finish frees them
            done = inflight.sched
            for seq in [chunk.seq for chunk in done.prefills] + done.decodes:
                if seq.status is _RUNNING:  # (known tokens only: not the next step's pending one)
                    num_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
                    if num_tokens // bm.block_size > seq.num_registered_blocks:
                        bm.commit(seq, num_tokens=num_tokens)
        self._outputs.append(
            inflight.sample_seqs, result.token_ids, result.logprobs, now=time.monotonic(), outputs=outputs
        )
        outputs.extend(failed)
        if self._inflight is not None and not self._requests:
            self._inflight.wait()  # only dropped rows of finished requests: nothing to wait for later
            self._inflight = None
            self._finished_work.append(self._launched_work.popleft())  # it ran: busy time and work
        if self._inflight is None and self._forward_thread is not None:
            self._forward_thread.flush()  # idle from here: queued sampler releases have run
        return outputs

    def _launch_async(self, sched: SchedulerOutput, *, after: InFlightStep | None) -> InFlightStep:
        self._launched_work.append(step_work(sched))  # before on_step_launched advances the counters
        step = launch_async(self.runner, sched, after=after, thread=self._forward_thread)
        self.scheduler.on_step_launched(sched)
        return step

    def _scheduler_finished(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Outputs of the sequences the scheduler ended (they could never fit in the KV cache),
        after their earlier tokens' outputs."""
        outputs: list[RequestOutput] = []
        if not sched.finished:
            return outputs
        outputs.extend(self._outputs.process_pending())
        now = time.monotonic()
        for seq in sched.finished:
            request = self._requests.pop(seq.request_id)
            self._release_sampler(seq.request_id)
            outputs.append(
                output_of(
                    request,
                    new_token_ids=[],
                    new_logprobs=None,
                    finish_reason=seq.finish_reason,
                    now=now,
                    ttft=None,
                    itl=[],
                )
            )
        return outputs

    def _release_sampler(self, request_id: str) -> None:
        """Forget a request's sampler state after every step that samples it has sampled."""
        sampler = self.runner.sampler
        if self._forward_thread is not None and self._inflight is not None:
            self._forward_thread.submit(lambda: sampler.release(request_id))
        else:
            sampler.release(request_id)

    def _finish(self, seq: EngineRequest, *, reason: str) -> None:
        if seq.keep_kv and seq.request_id in self._requests:
            if self._inflight is not None and seq.num_computed_tokens >= seq.num_tokens:
                self._inflight.wait()  # its dropped row is still being written into its blocks
            self._keep_kv(seq)
        self.scheduler.finish(seq, reason=reason)
        self._release_sampler(seq.request_id)
        self._requests.pop(seq.request_id, None)

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        return engine_stats(
            scheduler=self.scheduler,
            block_manager=self.block_manager,
            outputs=self._outputs,
            speculation=self.speculation,
            steps_total=self._steps_total,
            steps=self._step_counters,
        )

    # ------------------------------------------------------------------ KV handoff
    def _keep_kv(self, seq: Sequence) -> None:
        bm = self.block_manager
        # the last token (the one that ended it) is never computed; with asynchronous
        # scheduling the step in flight may count it already
        num_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        block_ids = seq.block_table[: bm.num_blocks_for(num_tokens)]
        bm.pin_blocks(block_ids)
        self._kept_kv[seq.request_id] = KeptKV(
            request_id=seq.request_id,
            token_ids=seq.token_ids[:num_tokens],
            block_ids=block_ids,
            block_hashes=list(bm.block_hashes_of(seq)[: num_tokens // bm.block_size]),
        )

    def kept_kv(self, request_id: str) -> KeptKV | None:
        """The pinned KV of a finished ``keep_kv`` request, if not released yet."""
        return self._kept_kv.get(request_id)

    def release_kept_kv(self, request_id: str) -> bool:
        """Unpin a finished request's kept KV; False if there was none."""
        kept = self._kept_kv.pop(request_id, None)
        if kept is None:
            return False
        self.block_manager.unpin_blocks(kept.block_ids)
        return True

    def reserve_imported_request(
        self,
        *,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        num_imported_tokens: int,
        arrival_time_s: float | None = None,
    ) -> ImportReservation | None:
        """Hold blocks for the first ``num_imported_tokens`` of ``token_ids`` (computed on
        another pod). ``token_ids`` is the prompt plus any tokens already generated there;
        at least the last token must stay uncomputed. Tokens after the prompt count toward
        ``max_tokens`` and are not streamed again. Returns None when the KV cache or the
        running batch is full (nothing reserved)."""
        if not 1 <= num_imported_tokens < len(token_ids):
            raise ValueError(f"num_imported_tokens must be in [1, {len(token_ids) - 1}], got {num_imported_tokens}")
        if not 1 <= num_prompt_tokens <= len(token_ids):
            raise ValueError(f"num_prompt_tokens must be in [1, {len(token_ids)}]")
        request = self._new_request(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            arrival_time_s=arrival_time_s,
        )
        if self.scheduler.num_running + len(self._reserved) >= self.config.max_num_seqs:
            return None
        if self._inflight is not None:  # blocks it frees may still be written by the step in flight
            self._inflight.wait()
        num_cached = self.block_manager.allocate_for_known_prefix(seq=request, num_tokens=num_imported_tokens)
        if num_cached is None:
            return None
        try:
            imported_text = self._replay_imported_tokens(request)
        except ValueError:
            self.block_manager.free(request)
            raise
        request.num_cached_tokens = num_cached
        self._reserved[request_id] = (request, num_imported_tokens)
        return ImportReservation(
            request_id=request_id,
            block_ids=list(request.block_table),
            num_cached_tokens=num_cached,
            block_size=self.block_manager.block_size,
            imported_text=imported_text,
        )

    def add_resumed_request(
        self,
        *,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        arrival_time_s: float | None = None,
    ) -> str:
        """Queue a request whose first output tokens were generated on another pod but whose
        KV never arrived (decode role, a failed pull): ``token_ids`` is the prompt plus those
        tokens, all computed here as one prefill. The tokens after the prompt count toward
        ``max_tokens`` and are not streamed again; returns their text (as
        ``ImportReservation.imported_text``). Raises ValueError if they already finish it."""
        if not 1 <= num_prompt_tokens < len(token_ids):
            raise ValueError(f"num_prompt_tokens must be in [1, {len(token_ids) - 1}], got {num_prompt_tokens}")
        request = self._new_request(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            arrival_time_s=arrival_time_s,
        )
        imported_text = self._replay_imported_tokens(request)
        self._mark_first_token_elsewhere(request)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return imported_text

    @staticmethod
    def _mark_first_token_elsewhere(request: EngineRequest) -> None:
        """The first token came from another pod and its TTFT was recorded with it
        (:class:`~.remote.HandoffEngine`): this engine's first token is an inter-token gap,
        measured from now, not a second TTFT."""
        request.first_token_time_s = request.last_token_time_s = time.monotonic()

    def _replay_imported_tokens(self, request: EngineRequest) -> str:
        """Feed the output tokens generated elsewhere (already streamed) through the stop
        checker; return their text. Raises ValueError if they already finish the request."""
        for index, token_id in enumerate(request.output_token_ids, start=1):
            reason = request.stop.check_token(token_id=token_id, num_output_tokens=index)
            reason = request.stop.append_text(token_id=token_id, num_output_tokens=index, token_reason=reason)
            if reason is not None:
                raise ValueError(f"the imported tokens already finish request {request.request_id!r} ({reason})")
        return request.stop.take_new_text(finished=False)

    def activate_imported_request(self, request_id: str) -> None:
        """The reserved blocks are filled: index them and start decoding."""
        reserved = self._reserved.pop(request_id, None)
        if reserved is None:
            raise KeyError(f"no reserved import {request_id!r}")
        request, num_imported_tokens = reserved
        self.block_manager.mark_computed(seq=request, num_tokens=num_imported_tokens)
        self._requests[request_id] = request
        request.prompt_counted = True  # the prompt was counted where it was computed
        self._mark_first_token_elsewhere(request)
        self.scheduler.add_running(request)

    def cancel_imported_request(self, request_id: str) -> bool:
        """Free a reservation whose transfer failed; False if there was none."""
        reserved = self._reserved.pop(request_id, None)
        if reserved is None:
            return False
        self.block_manager.free(reserved[0])
        return True
