"""The pieces behind "a large prompt never stalls the server": the length bound, the two
context checks and the bounded worker pool (issue 12, defect 1).

The length check refuses a prompt without tokenizing it only if ``len(text) / bound`` tokens
is a true lower bound. Property tests hold our tokenizers to it on arbitrary text (special
tokens, combining marks, emoji, whitespace runs), and tokenizers for which it would be false
(a normalizer that composes characters, a pre-tokenizer that drops whitespace) get no bound.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from splitserve_runtime.model.tokenizer import Tokenizer, max_chars_per_token
from splitserve_runtime.server.errors import APIError
from splitserve_runtime.server.prompt_length import (
    check_length_can_fit,
    check_tokens_fit,
    min_prompt_tokens,
    resolve_max_tokens,
)
from splitserve_runtime.server.prompt_workers import PromptWorkers

PIECES = [
    "\u0301",
    "e\u0301",
    "\u1100\u1161\u11a8",
    "🙂",
    "🚀🌍",
    "  ",
    "\n\n",
    "\t",
    "ÿ",
    "日本語",
    "\u200d",
    "a" * 40,
    "=" * 30,
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>user<|end_header_id|>",
]
TEXTS = st.lists(
    st.one_of(st.text(alphabet=st.characters(exclude_categories=["Cs"])), st.sampled_from(PIECES)), max_size=12
).map("".join)


@pytest.fixture(scope="module")
def tokenizers(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> list[Tokenizer]:
    return [Tokenizer.from_dir(model_dir=tiny_llama_dir), Tokenizer.from_dir(model_dir=tiny_qwen2_dir)]


def test_byte_level_bpe_has_a_bound(tokenizers: list[Tokenizer]) -> None:
    for tokenizer in tokenizers:
        assert tokenizer.max_chars_per_token is not None
        assert 1 < tokenizer.max_chars_per_token < 100


@settings(max_examples=400, deadline=None)
@given(text=TEXTS)
def test_no_text_has_fewer_tokens_than_the_bound_says(tokenizers: list[Tokenizer], text: str) -> None:
    for tokenizer in tokenizers:
        bound = tokenizer.max_chars_per_token
        assert bound is not None
        for special in (False, True):
            num_tokens = len(tokenizer.encode(text, add_special_tokens=special))
            assert num_tokens >= min_prompt_tokens(num_chars=len(text), max_chars_per_token=bound), (text, special)


def test_encode_bounded_counts_without_listing_an_oversized_prompt(tokenizers: list[Tokenizer]) -> None:
    tokenizer = tokenizers[0]
    text = "Once upon a time " * 20
    ids = tokenizer.encode(text)
    assert tokenizer.encode_bounded(text, max_tokens=len(ids)) == (len(ids), ids)
    assert tokenizer.encode_bounded(text, max_tokens=len(ids) - 1) == (len(ids), None)
    assert tokenizer.encode_bounded(text) == (len(ids), ids)


def _variant(model_dir: Path, out: Path, *, change: str) -> HFTokenizer:
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if change == "nfc":
        spec["normalizer"] = {"type": "NFC"}
    elif change == "strip":
        spec["normalizer"] = {
            "type": "Sequence",
            "normalizers": [{"type": "Lowercase"}, {"type": "Strip", "strip_left": True, "strip_right": True}],
        }
    elif change == "whitespace":
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "WhitespaceSplit"},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }
    elif change == "removed":
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }
    elif change == "lowercase":
        spec["normalizer"] = {"type": "Lowercase"}
    path = out / f"{change}.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return HFTokenizer.from_file(str(path))


@pytest.mark.parametrize("change", ["nfc", "strip", "whitespace", "removed"])
def test_tokenizers_that_can_shrink_the_text_get_no_bound(tiny_llama_dir: Path, tmp_path: Path, change: str) -> None:
    tokenizer = _variant(tiny_llama_dir, tmp_path, change=change)
    assert max_chars_per_token(tokenizer) is None
    if change == "nfc":
        return  # composition shrinks text 3:1 at most (Hangul jamo), too little to show here
    # why: with these, a text can be fewer tokens than len(text) / the longest token
    bound = max_chars_per_token(HFTokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")))
    spaces = " " * 500
    assert len(tokenizer.encode(spaces).ids) < min_prompt_tokens(num_chars=len(spaces), max_chars_per_token=bound)


def test_a_normalizer_that_only_grows_the_text_keeps_the_bound(tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert max_chars_per_token(_variant(tiny_llama_dir, tmp_path, change="lowercase")) is not None


# ----------------------------------------------------------------------------- the checks


@settings(max_examples=500, deadline=None)
@given(
    num_prompt_tokens=st.integers(0, 300), requested=st.none() | st.integers(1, 300), max_model_len=st.integers(1, 256)
)
def test_the_token_check_is_the_engines_rule(num_prompt_tokens: int, requested: int | None, max_model_len: int) -> None:
    """The engine refuses prompt + max_tokens > max_model_len, max_tokens defaulting to the
    room left (at least 1); the server's early check refuses exactly the same requests."""
    max_tokens = resolve_max_tokens(
        requested=requested, num_prompt_tokens=num_prompt_tokens, max_model_len=max_model_len
    )
    engine_refuses = num_prompt_tokens + max_tokens > max_model_len
    try:
        check_tokens_fit(
            num_prompt_tokens=num_prompt_tokens,
            requested_max_tokens=requested,
            max_model_len=max_model_len,
            param="prompt",
        )
    except APIError as exc:
        assert engine_refuses
        assert exc.status_code == 400 and exc.code == "context_length_exceeded"
        assert f"{num_prompt_tokens} in the prompt" in exc.message
    else:
        assert not engine_refuses


@settings(max_examples=500, deadline=None)
@given(
    num_chars=st.integers(0, 10_000),
    bound=st.integers(1, 30),
    requested=st.none() | st.integers(1, 300),
    max_model_len=st.integers(1, 256),
)
def test_the_length_check_refuses_only_what_the_token_check_would(
    num_chars: int, bound: int, requested: int | None, max_model_len: int
) -> None:
    """Whatever the tokens turn out to be (at least num_chars / bound of them), a prompt the
    length check refuses is refused by the token check too."""
    try:
        check_length_can_fit(
            num_chars=num_chars,
            max_chars_per_token=bound,
            requested_max_tokens=requested,
            max_model_len=max_model_len,
            param="prompt",
        )
    except APIError as exc:
        assert exc.code == "context_length_exceeded" and "characters" in exc.message
        fewest = min_prompt_tokens(num_chars=num_chars, max_chars_per_token=bound)
        with pytest.raises(APIError):
            check_tokens_fit(
                num_prompt_tokens=fewest, requested_max_tokens=requested, max_model_len=max_model_len, param="prompt"
            )


def test_without_a_bound_the_length_check_refuses_nothing() -> None:
    check_length_can_fit(
        num_chars=10**9, max_chars_per_token=None, requested_max_tokens=None, max_model_len=8, param="prompt"
    )


# ----------------------------------------------------------------------------- the pool


async def test_small_jobs_run_inline_and_large_ones_on_a_worker_thread() -> None:
    workers = PromptWorkers(max_workers=1, max_waiting=0, inline_chars=10)
    try:
        loop_thread = threading.get_ident()
        assert await workers.run(threading.get_ident, size_chars=10) == loop_thread
        assert await workers.run(threading.get_ident, size_chars=11) != loop_thread
    finally:
        workers.shutdown()


async def test_a_full_pool_refuses_at_once_and_frees_its_slots() -> None:
    workers = PromptWorkers(max_workers=1, max_waiting=1, inline_chars=0)
    release = threading.Event()
    try:
        first = asyncio.ensure_future(workers.run(lambda: release.wait(30), size_chars=1))
        queued = asyncio.ensure_future(workers.run(lambda: "queued", size_chars=1))
        while workers.num_jobs < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as refused:
            await workers.run(lambda: "third", size_chars=1)
        assert refused.value.status_code == 429 and refused.value.headers["Retry-After"] == "1"
        queued.cancel()  # a job that never started leaves the pool at once
        while workers.num_jobs > 1:
            await asyncio.sleep(0.01)
        release.set()
        assert await first is True
        while workers.num_jobs:
            await asyncio.sleep(0.01)
        assert await workers.run(lambda: "again", size_chars=1) == "again"
    finally:
        release.set()
        workers.shutdown()


async def test_an_error_in_a_job_reaches_the_caller() -> None:
    workers = PromptWorkers(inline_chars=0)

    def fail() -> None:
        raise APIError(status_code=400, message="bad text", type="invalid_request_error")

    try:
        with pytest.raises(APIError, match="bad text"):
            await workers.run(fail, size_chars=1)
        assert workers.num_jobs == 0
    finally:
        workers.shutdown()
