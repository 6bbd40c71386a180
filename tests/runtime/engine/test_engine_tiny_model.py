"""LLMEngine on the real tiny Llama: greedy outputs do not depend on how the work is batched.

The reference is each prompt run alone with prefix caching and chunked prefill off. The
same tokens must come out with prefix caching on (and real hits), with chunked prefill at a
tiny token budget, in a batch of 8, and with a KV pool so small that preemption happens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams

MAX_TOKENS = 12
BASE = ServeArgs(
    device="cpu",
    block_size=4,
    num_kv_blocks=256,
    max_model_len=256,
    max_num_batched_tokens=256,
    prefix_caching=False,
    chunked_prefill=False,
)
SHARED = "The quick brown fox jumps over the lazy dog while"
TEXTS = [
    SHARED + tail
    for tail in (
        " the cat",
        " a bird sings",
        " rain falls",
        " we code",
        " it rains again",
        " the sun",
        " music plays",
        " time flies",
    )
]


def _engine(model_dir: Path, *, overlap: bool = False, **overrides: Any) -> LLMEngine:
    engine = LLMEngine.from_args(dataclasses.replace(BASE, model=str(model_dir), **overrides))
    engine.overlap_output_processing = overlap  # the CUDA default, exercised here on CPU
    return engine


def _run(
    engine: LLMEngine, prompts: dict[str, list[int]], *, params: SamplingParams | None = None
) -> dict[str, list[RequestOutput]]:
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(request_id=rid, prompt_token_ids=prompt, params=params)
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def _tokens(outs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in outs.items()}


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> dict[str, list[int]]:
    tok = _engine(tiny_llama_dir).tokenizer
    return {f"p{i}": tok.encode(text) for i, text in enumerate(TEXTS)}  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    ref: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        ref.update(_tokens(_run(_engine(tiny_llama_dir), {rid: prompt})))
    assert len({tuple(v) for v in ref.values()}) > 1  # the prompts lead to different outputs
    return ref


def test_batch_of_8_matches_alone(
    tiny_llama_dir: Path, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    assert _tokens(_run(_engine(tiny_llama_dir), prompts)) == reference


def test_prefix_caching_matches_and_hits(
    tiny_llama_dir: Path, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    engine = _engine(tiny_llama_dir, prefix_caching=True)
    first = dict(list(prompts.items())[:1])
    assert _tokens(_run(engine, first)) == {k: reference[k] for k in first}
    outs = _run(engine, {k: v for k, v in prompts.items() if k not in first})
    assert _tokens(outs) == {k: v for k, v in reference.items() if k not in first}
    assert all(seq[-1].num_cached_tokens >= 8 for seq in outs.values())
    assert engine.stats().prefix_cache_hit_tokens_total >= 8 * (len(prompts) - 1)


def test_chunked_prefill_small_budget_matches(
    tiny_llama_dir: Path, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    engine = _engine(tiny_llama_dir, chunked_prefill=True, max_num_batched_tokens=7)
    assert _tokens(_run(engine, prompts)) == reference


def test_preemption_with_tiny_kv_pool_matches(
    tiny_llama_dir: Path, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    engine = _engine(
        tiny_llama_dir, num_kv_blocks=16, prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=64
    )
    assert _tokens(_run(engine, prompts)) == reference
    assert engine.stats().preemptions_total > 0
    assert engine.block_manager.usage_ratio == 0.0


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_string_trims_text(tiny_llama_dir: Path, prompts: dict[str, list[int]], overlap: bool) -> None:
    engine = _engine(tiny_llama_dir, overlap=overlap, prefix_caching=True)
    prompt = {"s": prompts["p0"]}
    full = "".join(o.new_text for o in _run(engine, prompt)["s"])
    assert len(full) >= 6
    stop = full[3:6]
    cut = full.index(stop)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    outs = _run(engine, prompt, params=params)["s"]
    assert "".join(o.new_text for o in outs) == full[:cut]
    assert outs[-1].finish_reason == "stop"
    assert engine.block_manager.usage_ratio == 0.0 and not engine.has_unfinished()
    # with overlapped output processing the request ends on the same token
    # (the extra token sampled while the stop string was found is dropped)
    if overlap:
        plain = _run(_engine(tiny_llama_dir, prefix_caching=True), prompt, params=params)["s"]
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in plain]
    # a stop string that never appears leaves the text alone
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=["\u2603never"])
    outs = _run(engine, prompt, params=params)["s"]
    assert "".join(o.new_text for o in outs) == full and outs[-1].finish_reason == "length"


def test_output_overlap_matches(
    tiny_llama_dir: Path, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    engine = _engine(
        tiny_llama_dir,
        overlap=True,
        chunked_prefill=True,
        prefix_caching=True,
        max_num_batched_tokens=16,
        num_kv_blocks=24,
    )
    assert _tokens(_run(engine, prompts)) == reference


def test_streamed_text_equals_decoded_tokens(tiny_llama_dir: Path, prompts: dict[str, list[int]]) -> None:
    engine = _engine(tiny_llama_dir)
    outs = _run(engine, {"t": prompts["p1"]})["t"]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert "".join(o.new_text for o in outs) == engine.tokenizer.decode(tokens)  # type: ignore[attr-defined]
