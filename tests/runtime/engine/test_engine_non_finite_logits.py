"""Non-finite logits end their own request with a clear error; the rest of the batch is untouched.

Found by a hostile review: fp16/fp8 overflow on a GPU gives NaN or infinite logits; the sampler
then picked an arbitrary token (the argmax of NaNs) with NaN logprobs, so a request with
``logprobs`` was a 500 (NaN is not JSON) and one without a 200 of garbage text. A CPU model
cannot overflow on demand, so these tests put the fault in one request's row of the logits on
their way into the real sampler (``logit_faults.poison``), in every step mode of the engine: the sampler
flags the row (:attr:`SamplerOutput.non_finite_rows`) and the engine ends that request with
``finish_reason="error"`` and ``error_code="non_finite_logits"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from logit_faults import poison

from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import build_null_engine
from splitserve_runtime.engine.outputs import (
    ERROR_NON_FINITE_LOGITS,
    FINISH_ERROR,
    RequestOutput,
)
from splitserve_runtime.engine.sampler import Sampler
from splitserve_runtime.engine.sampling_params import SamplingParams

VOCAB = 1024
FAULTS: dict[str, Callable[[torch.Tensor], object]] = {
    "one NaN": lambda row: row.__setitem__(5, float("nan")),
    "+inf": lambda row: row.__setitem__(9, float("inf")),
    "all -inf": lambda row: row.fill_(float("-inf")),
}
MODES = {"sync": {}, "output overlap": {"overlap": True}, "async scheduling": {"async_scheduling": True}}


def _engine(mode: dict[str, bool]) -> LLMEngine:
    config = EngineConfig(
        max_model_len=256,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        async_scheduling=mode.get("async_scheduling", False),
    )
    engine = build_null_engine(config=config, vocab_size=VOCAB)
    engine.overlap_output_processing = mode.get("overlap", False)
    return engine


REQUESTS: dict[str, SamplingParams] = {
    "victim": SamplingParams(temperature=0, max_tokens=6, logprobs=2),
    "greedy": SamplingParams(temperature=0, max_tokens=6, logprobs=2),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=6, logprobs=1),
}


def _run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list[RequestOutput]]:
    for n, (rid, params) in enumerate(requests.items()):
        engine.add_request(request_id=rid, prompt_token_ids=list(range(10 + n, 30 + n)), params=params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs[out.request_id].append(out)
    else:
        raise AssertionError("the engine did not finish")
    engine.close()
    return outs


def _tokens_and_logprobs(outs: list[RequestOutput]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(lp.token_id, lp.logprob, lp.top_logprobs) for o in outs for lp in o.new_logprobs or []]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("at_output", [0, 3])
def test_non_finite_logits_end_that_request_only(mode: str, fault: str, at_output: int) -> None:
    baseline = _run(_engine(MODES[mode]), REQUESTS)
    engine = _engine(MODES[mode])
    poison(engine.runner.sampler, marked=lambda rid, _params: rid == "victim", at_output=at_output, fault=FAULTS[fault])
    outs = _run(engine, REQUESTS)

    victim = outs["victim"]
    last = victim[-1]
    assert last.finished and last.finish_reason == FINISH_ERROR, last
    assert last.error_code == ERROR_NON_FINITE_LOGITS
    assert last.error is not None and "non-finite logits" in last.error
    assert [o.finished for o in victim] == [False] * (len(victim) - 1) + [True]
    # the tokens before the fault were delivered as they were without it; none after it
    delivered = [t for o in victim for t in o.new_token_ids]
    assert delivered == [t for o in baseline["victim"] for t in o.new_token_ids][:at_output]
    for o in victim:
        for lp in o.new_logprobs or []:
            assert math.isfinite(lp.logprob) and all(math.isfinite(v) for _t, v in lp.top_logprobs)
    # the other rows of the same steps: the same tokens and logprobs as without the fault
    for rid in ("greedy", "seeded"):
        assert outs[rid][-1].finish_reason == baseline[rid][-1].finish_reason == "length"
        assert _tokens_and_logprobs(outs[rid]) == _tokens_and_logprobs(baseline[rid])
    # nothing left behind: no request, no KV block held
    assert engine.num_requests == 0
    assert engine.block_manager.num_used_blocks == 0


def test_the_sampler_flags_only_the_non_finite_rows() -> None:
    """The sampler on its own: bad rows flagged with a valid token id and no logprobs; the others
    as they are sampled in a batch without the bad rows (greedy and seeded rows alike)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.7, seed=11, top_p=0.8, logprobs=3),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0, seed=12),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.5, seed=13, top_k=20, logprobs=0),
    ]
    ids = [f"r{i}" for i in range(6)]
    bad = logits.clone()
    bad[1, 4] = float("nan")
    bad[2].fill_(float("-inf"))
    bad[4, 100] = float("inf")
    flagged = Sampler(device=torch.device("cpu")).sample(logits=bad, request_ids=ids, params=params)
    assert flagged.non_finite_rows == (1, 2, 4)
    for row in (1, 2, 4):
        assert 0 <= flagged.token_ids[row] < 300
        assert flagged.logprobs[row] is None
    good = [0, 3, 5]
    alone = Sampler(device=torch.device("cpu")).sample(
        logits=logits[good], request_ids=[ids[i] for i in good], params=[params[i] for i in good]
    )
    assert alone.non_finite_rows == ()
    assert [flagged.token_ids[i] for i in good] == alone.token_ids
    assert [flagged.logprobs[i] for i in good] == alone.logprobs
