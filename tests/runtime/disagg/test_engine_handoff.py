"""Prefill -> decode KV handoff hooks: a request prefilled on one engine and decoded on
another (its KV moved block by block as bytes) produces the same greedy tokens as one engine."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.async_engine import AsyncEngine
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams

ARGS = ServeArgs(device="cpu", block_size=4, num_kv_blocks=64, max_model_len=256)
MAX_TOKENS = 10


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine.from_args(dataclasses.replace(ARGS, model=str(model_dir), **overrides))


def _generate(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, *, keep_kv: bool = False
) -> list[int]:
    engine.add_request(request_id=request_id, prompt_token_ids=prompt, params=params, keep_kv=keep_kv)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def _prefill_and_move(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams) -> int:
    """Prefill on one engine, reserve + copy the blocks into the other; returns first token."""
    first = _generate(prefill, "r", prompt, dataclasses.replace(params, max_tokens=1), keep_kv=True)
    kept = prefill.kept_kv("r")
    assert kept is not None and kept.token_ids == prompt
    assert prefill.block_manager.usage_ratio > 0  # pinned after the request finished
    reservation = decode.reserve_imported_request(
        request_id="r",
        token_ids=prompt + first,
        num_prompt_tokens=len(prompt),
        params=params,
        num_imported_tokens=len(prompt),
    )
    assert reservation is not None
    for index in range(reservation.first_block_index, len(kept.block_ids)):
        decode.runner.write_block(reservation.block_ids[index], prefill.runner.read_block(kept.block_ids[index]))
    assert prefill.release_kept_kv("r") and not prefill.release_kept_kv("r")
    assert prefill.block_manager.usage_ratio == 0.0
    return first[0]


@pytest.fixture(scope="module")
def prompt(tiny_llama_dir: Path) -> list[int]:
    tokenizer: Any = _engine(tiny_llama_dir).tokenizer
    ids: list[int] = tokenizer.encode("Once upon a time in a land far away")
    return ids


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"kv_cache_dtype": "fp8"},
        {"quantization": "int4"},
        {"quantization": "fp8", "kv_cache_dtype": "fp8"},
        {"speculative_method": "ngram"},
        {"speculative_method": "draft", "speculative_draft_model": "SELF"},
    ],
    ids=["full", "fp8-kv", "int4", "fp8-weights-fp8-kv", "ngram-speculation", "draft-speculation"],
)
def test_prefill_here_decode_there_matches_one_engine(
    tiny_llama_dir: Path, prompt: list[int], settings: dict[str, str]
) -> None:
    """Disaggregated equals aggregated, token for token, also with quantized weights and an
    fp8 KV cache (whose blocks move as stored)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if settings.get("speculative_draft_model") == "SELF":  # the model drafts for itself
        settings = {**settings, "speculative_draft_model": str(tiny_llama_dir)}
    reference = _generate(_engine(tiny_llama_dir, **settings), "ref", prompt, params)
    prefill, decode = _engine(tiny_llama_dir, **settings), _engine(tiny_llama_dir, **settings)
    first = _prefill_and_move(prefill, decode, prompt, params)
    decode.activate_imported_request("r")
    rest: list[int] = []
    outs: list[RequestOutput] = []
    while decode.has_unfinished():
        for out in decode.step():
            rest.extend(out.new_token_ids)
            outs.append(out)
    assert [first, *rest] == reference
    if settings.get("speculative_method"):  # the imported sequence was decoded speculatively
        assert decode.stats().spec_decode_proposed_tokens_total > 0
    if settings.get("speculative_method") == "draft":  # the draft caught up on the imported prompt
        assert decode.stats().spec_decode_accepted_tokens_total == decode.stats().spec_decode_proposed_tokens_total
    assert outs[-1].num_output_tokens == MAX_TOKENS and outs[-1].finish_reason == "length"
    assert decode.block_manager.usage_ratio == 0.0
    # the first token's TTFT belongs to the prefill side: the decode engine reports none, and
    # every token it generates (the second one on) is an inter-token gap
    assert all(out.ttft_seconds is None for out in outs)
    assert sum(len(out.itl_seconds) for out in outs) == len(rest)


def test_import_reuses_local_prefix_cache_and_cancel_frees(tiny_llama_dir: Path, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    decode = _engine(tiny_llama_dir)
    _generate(decode, "warm", prompt, params)  # the prompt's full blocks are now cached here
    reservation = decode.reserve_imported_request(
        request_id="x",
        token_ids=prompt + [5],
        num_prompt_tokens=len(prompt),
        params=params,
        num_imported_tokens=len(prompt),
    )
    assert reservation is not None
    assert reservation.num_cached_tokens == (len(prompt) // 4) * 4
    assert decode.cancel_imported_request("x") and not decode.cancel_imported_request("x")
    assert decode.block_manager.usage_ratio == 0.0
    with pytest.raises(ValueError, match="num_imported_tokens"):
        decode.reserve_imported_request(
            request_id="y",
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=params,
            num_imported_tokens=len(prompt),
        )


def test_reservation_refused_when_full(tiny_llama_dir: Path, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    decode = _engine(tiny_llama_dir, num_kv_blocks=len(prompt) // 4 + 1)
    first = decode.reserve_imported_request(
        request_id="a",
        token_ids=prompt + [5],
        num_prompt_tokens=len(prompt),
        params=params,
        num_imported_tokens=len(prompt),
    )
    assert first is not None
    assert (
        decode.reserve_imported_request(
            request_id="b",
            token_ids=prompt[::-1] + [5],
            num_prompt_tokens=len(prompt),
            params=params,
            num_imported_tokens=len(prompt),
        )
        is None
    )
    assert decode.abort_request("a") is None  # aborting a reservation cancels it
    assert decode.block_manager.usage_ratio == 0.0


async def test_async_open_stream_then_activate(tiny_llama_dir: Path, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = _generate(_engine(tiny_llama_dir), "ref", prompt, params)
    prefill, decode_core = _engine(tiny_llama_dir), _engine(tiny_llama_dir)
    first = _prefill_and_move(prefill, decode_core, prompt, params)
    decode = AsyncEngine(engine=decode_core)
    await decode.start()
    try:
        stream = decode.open_stream("r")
        await decode.call(lambda core: core.activate_imported_request("r"))
        outs = await asyncio.wait_for(_collect(stream), timeout=30)
        assert [first, *[t for o in outs for t in o.new_token_ids]] == reference
    finally:
        await decode.shutdown()


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in stream]


def test_failed_import_resumed_locally_matches_one_engine(tiny_llama_dir: Path, prompt: list[int]) -> None:
    """A pull that failed half-way (garbage in a reserved block): the reservation is cancelled,
    nothing enters the prefix cache, and the request resumed from prompt + the prefill pod's
    first token decodes what one engine does, without streaming that token again."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = _generate(_engine(tiny_llama_dir), "ref", prompt, params)
    decode = _engine(tiny_llama_dir)
    reservation = decode.reserve_imported_request(
        request_id="r",
        token_ids=prompt + reference[:1],
        num_prompt_tokens=len(prompt),
        params=params,
        num_imported_tokens=len(prompt),
    )
    assert reservation is not None and reservation.num_cached_tokens == 0
    garbage = bytes(len(decode.runner.read_block(reservation.block_ids[0])))
    decode.runner.write_block(reservation.block_ids[0], garbage)  # then the transfer broke
    assert decode.cancel_imported_request("r")
    assert decode.block_manager.usage_ratio == 0.0 and decode.block_manager.num_cached_blocks == 0
    text = decode.add_resumed_request(
        request_id="r", token_ids=prompt + reference[:1], num_prompt_tokens=len(prompt), params=params
    )
    assert text == reservation.imported_text
    rest: list[int] = []
    outs: list[RequestOutput] = []
    while decode.has_unfinished():
        for out in decode.step():
            rest.extend(out.new_token_ids)
            outs.append(out)
    assert [reference[0], *rest] == reference
    assert outs[-1].num_output_tokens == MAX_TOKENS and outs[-1].finish_reason == "length"
    assert decode.block_manager.usage_ratio == 0.0
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        decode.add_resumed_request(request_id="s", token_ids=prompt, num_prompt_tokens=len(prompt), params=params)


async def test_a_release_after_shutdown_is_retrieved_not_left_to_asyncio(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A background KV release that meets a stopped engine (a prefill pod shutting down) ends
    quietly: its EngineDead is retrieved, so asyncio never reports "Task exception was never
    retrieved"; another failure is logged as a warning."""
    import gc
    import logging

    from splitserve_runtime.disagg.engine import HandoffEngine

    core = AsyncEngine(engine=_engine(tiny_llama_dir))
    handoff = HandoffEngine(
        engine=core,
        role="prefill",
        compat_hash="h",
        kv_host="127.0.0.1",
        kv_port=0,
        kv_endpoint="127.0.0.1:0",
        kv_ttl_seconds=5.0,
    )
    await core.start()
    await core.shutdown()
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))

    async def broken() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.DEBUG, logger="splitserve_runtime.disagg.background"):
        handoff.background.spawn(core.call(lambda engine: engine.release_kept_kv("gone")))
        handoff.background.spawn(broken())
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
    assert not unretrieved
    assert not handoff.background.tasks
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["background KV task failed: RuntimeError('boom')"]
    assert any("engine is stopped" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
