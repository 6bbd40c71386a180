"""The next step's decode inputs are filled from the step before's sampled ids
(:class:`~splitserve_runtime.engine.step_overlap.SampledIds`): queued work runs once the ids
exist, in order, and never on the ids of a step that failed; an asynchronous engine whose
forward fails runs no later forward on inputs that were never filled."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import NullModel
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.step_overlap import SampledIds


def test_work_queued_before_the_ids_runs_when_they_are_published_in_order() -> None:
    sampled = SampledIds()
    seen: list[tuple[str, list[int]]] = []
    sampled.then(lambda ids: seen.append(("first", ids.tolist())))
    sampled.then(lambda ids: seen.append(("second", ids.tolist())))
    assert seen == []
    sampled.publish(torch.tensor([3, 4]))
    assert seen == [("first", [3, 4]), ("second", [3, 4])]
    sampled.then(lambda ids: seen.append(("late", ids.tolist())))  # the ids exist: runs now
    assert seen[-1] == ("late", [3, 4])
    sampled.check()


def test_a_failed_step_drops_the_queued_work_and_refuses_later_work() -> None:
    sampled = SampledIds()
    ran: list[torch.Tensor] = []
    sampled.then(ran.append)
    sampled.fail(ValueError("forward failed"))
    with pytest.raises(RuntimeError, match="step before failed") as info:
        sampled.check()
    assert isinstance(info.value.__cause__, ValueError)
    sampled.then(ran.append)  # dropped too: the step that needs it checks before it runs
    assert ran == []


def test_queued_work_that_fails_marks_the_ids_failed() -> None:
    sampled = SampledIds()

    def broken(ids: torch.Tensor) -> None:
        raise IndexError("row out of range")

    sampled.then(broken)
    with pytest.raises(IndexError):
        sampled.publish(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="step before failed"):
        sampled.check()  # the step that needed the fill must not run on unfilled inputs


class _FailingModel(NullModel):
    """A null model whose forward ``fail_at`` (counting from 0) raises; it records every call."""

    def __init__(self, *, fail_at: int) -> None:
        super().__init__(vocab_size=64, forward_seconds=0.002)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, **kwargs: Any) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_at:
            raise RuntimeError("simulated device failure")
        return super().forward(**kwargs)


def test_an_asynchronous_engine_runs_no_forward_after_the_one_that_failed() -> None:
    model = _FailingModel(fail_at=3)
    config = EngineConfig(
        max_model_len=128,
        block_size=16,
        num_kv_blocks=32,
        max_num_seqs=2,
        max_num_batched_tokens=128,
        async_scheduling=True,
    )
    spec = KVCacheSpec(
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype=model.dtype
    )
    engine = LLMEngine(
        model=model, kv_spec=spec, vocab_size=64, config=config, device=torch.device("cpu"), model_name="null"
    )
    try:
        engine.add_request(
            request_id="r",
            prompt_token_ids=list(range(8)),
            params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        )
        with pytest.raises(RuntimeError, match="simulated device failure"):
            for _ in range(20):
                engine.step()
    finally:
        engine.close()  # waits for the forward thread: the step queued after the failure has run
    assert model.calls == 4  # the failing forward was the last: the next step refused to run
