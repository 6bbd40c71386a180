"""Per-request output text and stop conditions: stop strings, stop/eos tokens, length.

Text is built with an incremental detokenizer. A stop string ends the request and is cut
from the text together with anything after it. While streaming, text that could still
become the start of a stop string is held back, so no client ever sees a partial stop
string that is later retracted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .outputs import FINISH_LENGTH, FINISH_STOP
from .sampling_params import SamplingParams


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str:
        """The text that ``token_id`` adds (may be empty until a character completes)."""
        ...

    def flush(self) -> str:
        """Whatever text is still held back (called once, when the request finishes)."""
        ...


DetokenizerFactory = Callable[[list[int]], Detokenizer]
"""Makes a detokenizer for a request, given its prompt token ids."""


class StopChecker:
    """Tracks one request's text; :meth:`append` decides whether it has finished.

    The engine copies :attr:`stop_token_ids`, :attr:`min_tokens`, :attr:`max_tokens` and
    :attr:`needs_text` onto its request when it is created (its per-token loop makes the test of
    :meth:`check_token` without a call or a second object per token) and skips
    :meth:`append_text` for requests without text; they are fixed for the request's life.
    """

    def __init__(
        self, *, params: SamplingParams, eos_token_ids: frozenset[int], detokenizer: Detokenizer | None
    ) -> None:
        self.params = params
        self._stop_ids = frozenset(params.stop_token_ids)
        self._eos_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = self._stop_ids | self._eos_ids
        """Token ids that end the request once it has ``min_tokens`` output tokens."""
        self.min_tokens = params.min_tokens
        self.max_tokens = params.max_tokens
        self.needs_text = detokenizer is not None
        """Whether tokens have text to build (else :meth:`append_text` changes nothing)."""
        self._detok = detokenizer
        self._stops = params.stop
        self._max_stop_chars = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self._num_emitted_chars = 0

    def check_token(self, *, token_id: int, num_output_tokens: int) -> str | None:
        """The cheap checks on a new output token's id: stop/eos tokens, then max_tokens."""
        if num_output_tokens >= self.min_tokens and token_id in self.stop_token_ids:
            return FINISH_STOP
        if num_output_tokens >= self.max_tokens:
            return FINISH_LENGTH
        return None

    def append_text(self, *, token_id: int, num_output_tokens: int, token_reason: str | None) -> str | None:
        """Add the token's text and look for stop strings; returns the final finish reason.

        ``token_reason`` is what :meth:`check_token` said. A stop token's own text is not
        part of the output; a stop string wins over ``length`` on the same token.
        """
        if token_reason == FINISH_STOP or self._detok is None:
            return token_reason
        previous_len = len(self.text)
        self.text += self._detok.step(token_id)
        can_stop = num_output_tokens >= self.params.min_tokens
        if can_stop and self._stops and self._cut_at_stop_string(previous_len=previous_len):
            return FINISH_STOP
        if token_reason is not None:
            self.flush()
        return token_reason

    def append(self, *, token_id: int, num_output_tokens: int) -> str | None:
        """:meth:`check_token` then :meth:`append_text`; returns a finish reason or None."""
        token_reason = self.check_token(token_id=token_id, num_output_tokens=num_output_tokens)
        return self.append_text(token_id=token_id, num_output_tokens=num_output_tokens, token_reason=token_reason)

    def flush(self) -> None:
        """Append text the detokenizer still holds (the request ended without a stop)."""
        if self._detok is not None:
            self.text += self._detok.flush()

    def take_new_text(self, *, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished else len(self.text) - self._held_back_chars()
        if end <= self._num_emitted_chars:
            return ""
        new = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return new

    def _cut_at_stop_string(self, *, previous_len: int) -> bool:
        search_from = max(previous_len - self._max_stop_chars + 1, 0)
        best: int | None = None
        for stop in self._stops:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best):
                best = index
        if best is None:
            return False
        self.text = self.text[:best]
        return True

    def _held_back_chars(self) -> int:
        if not self._stops:
            return 0
        tail = self.text[-(self._max_stop_chars - 1) :] if self._max_stop_chars > 1 else ""
        for length in range(len(tail), 0, -1):
            suffix = tail[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
