"""AsyncEngine: streaming, typed admission errors, cancel-on-disconnect, fatal errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
import torch

from splitserve_runtime.engine.async_engine import AsyncEngine
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.errors import (
    ContextLengthExceeded,
    EngineDead,
    PromptExceedsKVCapacity,
    QueueFull,
)
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import NullModel, null_next_token
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams

VOCAB = 512


class SlowModel(NullModel):
    """A null model whose steps take ``step_delay_s`` and that fails from step ``fail_at``."""

    def __init__(self, *, step_delay_s: float = 0.0, fail_at: int | None = None) -> None:
        super().__init__(vocab_size=VOCAB)
        self.step_delay_s = step_delay_s
        self.fail_at = fail_at

    def forward(self, **kwargs: Any) -> torch.Tensor:
        if self.fail_at is not None and self.num_forward_calls >= self.fail_at:
            raise RuntimeError("simulated device failure")
        time.sleep(self.step_delay_s)
        return super().forward(**kwargs)


def _engine(*, model: NullModel | None = None, overlap: bool = False, **overrides: object) -> AsyncEngine:
    values: dict[str, object] = {
        "max_model_len": 512,
        "block_size": 4,
        "num_kv_blocks": 32,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
    }
    values.update(overrides)
    model = model or NullModel(vocab_size=VOCAB)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    core = LLMEngine(
        model=model,
        kv_spec=spec,
        vocab_size=VOCAB,
        config=EngineConfig(**values),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        model_name="null",
        overlap_output_processing=overlap,
    )
    return AsyncEngine(engine=core)


async def _collect(
    engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [o async for o in engine.generate(request_id=request_id, prompt_token_ids=prompt, params=params)]


async def _wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("overlap", [False, True])
async def test_concurrent_streams_finish_with_the_right_tokens(overlap: bool) -> None:
    engine = _engine(overlap=overlap)
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=10)
        prompts = {f"r{i}": [i + 1] * (i + 3) for i in range(6)}
        results = await asyncio.gather(*(_collect(engine, rid, p, params) for rid, p in prompts.items()))
        for (rid, prompt), outs in zip(prompts.items(), results, strict=True):
            tokens = [t for o in outs for t in o.new_token_ids]
            expected, t = [], prompt[-1]
            for _ in range(10):
                t = null_next_token(t, vocab_size=VOCAB)
                expected.append(t)
            assert tokens == expected, rid
            assert outs[-1].finished and outs[-1].finish_reason == "length"
        await _wait_until(lambda: engine.stats().generation_tokens_total == 60)
        stats = engine.stats()
        assert stats.requests_running == 0 and stats.kv_cache_usage_ratio == 0.0
        assert engine.is_healthy and engine.model_name == "null" and engine.max_model_len == 512
    finally:
        await engine.shutdown()


async def test_admission_errors_are_raised_before_the_first_output() -> None:
    engine = _engine(
        max_model_len=512, num_kv_blocks=8, max_num_seqs=1, max_queue_len=1, model=SlowModel(step_delay_s=0.05)
    )
    await engine.start()
    try:
        with pytest.raises(ContextLengthExceeded):
            await _collect(engine, "a", [1] * 500, SamplingParams(max_tokens=20))
        with pytest.raises(PromptExceedsKVCapacity):
            await _collect(engine, "b", [1] * 40, SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, "c", [VOCAB + 1], SamplingParams(max_tokens=1))
        long_params = SamplingParams(temperature=0, max_tokens=30)  # 2 + 30 - 1 fit 8 x 4 slots
        running = asyncio.create_task(_collect(engine, "run", [1, 2], long_params))
        await _wait_until(lambda: engine.engine.scheduler.num_running == 1)
        waiting = asyncio.create_task(_collect(engine, "wait", [3, 4], long_params))
        await _wait_until(lambda: engine.engine.scheduler.num_waiting == 1)
        with pytest.raises(QueueFull) as info:
            await _collect(engine, "full", [5], long_params)
        assert info.value.retry_after_seconds >= 1
        # the engine keeps serving after rejections
        engine.abort("run")
        engine.abort("wait")
        outs = await asyncio.gather(running, waiting)
        assert all(o[-1].finish_reason == "abort" for o in outs)
        ok = await _collect(engine, "ok", [7], SamplingParams(temperature=0, max_tokens=3))
        assert ok[-1].finish_reason == "length"
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
async def test_cancelled_consumer_aborts_and_frees_blocks(overlap: bool) -> None:
    engine = _engine(model=SlowModel(step_delay_s=0.002), overlap=overlap)
    await engine.start()
    try:
        seen: list[RequestOutput] = []

        async def consume() -> None:
            async for out in engine.generate(
                request_id="gone", prompt_token_ids=[1] * 20, params=SamplingParams(temperature=0, max_tokens=100)
            ):
                seen.append(out)

        task = asyncio.create_task(consume())
        await _wait_until(lambda: len(seen) >= 3)
        assert engine.engine.block_manager.usage_ratio > 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _wait_until(lambda: not engine.engine.has_unfinished())
        await _wait_until(lambda: engine.stats().kv_cache_usage_ratio == 0.0)
        assert engine.engine.block_manager.num_free_blocks == 32
        assert len(seen) < 100

        # closing the generator early (aclosing) aborts just the same
        gen = engine.generate(
            request_id="closed", prompt_token_ids=[2] * 9, params=SamplingParams(temperature=0, max_tokens=100)
        )
        async with contextlib.aclosing(gen):
            async for _ in gen:
                break
        await _wait_until(lambda: not engine.engine.has_unfinished())
        assert engine.engine.block_manager.usage_ratio == 0.0
    finally:
        await engine.shutdown()


async def test_fatal_error_ends_streams_and_marks_unhealthy() -> None:
    engine = _engine(model=SlowModel(step_delay_s=0.001, fail_at=5))
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=100)
        results = await asyncio.wait_for(
            asyncio.gather(_collect(engine, "a", [1, 2, 3], params), _collect(engine, "b", [4, 5], params)), timeout=10
        )
        for outs in results:
            assert outs[-1].finished and outs[-1].finish_reason == "error"
            assert outs[-1].error is not None and "simulated device failure" in outs[-1].error
        assert not engine.is_healthy
        with pytest.raises(EngineDead, match="simulated device failure"):
            await _collect(engine, "c", [1], params)
    finally:
        await engine.shutdown()


async def test_call_runs_on_the_engine_thread() -> None:
    engine = _engine()
    await engine.start()
    try:
        assert await engine.call(lambda core: core.block_manager.num_blocks) == 32
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda core: 1 // 0)
    finally:
        await engine.shutdown()


async def test_failed_start_and_repeated_shutdown() -> None:
    def broken() -> LLMEngine:
        raise RuntimeError("no weights here")

    engine = AsyncEngine(engine_factory=broken)
    with pytest.raises(RuntimeError, match="no weights here"):
        await engine.start()
    assert not engine.is_healthy
    with pytest.raises(EngineDead):
        await _collect(engine, "a", [1], SamplingParams(max_tokens=1))
    await engine.shutdown()
    await engine.shutdown()
    with pytest.raises(ValueError, match="exactly one"):
        AsyncEngine()


async def test_shutdown_ends_open_streams() -> None:
    engine = _engine(model=SlowModel(step_delay_s=0.005))
    await engine.start()
    seen: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate(
            request_id="s", prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=120)
        ):
            seen.append(out)

    task = asyncio.create_task(consume())
    await _wait_until(lambda: len(seen) >= 2)
    await engine.shutdown()
    await asyncio.wait_for(task, timeout=5)
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert not engine.is_healthy


async def test_cancelled_call_is_skipped_and_the_engine_lives() -> None:
    """A caller that goes away (client disconnect) while its call() waits must not kill the
    engine thread (setting the result of a cancelled future raises) and its fn must not run."""
    import threading

    engine = _engine()
    await engine.start()
    gate = threading.Event()
    ran: list[str] = []
    try:
        blocker = asyncio.ensure_future(engine.call(lambda core: gate.wait(5)))
        await asyncio.sleep(0.05)  # the engine thread is now inside the blocker
        pending = asyncio.ensure_future(engine.call(lambda core: ran.append("late")))
        await asyncio.sleep(0.01)
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        gate.set()
        assert await blocker is True
        assert await engine.call(lambda core: core.block_manager.num_blocks) == 32
        assert engine.is_healthy and ran == []
    finally:
        gate.set()
        await engine.shutdown()
