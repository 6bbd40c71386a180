"""The forward thread's busy time (what ``bench/cpu_engine.py`` (c) compares a step with):
it counts the time spent running submitted work, failed work included, and nothing while idle;
an engine stepping asynchronously on the CPU accumulates at least its forwards' fixed time."""

from __future__ import annotations

import time

import pytest

from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import build_null_engine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.step_overlap import ForwardThread


def test_busy_time_counts_running_work_only() -> None:
    thread = ForwardThread()
    try:
        thread.submit(lambda: time.sleep(0.05)).result()
        after_work = thread.busy_seconds
        time.sleep(0.05)  # idle: not counted
        assert 0.05 <= after_work < 0.5
        assert thread.busy_seconds == after_work

        def fail() -> None:
            time.sleep(0.02)
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            thread.submit(fail).result()
        assert thread.busy_seconds >= after_work + 0.02
    finally:
        thread.close()


def _engine(*, async_scheduling: bool, forward_seconds: float) -> LLMEngine:
    config = EngineConfig(
        max_model_len=256,
        block_size=16,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        async_scheduling=async_scheduling,
    )
    return build_null_engine(config=config, vocab_size=64, forward_seconds=forward_seconds)


def test_an_asynchronous_engine_reports_its_forward_side() -> None:
    engine = _engine(async_scheduling=True, forward_seconds=0.01)
    try:
        assert engine.forward_busy_seconds == 0.0
        engine.add_request(
            request_id="r",
            prompt_token_ids=list(range(8)),
            params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        )
        while engine.has_unfinished():
            engine.step()
        busy = engine.forward_busy_seconds
        assert busy is not None and busy >= 6 * 0.01  # one forward per token, each at least 10 ms
    finally:
        engine.close()


def test_a_synchronous_engine_has_no_forward_thread() -> None:
    engine = _engine(async_scheduling=False, forward_seconds=0.0)
    try:
        assert engine.forward_busy_seconds is None
    finally:
        engine.close()
