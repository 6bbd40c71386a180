"""Stop strings: trimmed from the text, and never partially streamed before they complete."""

from __future__ import annotations

from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.stop_checker import StopChecker


class CharDetokenizer:
    """Token id i decodes to chr(i); flush returns a marker so tests can see it was called."""

    def __init__(self) -> None:
        self.flushed = False

    def step(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        self.flushed = True
        return ""


def _feed(text: str, **params: object) -> tuple[list[str], str | None, StopChecker]:
    values: dict[str, object] = {"max_tokens": 100, **params}
    checker = StopChecker(
        params=SamplingParams(**values),  # type: ignore[arg-type]
        eos_token_ids=frozenset(),
        detokenizer=CharDetokenizer(),
    )
    pieces: list[str] = []
    reason = None
    for n, ch in enumerate(text, start=1):
        reason = checker.append(token_id=ord(ch), num_output_tokens=n)
        pieces.append(checker.take_new_text(finished=reason is not None))
        if reason is not None:
            break
    return pieces, reason, checker


def test_stop_string_is_trimmed_and_never_streamed_partially() -> None:
    pieces, reason, _ = _feed("ab<x<END>zz", stop=["<END>"])
    assert reason == "stop"
    assert "".join(pieces) == "ab<x"
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert "<E" not in streamed
    # '<' was held back while it could start the stop string, released when it could not
    assert pieces[:4] == ["a", "b", "", "<x"]


def test_earliest_of_several_stop_strings_wins() -> None:
    pieces, reason, _ = _feed("hello world", stop=["world", "lo w"])
    assert reason == "stop" and "".join(pieces) == "hel"


def test_no_stop_string_streams_everything() -> None:
    pieces, reason, checker = _feed("abc", stop=["zzz"], max_tokens=3)
    assert reason == "length" and "".join(pieces) == "abc"
    assert checker._detok is not None and checker._detok.flushed  # type: ignore[attr-defined]


def test_stop_strings_are_ignored_below_min_tokens() -> None:
    pieces, reason, _ = _feed("ab.cd.ef", stop=["."], min_tokens=4)
    assert reason == "stop" and "".join(pieces) == "ab.cd"
