"""What the engine hands back per request and step: new tokens, text, logprobs, timings.

One :class:`RequestOutput` carries only what is *new* since the previous one (a streaming
delta); the consumer concatenates. Timings are measured inside the engine on a monotonic
clock, so the server can feed its TTFT / inter-token / end-to-end histograms without
guessing at queueing delays between threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """Log-probability of a chosen token and (if asked for) of the top-n alternatives.

    Log-probabilities are from the model's distribution (before temperature and filters).
    """

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """A streaming delta for one request.

    ``finish_reason`` is ``"stop"`` (eos, stop token or stop string), ``"length"``
    (max_tokens or the KV cache cannot hold the sequence), ``"abort"`` or ``"error"``
    (then ``error`` holds the message). ``ttft_seconds`` is set on the output that carries
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
    ttft_seconds: float | None = None
    itl_seconds: list[float] = field(default_factory=list)
    e2e_seconds: float | None = None
