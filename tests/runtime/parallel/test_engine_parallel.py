"""Tensor and pipeline parallelism with real processes (gloo on the CPU): an engine whose model
runs on two ranks (TP 2, or two pipeline stages), or on four (TP 2 × PP 2), produces, token for
token, what the single-process engine produces, however the work is batched (a batch of 8 in
micro-batches, chunked prefill at a tiny budget, prefix-cache hits, preemption, n-gram
speculation), for an even head split, an uneven one (3 KV heads over 2 ranks, tied embeddings,
a vocabulary that does not divide) and a replicated KV head; and KV blocks move between
engines of different layouts both ways (heterogeneous prefill/decode)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_to_completion

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.parallel.runner import ParallelRunner
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.model.tiny import write_tiny_model

MAX_TOKENS = 10
BASE = ServeArgs(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=128,
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
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Every engine a test builds, closed afterwards (tensor-parallel ones stop their workers)."""
    built: list[LLMEngine] = []
    yield built
    for engine in built:
        engine.close()


def _engine(built: list[LLMEngine], model_dir: Path, **overrides: Any) -> LLMEngine:
    engine = LLMEngine.from_args(dataclasses.replace(BASE, model=str(model_dir), **overrides))
    built.append(engine)
    return engine


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = run_to_completion(engine, prompts, params)
    return tokens


def _prompts(engine: LLMEngine) -> dict[str, list[int]]:
    tok: Any = engine.tokenizer
    return {f"p{i}": tok.encode(text) for i, text in enumerate(TEXTS)}


LAYOUTS = [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]
LAYOUT_IDS = ["tp2", "pp2"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_two_ranks_match_one_however_batched(
    tiny_llama_dir: Path, engines: list[LLMEngine], layout: dict[str, int]
) -> None:
    single = _engine(engines, tiny_llama_dir)
    prompts = _prompts(single)
    reference = _run(single, prompts)
    assert len({tuple(v) for v in reference.values()}) > 1

    engine = _engine(
        engines, tiny_llama_dir, prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=7, **layout
    )
    assert isinstance(engine.runner, ParallelRunner)
    tp = layout.get("tensor_parallel_size", 1)
    assert engine.runner.spec.num_kv_heads == 2 // tp  # this rank's share of the 2 KV heads
    assert engine.runner.spec.num_layers == 2 // layout.get("pipeline_parallel_size", 1)  # and of the 2 layers
    assert engine.runner.wire_spec == single.runner.wire_spec
    first = dict(list(prompts.items())[:1])
    assert _run(engine, first) == {k: reference[k] for k in first}
    rest = {k: v for k, v in prompts.items() if k not in first}
    assert _run(engine, rest) == {k: reference[k] for k in rest}  # batched, chunked, cache hits
    assert engine.stats().prefix_cache_hit_tokens_total >= 8 * len(rest)


@pytest.mark.parametrize(
    "layout", [*LAYOUTS, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}], ids=[*LAYOUT_IDS, "tp2xpp2"]
)
def test_parallel_ranks_preempt_and_speculate_like_one(
    tiny_llama_dir: Path, engines: list[LLMEngine], layout: dict[str, int]
) -> None:
    single = _engine(engines, tiny_llama_dir)
    prompts = _prompts(single)
    reference = _run(single, prompts)
    engine = _engine(
        engines,
        tiny_llama_dir,
        num_kv_blocks=16,
        prefix_caching=True,
        chunked_prefill=True,
        max_num_batched_tokens=64,
        speculative_method="ngram",
        **layout,
    )
    assert _run(engine, prompts) == reference
    assert engine.stats().preemptions_total > 0
    assert engine.stats().spec_decode_proposed_tokens_total > 0
    assert engine.block_manager.usage_ratio == 0.0


@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        (
            {"num_heads": 6, "num_kv_heads": 3, "hidden_size": 48, "vocab_size": 509, "tie_word_embeddings": True},
            (1, 2),
        ),  # uneven KV groups; padded vocabulary rows on the last rank
        ({"num_heads": 4, "num_kv_heads": 1}, (1, 1)),  # one KV head, replicated on both ranks
    ],
    ids=["uneven-3kv-tied-odd-vocab", "replicated-1kv"],
)
def test_head_layouts_match_one_rank(
    tmp_path: Path, engines: list[LLMEngine], shape: dict[str, Any], layout: tuple[int, int]
) -> None:
    model_dir = write_tiny_model(out_dir=tmp_path / "model", seed=3, **shape)
    single = _engine(engines, model_dir)
    prompts = dict(list(_prompts(single).items())[:4])
    reference = _run(single, prompts)
    engine = _engine(engines, model_dir, tensor_parallel_size=2)
    assert engine.runner.spec.num_kv_heads == layout[0]  # rank 0's KV heads
    assert _run(engine, prompts) == reference


def _handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int]) -> list[int]:
    """Prefill one token on ``prefill``, move the prompt's blocks (whole-model layout) into
    ``decode`` and decode the rest there; every token."""
    prefill.add_request(
        request_id="r", prompt_token_ids=prompt, keep_kv=True, params=dataclasses.replace(GREEDY, max_tokens=1)
    )
    first = [t for _ in range(100) if prefill.has_unfinished() for out in prefill.step() for t in out.new_token_ids]
    kept = prefill.kept_kv("r")
    assert kept is not None and len(first) == 1
    reservation = decode.reserve_imported_request(
        request_id="r",
        token_ids=prompt + first,
        num_prompt_tokens=len(prompt),
        params=GREEDY,
        num_imported_tokens=len(prompt),
    )
    assert reservation is not None
    read = prefill.runner.block_reader(list(kept.block_ids))
    for index in range(reservation.first_block_index, len(kept.block_ids)):
        decode.runner.write_block(reservation.block_ids[index], read(index))
    assert prefill.release_kept_kv("r")
    decode.activate_imported_request("r")
    rest: list[RequestOutput] = []
    while decode.has_unfinished():
        rest.extend(decode.step())
    return first + [t for out in rest for t in out.new_token_ids]


TP1: dict[str, int] = {}
TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}


@pytest.mark.parametrize(
    ("prefill_layout", "decode_layout"),
    [(TP2, TP1), (TP1, TP2), (TP2, TP2), (PP2, TP1), (TP2, PP2)],
    ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2", "pp2-to-tp1", "tp2-to-pp2"],
)
def test_kv_moves_between_parallel_layouts(
    tiny_llama_dir: Path, engines: list[LLMEngine], prefill_layout: dict[str, int], decode_layout: dict[str, int]
) -> None:
    single = _engine(engines, tiny_llama_dir)
    prompt = _prompts(single)["p2"]
    reference = _run(single, {"ref": prompt})["ref"]
    prefill = _engine(engines, tiny_llama_dir, **prefill_layout)
    decode = _engine(engines, tiny_llama_dir, **decode_layout)
    assert prefill.runner.wire_spec == decode.runner.wire_spec == single.runner.wire_spec
    assert _handoff(prefill, decode, prompt) == reference
    assert decode.block_manager.usage_ratio == 0.0


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_whole_model_block_bytes_do_not_depend_on_the_split(
    tiny_llama_dir: Path, engines: list[LLMEngine], layout: dict[str, int]
) -> None:
    """A block read from two ranks is the single-process block (equal up to the summation order
    of the all-reduces: layer 0's K/V bit for bit, later layers within float rounding; bit for
    bit across pipeline stages); writing a block into the two ranks and reading it back gives
    it again byte for byte."""
    single = _engine(engines, tiny_llama_dir)
    parallel = _engine(engines, tiny_llama_dir, **layout)
    prompt = _prompts(single)["p0"]
    blocks = []
    for engine in (single, parallel):
        engine.add_request(
            request_id="k", prompt_token_ids=prompt, keep_kv=True, params=dataclasses.replace(GREEDY, max_tokens=1)
        )
        while engine.has_unfinished():
            engine.step()
        kept = engine.kept_kv("k")
        assert kept is not None
        read = engine.runner.block_reader(list(kept.block_ids))
        blocks.append([read(i) for i in range(len(kept.block_ids))])
    assert len(blocks[0]) == len(blocks[1]) >= 3
    spec = single.runner.wire_spec
    for one, two in zip(blocks[0], blocks[1], strict=True):
        a, b = (torch.frombuffer(bytearray(x), dtype=torch.float32).view(spec.num_layers, -1) for x in (one, two))
        assert torch.equal(a[0], b[0])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    free = parallel.block_manager.num_blocks - 1  # never handed out while only "k" is kept
    parallel.runner.write_block(free, blocks[0][1])
    assert parallel.runner.read_block(free) == blocks[0][1]


def test_closing_stops_the_workers(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_args(
        dataclasses.replace(BASE, model=str(tiny_llama_dir), tensor_parallel_size=2, pipeline_parallel_size=2)
    )
    runner = engine.runner
    assert isinstance(runner, ParallelRunner)
    assert [p.poll() for p in runner.workers.processes] == [None, None, None]
    engine.close()
    assert [p.returncode for p in runner.workers.processes] == [0, 0, 0]  # a Stop message, not a kill
