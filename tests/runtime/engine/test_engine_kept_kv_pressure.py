"""KV pinned for a decode pod's pull survives KV pressure, and never costs a request.

Issue 12, defect 3 ("no kept KV", ``export_failed``, 0.4% of the disaggregated demo burst):
on a prefill pod, a prompt admitted with only its first chunk (the step's token budget or the
free blocks ran out) found, one step later, every other block pinned by requests that had
just finished and waited for their pull. Being the only running sequence, the scheduler
concluded that it could never fit, ended it with ``length`` and no token, and the export of
its KV failed. Blocks held outside the scheduler (pinned exports, KV imports) are released
later, so such a sequence must wait for them; only one larger than the whole pool is ended.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.block_manager import BlockManager
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import build_null_engine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.scheduler import Scheduler, SchedulerConfig
from splitserve_runtime.engine.sequence import Sequence

BS = 4
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _null_engine(*, num_kv_blocks: int, budget: int) -> LLMEngine:
    return build_null_engine(
        config=EngineConfig(
            max_model_len=64,
            block_size=BS,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=8,
            chunked_prefill=True,
        )
    )


def _step_all(engine: LLMEngine, *, num_steps: int = 20) -> list[RequestOutput]:
    """Step until nothing is left or ``num_steps`` ran (more than any case here needs)."""
    outs: list[RequestOutput] = []
    for _ in range(num_steps):
        if not engine.has_unfinished():
            break
        outs.extend(engine.step())
    return outs


def test_a_chunked_prompt_waits_for_pinned_kv_instead_of_losing_its_export() -> None:
    """Pool of 7 blocks, budget 16 tokens: ``a`` (14 tokens, 4 blocks) and the first chunk of
    ``b`` (2 tokens, 1 block) run in step 1; ``a`` finishes and keeps its 4 blocks pinned;
    ``b``'s next chunk needs 3 more blocks and only 2 are free. ``b`` must wait (not end),
    and once ``a``'s KV is released it finishes with its token and its own kept KV."""
    engine = _null_engine(num_kv_blocks=7, budget=16)
    a, b = list(range(1, 15)), list(range(100, 114))
    engine.add_request(request_id="a", prompt_token_ids=a, params=PREFILL, keep_kv=True)
    engine.add_request(request_id="b", prompt_token_ids=b, params=PREFILL, keep_kv=True)
    outs = _step_all(engine)
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {"a"}, finished  # b is not ended for lack of blocks held elsewhere
    assert finished["a"].new_token_ids and engine.kept_kv("a") is not None
    assert engine.has_unfinished() and engine.stalled  # b waits; stepping again changes nothing
    pinned = list(engine.kept_kv("a").block_ids)  # type: ignore[union-attr]
    assert all(engine.block_manager.ref_count(block) == 1 for block in pinned)

    assert engine.release_kept_kv("a")  # the decode pod pulled a's KV
    outs = _step_all(engine)
    assert [(o.request_id, o.finish_reason, len(o.new_token_ids)) for o in outs if o.finished] == [("b", "length", 1)]
    kept = engine.kept_kv("b")
    assert kept is not None and kept.token_ids == b and len(kept.block_ids) == 4
    assert engine.release_kept_kv("b") and engine.block_manager.usage_ratio == 0.0


def test_a_decode_waits_for_an_import_reservation_instead_of_ending_early() -> None:
    """The decode side of the same mistake: blocks reserved for a KV import being pulled
    made a lone decoding request look as if the pool could never hold it."""
    engine = _null_engine(num_kv_blocks=4, budget=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(request_id="d", prompt_token_ids=list(range(1, 8)), params=params)
    engine.step()  # prompt of 7 tokens: 2 blocks
    reservation = engine.reserve_imported_request(
        request_id="imp", token_ids=[*range(50, 57), 5], num_prompt_tokens=7, params=params, num_imported_tokens=7
    )
    assert reservation is not None  # the other 2 blocks
    outs = _step_all(engine)
    assert not any(o.finished for o in outs)  # d's 9th token needs a 3rd block: it waits
    assert engine.stalled
    assert engine.cancel_imported_request("imp")  # the pull failed: its blocks come back
    outs = _step_all(engine)
    done = [o for o in outs if o.finished]
    assert [(o.request_id, o.finish_reason, o.num_output_tokens) for o in done] == [("d", "length", 8)]


def test_a_sequence_larger_than_the_whole_pool_is_still_ended() -> None:
    s = Scheduler(
        config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, chunked_prefill=True),
        block_manager=BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=True),
    )
    seq = Sequence(
        request_id="big", token_ids=list(range(8)), num_prompt_tokens=8, params=SamplingParams(max_tokens=100)
    )
    s.add(seq)
    out = s.schedule()
    s.on_step_done(out)
    seq.token_ids.append(3)
    out = s.schedule()  # 9 tokens need 3 blocks of a 2-block pool
    assert out.finished == [seq] and seq.finish_reason == "length"


ARGS = ServeArgs(
    device="cpu", block_size=BS, num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=24, max_num_seqs=8
)


def test_pinned_kv_bytes_survive_pressure_and_every_export_succeeds(tiny_llama_dir: Path) -> None:
    """The tiny model, a pool of 24 blocks, prompts of 17 tokens (5 blocks) chunked by a
    24-token step budget, arriving faster than their KV is pulled (one pull whenever a step
    could do nothing): every request finishes with its token and a kept KV, and a pinned
    block's bytes never change while other prompts are computed around it. (Before the fix,
    3 of the 10 were ended with no token.)"""
    engine = LLMEngine.from_args(dataclasses.replace(ARGS, model=str(tiny_llama_dir)))
    prompts = {f"r{i}": [(7 * i + j) % 200 + 3 for j in range(17)] for i in range(10)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id=request_id, prompt_token_ids=prompt, params=PREFILL, keep_kv=True)
    snapshots: dict[str, list[bytes]] = {}
    pulled: list[str] = []
    for _ in range(400):
        outs = engine.step()
        for out in outs:
            assert out.finished and out.finish_reason == "length" and len(out.new_token_ids) == 1, out
            kept = engine.kept_kv(out.request_id)
            assert kept is not None and kept.token_ids == prompts[out.request_id]
            snapshots[out.request_id] = [bytes(engine.runner.read_block(b)) for b in kept.block_ids]
        for request_id, blocks in snapshots.items():  # nothing overwrote pinned blocks
            kept = engine.kept_kv(request_id)
            if kept is not None:
                assert [bytes(engine.runner.read_block(b)) for b in kept.block_ids] == blocks
        if not outs and engine.block_manager.num_free_blocks < 5:  # pinned full: a pull
            oldest = next(r for r in snapshots if r not in pulled)
            assert engine.release_kept_kv(oldest)
            pulled.append(oldest)
        if not engine.has_unfinished():
            break
    assert sorted(snapshots) == sorted(prompts)  # every export happened
    assert pulled, "the pool was never under pressure: the test proves nothing"
    for request_id in prompts:
        if request_id not in pulled:
            assert engine.release_kept_kv(request_id)
    assert engine.block_manager.usage_ratio == 0.0


@pytest.mark.parametrize("budget", [16, 512])
def test_admission_refuses_a_prompt_the_pool_can_never_hold(budget: int) -> None:
    from splitserve_runtime.engine.errors import PromptExceedsKVCapacity

    engine = _null_engine(num_kv_blocks=4, budget=budget)
    with pytest.raises(PromptExceedsKVCapacity):
        engine.add_request(request_id="x", prompt_token_ids=list(range(1, 18)), params=PREFILL, keep_kv=True)
