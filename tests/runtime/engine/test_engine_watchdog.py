"""The engine-step watchdog of :class:`AsyncEngine`: a step that never returns marks the engine
unhealthy within the bound, logs one ERROR line and ends every open stream with an error; an
idle engine, and a request of many short steps, are never declared wedged.

The defect this pins: a wedged step (a stopped tensor-parallel rank, a stuck driver call) kept
``is_healthy`` True while every request stalled for gloo's 10-minute timeout. The stall here is
a real engine over a null model whose forward blocks on an event (a fake stalled step); the
real-process version (SIGSTOP of a TP-2 worker rank) is in ``test_server_wedged_rank.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
import torch

from splitserve_runtime.engine.async_engine import AsyncEngine
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.errors import EngineDead
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import NullModel
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams

VOCAB = 512
TIMEOUT_S = 0.5
SLACK_S = 2.0


class StallingModel(NullModel):
    """A null model whose forward from call ``stall_at`` on blocks until ``release`` is set,
    and whose every forward takes ``step_delay_s``."""

    def __init__(self, *, stall_at: int | None = None, step_delay_s: float = 0.0) -> None:
        super().__init__(vocab_size=VOCAB)
        self.stall_at = stall_at
        self.step_delay_s = step_delay_s
        self.release = threading.Event()
        self.stalled = threading.Event()

    def forward(self, **kwargs: Any) -> torch.Tensor:
        if self.stall_at is not None and self.num_forward_calls >= self.stall_at:
            self.stalled.set()
            self.release.wait(30)
        time.sleep(self.step_delay_s)
        return super().forward(**kwargs)


def _engine(model: NullModel, *, step_timeout_s: float = TIMEOUT_S) -> AsyncEngine:
    config = EngineConfig(max_model_len=512, block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    core = LLMEngine(
        model=model,
        vocab_size=VOCAB,
        config=config,
        device=torch.device("cpu"),
        kv_spec=KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32),
        model_name="null",
        overlap_output_processing=False,
    )
    return AsyncEngine(engine=core, step_timeout_s=step_timeout_s)


async def _collect(engine: AsyncEngine, request_id: str, max_tokens: int) -> list[RequestOutput]:
    return [
        o
        async for o in engine.generate(
            request_id=request_id,
            prompt_token_ids=[1, 2, 3],
            params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
    ]


async def test_a_stalled_step_marks_the_engine_dead_and_fails_the_streams(caplog: pytest.LogCaptureFixture) -> None:
    model = StallingModel(stall_at=3)
    engine = _engine(model)
    await engine.start()
    try:
        with caplog.at_level(logging.ERROR, logger="splitserve_runtime.engine.async_engine"):
            started = time.monotonic()
            streams = [asyncio.create_task(_collect(engine, f"r{i}", 100)) for i in range(2)]
            assert await asyncio.to_thread(model.stalled.wait, 10)
            stalled_at = time.monotonic()
            outs = await asyncio.wait_for(asyncio.gather(*streams), timeout=TIMEOUT_S + SLACK_S)
            ended = time.monotonic()
        assert not engine.is_healthy
        assert TIMEOUT_S <= ended - stalled_at <= TIMEOUT_S + SLACK_S, (started, stalled_at, ended)
        for out in outs:
            assert out[-1].finished and out[-1].finish_reason == "error"
            assert out[-1].error is not None and "wedged" in out[-1].error
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and "wedged" in r.getMessage()]
        assert len(errors) == 1
        assert "--engine-step-timeout-seconds" in errors[0].getMessage()
        assert "2 requests running" in errors[0].getMessage()
        with pytest.raises(EngineDead, match="wedged"):
            await _collect(engine, "late", 1)
    finally:
        model.release.set()
        await asyncio.wait_for(engine.shutdown(), timeout=10)


async def test_idle_and_many_short_steps_are_not_a_stall() -> None:
    model = StallingModel(step_delay_s=0.02)
    engine = _engine(model, step_timeout_s=0.3)
    await engine.start()
    try:
        await asyncio.sleep(1.0)  # idle far past the bound
        assert engine.is_healthy
        # 60 steps of 20 ms: 1.2 s in all, each well inside the bound
        outs = await asyncio.wait_for(_collect(engine, "long", 60), timeout=30)
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 60
        assert engine.is_healthy
    finally:
        await engine.shutdown()


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="step timeout"):
        _engine(NullModel(vocab_size=VOCAB), step_timeout_s=-1)
