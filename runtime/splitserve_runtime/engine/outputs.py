"""What the engine hands back per request and step: new tokens, text, logprobs, timings.

One :class:`RequestOutput` carries only what is *new* since the previous one (a streaming
delta); the consumer concatenates. Timings are measured inside the engine on a monotonic
clock, so the server can feed its TTFT / inter-token / end-to-end histograms without
guessing at queueing delays between threads.

A busy engine makes one :class:`RequestOutput` per running request and step (hundreds per
step), so the class has slots and is not frozen (a frozen dataclass sets every field through
``object.__setattr__``, three times the cost); treat outputs as read-only all the same.
:func:`new_output` is the engine's positional constructor for the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"

ERROR_NON_FINITE_LOGITS = "non_finite_logits"
""":attr:`RequestOutput.error_code` of a request whose logits were NaN or infinite
(:mod:`.sampler`): the model's numbers overflowed, a fault of the server, not of the request."""


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """Log-probability of a chosen token and (if asked for) of the top-n alternatives.

    Log-probabilities are from the model's distribution (before temperature and filters).
    """

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """A streaming delta for one request.

    ``finish_reason`` is ``"stop"`` (eos, stop token or stop string), ``"length"``
    (max_tokens or the KV cache cannot hold the sequence), ``"abort"`` or ``"error"``
    (then ``error`` holds the message). ``error_code`` is set on an error the engine states
    itself for this request (:data:`ERROR_NON_FINITE_LOGITS`), whose ``error`` holds no internals
    and may be shown to the client; None on an internal failure, whose message is for the log
    only. ``ttft_seconds`` is set on the output that carries
    the first token; ``itl_seconds`` holds one gap per new token after the first;
    ``e2e_seconds`` is set when finished. All are seconds since arrival / previous token.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    error_code: str | None = None
    ttft_seconds: float | None = None
    itl_seconds: list[float] = field(default_factory=list)
    e2e_seconds: float | None = None


_new = object.__new__


def new_output(
    request_id: str,
    new_token_ids: list[int],
    new_text: str,
    new_logprobs: list[TokenLogprob] | None,
    finish_reason: str | None,
    num_prompt_tokens: int,
    num_output_tokens: int,
    num_cached_tokens: int,
    ttft_seconds: float | None,
    itl_seconds: list[float],
    e2e_seconds: float | None,
) -> RequestOutput:
    """A :class:`RequestOutput` (``finished`` follows ``finish_reason``; no error), built
    without keyword-argument binding: the engine makes one per request and step."""
    out: RequestOutput = _new(RequestOutput)
    out.request_id = request_id
    out.new_token_ids = new_token_ids
    out.new_text = new_text
    out.new_logprobs = new_logprobs
    out.finished = finish_reason is not None
    out.finish_reason = finish_reason
    out.num_prompt_tokens = num_prompt_tokens
    out.num_output_tokens = num_output_tokens
    out.num_cached_tokens = num_cached_tokens
    out.error = None
    out.error_code = None
    out.ttft_seconds = ttft_seconds
    out.itl_seconds = itl_seconds
    out.e2e_seconds = e2e_seconds
    return out
