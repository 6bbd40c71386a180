"""Per-request sampling settings, validated once at admission.

Validation raises ``ValueError`` with a message meant for the API user (the server turns it
into a 400). Defaults follow the OpenAI API: ``temperature=1``, ``top_p=1``, no top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
"""Most top-n alternatives a request may ask for (the OpenAI API's limit)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``seed`` makes sampling reproducible for this request regardless
    of what else is in the batch. Until ``min_tokens`` tokens are out, eos and
    ``stop_token_ids`` cannot be sampled (as in vLLM). ``logprobs``: ``None`` returns none, ``0`` returns the
    chosen token's log-probability, ``n > 0`` also the ``n`` most likely alternatives. ``speculative`` False opts this request
    out of speculative decoding (its output distribution is the same either way).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    speculative: bool = True
    """False: never verify proposals for this request (when the engine speculates at all)."""

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids must be a list of integers")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, *, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
