"""A request as the engine holds it, and the per-token path from sampled ids to outputs.

Why a module of its own: the step loop (:mod:`.llm_engine`) decides *when* tokens are appended
and their text processed (at once, or overlapped with the next forward); what appending a
token means (timing, stop checks, the output delta) is the same in every mode, and is here.

A step of hundreds of decodes is bookkeeping-bound on a fast device, so
:meth:`TokenOutputs.append` makes no call per token beyond the output's construction unless a
request has text to build or stops; with output overlap the text part waits in
:attr:`TokenOutputs.pending` until :meth:`TokenOutputs.process_pending` runs while the next
step computes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol, cast

from .outputs import (
    ERROR_NON_FINITE_LOGITS,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    RequestOutput,
    TokenLogprob,
    new_output,
)
from .sampling_params import SamplingParams
from .sequence import Sequence, SequenceStatus
from .stop_checker import StopChecker

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True, slots=True)
class EngineRequest(Sequence):
    """A request the engine holds: the sequence the scheduler sees, plus what only the engine
    reads. One object, so the per-token loop reaches a row's stop conditions without a dict
    look-up or a second object: after a forward that evicted the host's caches each object a
    row touches is a cache miss, hundreds per step."""

    stop: StopChecker
    stop_token_ids: frozenset[int] | None
    """:attr:`StopChecker.stop_token_ids`, None when empty (nothing to look up)."""
    min_tokens: int
    token_limit: int
    """The length (all tokens) at which it ends: ``max_tokens`` outputs or ``max_model_len``."""
    needs_text: bool
    """:attr:`StopChecker.needs_text`."""
    prompt_counted: bool = False
    keep_kv: bool = False

    @classmethod
    def create(
        cls,
        *,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        arrival_time_s: float,
        stop: StopChecker,
        max_model_len: int,
    ) -> EngineRequest:
        """A new request of ``token_ids`` (its prompt, then any output tokens it brings along)."""
        return cls(
            request_id=request_id,
            token_ids=list(token_ids),
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            arrival_time_s=arrival_time_s,
            stop=stop,
            stop_token_ids=stop.stop_token_ids or None,
            min_tokens=stop.min_tokens,
            token_limit=min(num_prompt_tokens + stop.max_tokens, max_model_len),
            needs_text=stop.needs_text,
        )


PendingToken = tuple[EngineRequest, int, TokenLogprob | None, int, str | None, float, float | None, list[float]]
"""A sampled token whose text and output are not processed yet: request, token id, logprob,
output tokens so far, the token's own finish reason, time, TTFT, ITL."""

_FINISHED = SequenceStatus.FINISHED


class Finish(Protocol):
    """Ends a request in the engine (scheduler, sampler state, a kept KV): ``LLMEngine._finish``."""

    def __call__(self, seq: EngineRequest, *, reason: str) -> None: ...


class TokenOutputs:
    """Appends sampled tokens to their requests and turns them into :class:`RequestOutput`
    deltas; counts the prompt and generated tokens (``prompt_tokens_total``,
    ``generation_tokens_total`` of :class:`~.stats.EngineStats`)."""

    def __init__(self, *, finish: Finish) -> None:
        self._finish = finish
        self.pending: list[PendingToken] = []
        """Appended tokens whose text and output wait for :meth:`process_pending`."""
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def append(
        self,
        seqs: list[Sequence],
        token_ids: list[int],
        logprobs: list[TokenLogprob | None],
        *,
        now: float,
        outputs: list[RequestOutput] | None,
    ) -> None:
        """Append one sampled token to each of ``seqs`` (skipping those already finished), time
        it and check its id for a stop. With ``outputs`` the text part and the output follow at
        once (appended there); without, the token waits in :attr:`pending` (output overlap).
        Every sequence the scheduler holds is one of the engine's :class:`EngineRequest`."""
        num_generated = 0
        requests = cast(list[EngineRequest], seqs)
        for seq, token_id, logprob in zip(requests, token_ids, logprobs, strict=True):
            if seq.status is _FINISHED:  # ended while the step ran (aborted, or a stop on its
                continue  # previous token with the step already launched)
            if not seq.prompt_counted:
                seq.prompt_counted = True
                self.prompt_tokens_total += seq.num_prompt_tokens
            tokens = seq.token_ids
            tokens.append(token_id)
            if seq.num_pending_tokens:
                seq.num_pending_tokens -= 1
            num_generated += 1
            ttft: float | None = None
            itl: list[float] = []
            if seq.first_token_time_s is None:
                seq.first_token_time_s = now
                ttft = now - seq.arrival_time_s
            elif seq.last_token_time_s is not None:
                itl = [now - seq.last_token_time_s]
            seq.last_token_time_s = now
            num_tokens = len(tokens)
            num_output = num_tokens - seq.num_prompt_tokens
            reason: str | None = None
            stop_ids = seq.stop_token_ids
            if stop_ids is not None and token_id in stop_ids and num_output >= seq.min_tokens:
                reason = FINISH_STOP
            elif num_tokens >= seq.token_limit:
                reason = FINISH_LENGTH
            if reason is not None:
                self._finish(seq, reason=reason)
            if outputs is None:
                self.pending.append((seq, token_id, logprob, num_output, reason, now, ttft, itl))
                continue
            text = ""
            if seq.needs_text:
                stop = seq.stop
                final = stop.append_text(token_id=token_id, num_output_tokens=num_output, token_reason=reason)
                if final is not None and reason is None:
                    self._finish(seq, reason=final)  # a stop string
                elif final is not None:
                    seq.finish_reason = final
                reason = final
                text = stop.take_new_text(finished=reason is not None)
            outputs.append(
                new_output(
                    seq.request_id,
                    [token_id],
                    text,
                    None if logprob is None else [logprob],
                    reason,
                    seq.num_prompt_tokens,
                    num_output,
                    seq.num_cached_tokens,
                    ttft,
                    itl,
                    None if reason is None else now - seq.arrival_time_s,
                )
            )
        self.generation_tokens_total += num_generated

    def process_pending(self) -> list[RequestOutput]:
        """The text part of the appended tokens: detokenize, stop strings, outputs."""
        pending, self.pending = self.pending, []
        outputs: list[RequestOutput] = []
        for request, token_id, logprob, num_output, token_reason, now, ttft, itl in pending:
            reason = request.stop.append_text(
                token_id=token_id, num_output_tokens=num_output, token_reason=token_reason
            )
            if reason is not None and token_reason is None:
                self._finish(request, reason=reason)  # a stop string
            elif reason is not None:
                request.finish_reason = reason
            outputs.append(
                output_of(
                    request,
                    new_token_ids=[token_id],
                    new_logprobs=None if logprob is None else [logprob],
                    finish_reason=reason,
                    now=now,
                    ttft=ttft,
                    itl=itl,
                    num_output_tokens=num_output,
                )
            )
        return outputs

    def fail_non_finite(self, seqs: list[Sequence], rows: tuple[int, ...]) -> list[RequestOutput]:
        """End the requests of ``rows`` (sampled rows whose logits were NaN or infinite,
        :mod:`.sampler`) with an error output each, before their tokens are appended (which then
        skips them); the other rows of the step go on as if they were alone."""
        outputs: list[RequestOutput] = []
        for row in rows:
            request = cast(EngineRequest, seqs[row])
            if request.status is _FINISHED:  # aborted meanwhile, or a second row of its own
                continue
            log.warning(
                "request %s: the model produced non-finite logits at output token %d; the request ends with an error",
                request.request_id,
                request.num_output_tokens + 1,
            )
            self.drop_pending(request.request_id)
            request.keep_kv = False  # nothing valid to hand over
            self._finish(request, reason=FINISH_ERROR)
            out = output_of(
                request,
                new_token_ids=[],
                new_logprobs=None,
                finish_reason=FINISH_ERROR,
                now=time.monotonic(),
                ttft=None,
                itl=[],
            )
            out.error = (
                "the model produced non-finite logits (NaN or infinity) for this request "
                f"at output token {request.num_output_tokens + 1}: a numerical overflow "
                "of the model on this server, not a fault of the request"
            )
            out.error_code = ERROR_NON_FINITE_LOGITS
            outputs.append(out)
        return outputs

    def drop_pending(self, request_id: str) -> None:
        if any(p[0].request_id == request_id for p in self.pending):
            self.pending = [p for p in self.pending if p[0].request_id != request_id]


def output_of(
    seq: EngineRequest,
    *,
    new_token_ids: list[int],
    new_logprobs: list[TokenLogprob] | None,
    finish_reason: str | None,
    now: float,
    ttft: float | None,
    itl: list[float],
    num_output_tokens: int | None = None,
) -> RequestOutput:
    """``seq``'s output with these new tokens and the text its stop checker has ready."""
    finished = finish_reason is not None
    return new_output(
        seq.request_id,
        new_token_ids,
        seq.stop.take_new_text(finished=finished),
        new_logprobs,
        finish_reason,
        seq.num_prompt_tokens,
        seq.num_output_tokens if num_output_tokens is None else num_output_tokens,
        seq.num_cached_tokens,
        ttft,
        itl,
        (now - seq.arrival_time_s) if finished else None,
    )
