"""LLMEngine on the null model: stop tokens, eos, lengths, abort, admission errors, stats."""

from __future__ import annotations

import pytest
import torch

from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    PromptExceedsKVCapacity,
)
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import NullModel, build_null_engine, null_next_token
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams

VOCAB = 1024
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _config(**overrides: object) -> EngineConfig:
    values: dict[str, object] = {
        "max_model_len": 256,
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
    }
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]


def _expected(prompt: list[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = null_next_token(t, vocab_size=VOCAB)
        out.append(t)
    return out


def _run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_are_deltas_with_timings_and_length_finish(overlap: bool) -> None:
    engine = build_null_engine(config=_config())
    engine.overlap_output_processing = overlap
    prompt = list(range(10, 30))
    engine.add_request(request_id="a", prompt_token_ids=prompt, params=GREEDY)
    outs = _run(engine)["a"]
    assert _tokens(outs) == _expected(prompt, 8)
    assert [o.finished for o in outs] == [False] * 7 + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 8
    assert outs[0].ttft_seconds is not None and outs[0].ttft_seconds >= 0
    assert all(len(o.itl_seconds) == 1 for o in outs[1:])
    assert outs[-1].e2e_seconds is not None and outs[-1].e2e_seconds >= outs[0].ttft_seconds
    assert engine.block_manager.usage_ratio == 0.0


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_token_eos_ignore_eos_and_min_tokens(overlap: bool) -> None:
    prompt = [5, 6, 7]
    exp = _expected(prompt, 8)
    model = NullModel(vocab_size=VOCAB)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    engine = LLMEngine(
        model=model,
        kv_spec=spec,
        vocab_size=VOCAB,
        config=_config(),
        device=torch.device("cpu"),
        eos_token_ids=[exp[2]],
        overlap_output_processing=overlap,
    )
    engine.add_request(request_id="eos", prompt_token_ids=prompt, params=GREEDY)
    engine.add_request(
        request_id="ignore",
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    engine.add_request(
        request_id="stop_id",
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[exp[1]]),
    )
    engine.add_request(
        request_id="min_stop",
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[exp[1]], min_tokens=3),
    )
    engine.add_request(
        request_id="min_eos",
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logprobs=1),
    )
    outs = _run(engine)
    assert _tokens(outs["eos"]) == exp[:3] and outs["eos"][-1].finish_reason == "stop"
    assert _tokens(outs["ignore"]) == exp and outs["ignore"][-1].finish_reason == "length"
    assert _tokens(outs["stop_id"]) == exp[:2] and outs["stop_id"][-1].finish_reason == "stop"
    # below min_tokens, stop and eos tokens cannot be sampled (the next best one is)
    min_stop = _tokens(outs["min_stop"])
    assert min_stop[0] == exp[0] and min_stop[1] != exp[1] and len(min_stop) >= 3
    min_eos = _tokens(outs["min_eos"])
    assert min_eos[:2] == exp[:2] and min_eos[2] != exp[2] and len(min_eos) >= 4
    third = outs["min_eos"][2].new_logprobs
    assert third is not None and third[0].top_logprobs[0][0] == exp[2]  # logprobs stay unmasked


@pytest.mark.parametrize(("overlap", "async_scheduling"), [(False, False), (True, False), (False, True)])
def test_abort_frees_kv_blocks_from_running_and_waiting(overlap: bool, async_scheduling: bool) -> None:
    engine = build_null_engine(config=_config(max_num_seqs=2, async_scheduling=async_scheduling))
    engine.overlap_output_processing = overlap
    for i in range(3):
        engine.add_request(
            request_id=f"r{i}",
            prompt_token_ids=list(range(i, i + 30)),
            params=SamplingParams(temperature=0, max_tokens=50),
        )
    engine.step()
    engine.step()
    assert engine.block_manager.usage_ratio > 0
    assert engine.scheduler.num_waiting == 1
    final = engine.abort_request("r0")
    assert final is not None and final.finished and final.finish_reason == "abort"
    assert engine.abort_request("r2") is not None  # still waiting
    assert engine.abort_request("r1") is not None
    assert engine.abort_request("r1") is None
    assert engine.block_manager.usage_ratio == 0.0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished() and engine.step() == []


def test_admission_errors() -> None:
    engine = build_null_engine(config=_config(max_model_len=64, num_kv_blocks=8))
    with pytest.raises(ContextLengthExceeded, match=r"64 tokens.*70 tokens \(60 in the prompt, 10"):
        engine.add_request(request_id="a", prompt_token_ids=[1] * 60, params=SamplingParams(max_tokens=10))
    with pytest.raises(PromptExceedsKVCapacity, match="needs 10 KV blocks.*only 8 blocks"):
        engine.add_request(request_id="b", prompt_token_ids=[1] * 40, params=SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request(request_id="c", prompt_token_ids=[], params=GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(request_id="d", prompt_token_ids=[VOCAB], params=GREEDY)
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.add_request(request_id="e", prompt_token_ids=[1], params=SamplingParams(stop=["x"]))
    engine.add_request(request_id="f", prompt_token_ids=[1], params=GREEDY)
    with pytest.raises(DuplicateRequestId):
        engine.add_request(request_id="f", prompt_token_ids=[1], params=GREEDY)
    assert engine.scheduler.num_waiting == 1


@pytest.mark.parametrize(("overlap", "async_scheduling"), [(False, False), (True, False), (False, True)])
def test_preemption_keeps_outputs_and_counts(overlap: bool, async_scheduling: bool) -> None:
    prompts = {f"r{i}": list(range(100 * i, 100 * i + 10)) for i in range(4)}
    engine = build_null_engine(
        config=_config(num_kv_blocks=14, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    )
    engine.overlap_output_processing = overlap
    for rid, prompt in prompts.items():
        engine.add_request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=12))
    outs = _run(engine)
    for rid, prompt in prompts.items():
        assert _tokens(outs[rid]) == _expected(prompt, 12)
    stats = engine.stats()
    assert stats.preemptions_total > 0
    assert stats.kv_cache_usage_ratio == 0.0
    assert stats.generation_tokens_total == 48
    assert stats.prompt_tokens_total == 40


def test_stats_track_waiting_running_and_prefix_hits() -> None:
    engine = build_null_engine(config=_config(max_num_seqs=1))
    prompt = list(range(40))
    engine.add_request(request_id="a", prompt_token_ids=prompt, params=GREEDY)
    engine.add_request(request_id="b", prompt_token_ids=prompt, params=GREEDY)
    engine.step()
    stats = engine.stats()
    assert (stats.requests_running, stats.requests_waiting) == (1, 1)
    assert stats.prompt_tokens_waiting == 40 - 36  # b's first 9 blocks are cached
    _run(engine)
    stats = engine.stats()
    assert stats.prefix_cache_queried_tokens_total == 80
    assert stats.prefix_cache_hit_tokens_total == 36
    assert stats.kv_cache_blocks_total == 64 and stats.kv_cache_blocks_cached > 0


def test_seeded_sampling_is_independent_of_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16)
    alone = build_null_engine(config=_config())
    alone.add_request(request_id="x", prompt_token_ids=[3, 4, 5], params=params)
    ref = _tokens(_run(alone)["x"])
    batched = build_null_engine(config=_config())
    for i in range(5):
        batched.add_request(
            request_id=f"o{i}",
            prompt_token_ids=[i + 1] * (i + 2),
            params=SamplingParams(temperature=1.0, max_tokens=16),
        )
    batched.add_request(request_id="x", prompt_token_ids=[3, 4, 5], params=params)
    assert _tokens(_run(batched)["x"]) == ref
    assert ref != _expected([3, 4, 5], 16)  # temperature really sampled


def test_engine_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_model_len"):
        EngineConfig(max_model_len=1024, max_num_batched_tokens=512, chunked_prefill=False)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        EngineConfig(max_model_len=16, kv_memory_fraction=0.0)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_many_requests_leave_no_state_behind(async_scheduling: bool) -> None:
    engine = build_null_engine(config=_config(num_kv_blocks=32, max_num_seqs=8, async_scheduling=async_scheduling))
    engine.overlap_output_processing = True
    for wave in range(20):
        for i in range(50):
            rid = f"w{wave}-{i}"
            engine.add_request(
                request_id=rid,
                prompt_token_ids=[(wave * 50 + i) % VOCAB] * (i % 9 + 1),
                params=SamplingParams(temperature=0.5, seed=i, max_tokens=i % 5 + 1),
            )
        for i in range(0, 50, 7):
            engine.abort_request(f"w{wave}-{i}")
        _run(engine)
    assert engine.num_requests == 0 and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == 32
    assert engine.runner.sampler._generators == {}
    assert engine.scheduler._by_id == {} and not engine.scheduler.waiting
