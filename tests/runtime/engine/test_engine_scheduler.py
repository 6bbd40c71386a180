"""Scheduler: token budget, decodes first, chunking, max_num_seqs, FCFS, preemption, abort."""

from __future__ import annotations

from splitserve_runtime.engine.block_manager import BlockManager
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from splitserve_runtime.engine.sequence import Sequence, SequenceStatus

BS = 4


def _sched(
    *, num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8, chunked: bool = True, caching: bool = True
) -> Scheduler:
    return Scheduler(
        config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, chunked_prefill=chunked),
        block_manager=BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching),
    )


def _seq(request_id: str, num_tokens: int, *, base: int = 0) -> Sequence:
    tokens = [base + i for i in range(num_tokens)]
    return Sequence(
        request_id=request_id, token_ids=tokens, num_prompt_tokens=num_tokens, params=SamplingParams(max_tokens=1000)
    )


def _finish_step(s: Scheduler, out: SchedulerOutput, *, token: int = 7) -> None:
    """What the engine does after the model ran: advance, then append sampled tokens."""
    s.on_step_done(out)
    for chunk in out.prefills:
        if chunk.samples:
            chunk.seq.token_ids.append(token)
    for seq in out.decodes:
        seq.token_ids.append(token)


def test_budget_is_respected_and_prompts_are_chunked() -> None:
    s = _sched(budget=16)
    a = _seq("a", 40)
    s.add(a)
    sizes = []
    while a.num_output_tokens == 0:
        out = s.schedule()
        assert out.num_batched_tokens <= 16
        sizes.append(out.prefills[0].num_tokens)
        assert out.prefills[0].samples == (sum(sizes) == 40)
        _finish_step(s, out)
    assert sizes == [16, 16, 8]
    assert a.num_computed_tokens == 40


def test_decodes_come_first_then_prefill_chunks_with_the_rest() -> None:
    s = _sched(budget=10)
    running = [_seq(f"d{i}", 3, base=100 * i) for i in range(4)]
    for seq in running:
        s.add(seq)
    _finish_step(s, s.schedule())  # all four prefills (12 tokens > 10: the last is chunked)
    out = s.schedule()
    _finish_step(s, out)
    long = _seq("long", 50, base=1000)
    s.add(long)
    out = s.schedule()
    assert [seq.request_id for seq in out.decodes] == ["d0", "d1", "d2", "d3"]
    assert [c.seq.request_id for c in out.prefills] == ["long"]
    assert out.prefills[0].num_tokens == 10 - 4
    assert out.num_batched_tokens == 10


def test_without_chunked_prefill_prompts_are_whole_or_wait() -> None:
    s = _sched(budget=16, chunked=False)
    a, b = _seq("a", 10), _seq("b", 10, base=500)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.prefills] == [("a", 10)]
    assert b.status is SequenceStatus.WAITING
    _finish_step(s, out)
    out = s.schedule()
    assert out.decodes == [a]
    assert [(c.seq.request_id, c.num_tokens) for c in out.prefills] == [("b", 10)]


def test_max_num_seqs_caps_running() -> None:
    s = _sched(budget=1000, max_num_seqs=3)
    for i in range(5):
        s.add(_seq(f"r{i}", 4, base=10 * i))
    out = s.schedule()
    assert len(out.prefills) == 3 and s.num_running == 3 and s.num_waiting == 2


def test_fcfs_no_overtaking_when_head_does_not_fit() -> None:
    s = _sched(num_blocks=6, budget=1000)
    big = _seq("big", 20)  # 5 blocks
    s.add(big)
    _finish_step(s, s.schedule())
    s.add(_seq("head", 8, base=100))  # needs 2 blocks, only 1 free
    s.add(_seq("small", 2, base=200))  # would fit, must not overtake
    out = s.schedule()
    assert out.decodes == [big] and out.prefills == []
    assert [seq.request_id for seq in s.waiting] == ["head", "small"]


def test_prefix_cache_hit_skips_computed_tokens_and_counts() -> None:
    s = _sched(budget=100)
    a = _seq("a", 17)
    s.add(a)
    _finish_step(s, s.schedule())
    b = _seq("b", 17)
    s.add(b)
    out = s.schedule()
    chunk = next(c for c in out.prefills if c.seq is b)
    assert chunk.start_position == 16 and chunk.num_tokens == 1
    assert b.num_cached_tokens == 16
    assert s.counters.prefix_cache_hit_tokens_total == 16
    assert s.counters.prefix_cache_queried_tokens_total == 34


def test_preemption_of_newest_under_kv_pressure_and_resume() -> None:
    s = _sched(num_blocks=4, budget=100, caching=False)
    old, new = _seq("old", 4), _seq("new", 4, base=50)
    s.add(old)
    s.add(new)
    _finish_step(s, s.schedule())  # one full block each
    assert s.block_manager.num_free_blocks == 2
    out = s.schedule()  # decoding token 5 takes a 2nd block each
    _finish_step(s, out)
    assert s.block_manager.num_free_blocks == 0
    for _ in range(3):  # fill the 2nd blocks
        _finish_step(s, s.schedule())
    out = s.schedule()  # both need a 3rd block: 'new' is preempted for 'old'
    assert out.preempted == [new]
    assert out.decodes == [old]
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and s.waiting[0] is new
    assert s.counters.preemptions_total == 1
    assert out.prefills == []  # no admission in a step that preempted
    _finish_step(s, out)
    s.finish(old, reason="stop")
    out = s.schedule()  # 'new' recomputes prompt + generated tokens, then samples
    assert [(c.seq.request_id, c.start_position, c.num_tokens) for c in out.prefills] == [("new", 0, new.num_tokens)]
    assert out.prefills[0].samples


def test_lone_sequence_that_cannot_fit_is_finished_with_length() -> None:
    s = _sched(num_blocks=2, budget=100)
    a = _seq("a", 8)
    s.add(a)
    _finish_step(s, s.schedule())
    out = s.schedule()
    assert out.finished == [a] and a.finish_reason == "length"
    assert s.block_manager.num_free_blocks == 2 and not s.has_unfinished()


def test_abort_frees_blocks_from_running_and_waiting() -> None:
    s = _sched(num_blocks=8, budget=100, max_num_seqs=1)
    a, b = _seq("a", 10), _seq("b", 10, base=100)
    s.add(a)
    s.add(b)
    _finish_step(s, s.schedule())
    assert s.block_manager.num_free_blocks == 5 and s.num_waiting == 1
    assert s.abort("b") is b and s.num_waiting == 0
    assert s.abort("a") is a and s.num_running == 0
    assert s.block_manager.num_free_blocks == 8 and s.block_manager.usage_ratio == 0.0
    assert s.abort("a") is None
    assert s.schedule().is_empty


def test_prompt_tokens_waiting_excludes_cached_prefix() -> None:
    s = _sched(budget=100, max_num_seqs=1)
    a = _seq("a", 12)
    s.add(a)
    _finish_step(s, s.schedule())
    s.add(_seq("b", 12))
    s.add(_seq("c", 6, base=500))
    assert s.num_prompt_tokens_waiting() == (12 - 8) + 6
