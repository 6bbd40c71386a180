"""The step's bookkeeping fast paths and asynchronous scheduling, against the slow, plain forms.

- the block-table mirror (:mod:`splitserve_runtime.engine.block_tables`) equals every live
  sequence's list through admissions, growth, preemption and frees;
- columnar decode rows build exactly the tensors that per-row Python built;
- asynchronous scheduling (:mod:`splitserve_runtime.engine.step_overlap`) gives the same tokens,
  outputs, finish reasons and counters as synchronous steps and leaves nothing held behind
  (how much of the host's work it hides is a speed figure: ``bench/async_scheduling.py``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from functools import partial

import numpy as np
import pytest
import torch

from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.model_runner import ModelRunner
from splitserve_runtime.engine.null_model import NullModel, build_null_engine, null_next_token
from splitserve_runtime.engine.outputs import RequestOutput, new_output
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.speculative import SpeculativeConfig
from splitserve_runtime.engine.step_inputs import (
    DecodeRow,
    DecodeRows,
    PrefillRow,
    StepInputs,
    StepRows,
    build_step_inputs,
)
from splitserve_runtime.engine.stop_checker import Detokenizer

VOCAB = 1024
CPU = torch.device("cpu")


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


def _run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


# ------------------------------------------------------------------ block-table mirror
def _assert_mirror(engine: LLMEngine) -> None:
    tables = engine.block_manager.tables
    seqs = [*engine.scheduler.running, *engine.scheduler.waiting]
    for seq in seqs:
        if seq.block_row < 0:
            assert not seq.block_table
            continue
        row = tables.array[seq.block_row]
        assert row[: len(seq.block_table)].tolist() == seq.block_table
        assert not row[len(seq.block_table) :].any()
    rows = [seq.block_row for seq in seqs if seq.block_row >= 0]
    assert len(rows) == len(set(rows)) == tables.num_rows_held


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_block_table_mirror_follows_every_change(async_scheduling: bool) -> None:
    # a small pool: sequences grow past their first blocks, preempt each other and are re-admitted
    engine = build_null_engine(
        config=_config(num_kv_blocks=20, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    )
    for i in range(6):
        engine.add_request(
            request_id=f"r{i}",
            prompt_token_ids=list(range(100 * i, 100 * i + 7 + i)),
            params=SamplingParams(temperature=0, max_tokens=20),
        )
    steps = 0
    while engine.has_unfinished():
        engine.step()
        _assert_mirror(engine)
        steps += 1
    assert engine.stats().preemptions_total > 0
    assert engine.block_manager.tables.num_rows_held == 0
    assert not engine.block_manager.tables.array.any()


def test_block_table_rows_grow_in_width_and_number() -> None:
    engine = build_null_engine(
        config=_config(max_model_len=512, block_size=2, num_kv_blocks=600, max_num_seqs=80, max_num_batched_tokens=4096)
    )
    for i in range(70):  # more than the 64 rows the mirror starts with
        engine.add_request(
            request_id=f"r{i}", prompt_token_ids=[i + 1] * 3, params=SamplingParams(temperature=0, max_tokens=5)
        )
    engine.add_request(
        request_id="long",
        prompt_token_ids=list(range(60)),  # 30 blocks > 16 columns
        params=SamplingParams(temperature=0, max_tokens=4),
    )
    engine.step()
    _assert_mirror(engine)
    assert engine.block_manager.tables.array.shape[0] >= 71
    assert engine.block_manager.tables.array.shape[1] >= 31
    _run(engine)
    assert engine.block_manager.tables.num_rows_held == 0


# ------------------------------------------------------------------ input building
def _reference_inputs(
    *, prefills: list[PrefillRow], decodes: list[DecodeRow], sample_prefill: list[int], block_size: int
) -> dict[str, list[int] | list[list[int]]]:
    """What the per-row Python builder produced (the form before the columnar rows)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    cu = [0]
    pctx: list[int] = []
    logits: list[int] = []
    for row, samples in zip(prefills, sample_prefill, strict=True):
        n = len(row.token_ids)
        ids += row.token_ids
        pos += range(row.start_position, row.start_position + n)
        slots += [
            row.block_table[p // block_size] * block_size + p % block_size
            for p in range(row.start_position, row.start_position + n)
        ]
        cu.append(cu[-1] + n)
        pctx.append(row.start_position + n)
        logits += range(cu[-1] - samples, cu[-1])
    for j, d in enumerate(decodes):
        ids.append(d.token_id)
        pos.append(d.position)
        slots.append(d.block_table[d.position // block_size] * block_size + d.position % block_size)
        logits.append(cu[-1] + j)

    def padded(tables: list[list[int]]) -> list[list[int]]:
        width = max((len(t) for t in tables), default=0)
        return [t + [0] * (width - len(t)) for t in tables]

    return {
        "input_ids": ids,
        "positions": pos,
        "slot_mapping": slots,
        "cu": cu,
        "prefill_ctx": pctx,
        "decode_ctx": [d.position + 1 for d in decodes],
        "logits": logits,
        "prefill_tables": padded([r.block_table for r in prefills]),
        "decode_tables": padded([d.block_table for d in decodes]),
    }


def _as_lists(inputs: StepInputs) -> dict[str, list[int] | list[list[int]]]:
    md = inputs.md
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": md.slot_mapping.tolist(),
        "cu": md.prefill_cu_seqlens_q.tolist(),
        "prefill_ctx": md.prefill_context_lens.tolist(),
        "decode_ctx": md.decode_context_lens.tolist(),
        "logits": inputs.logits_indices.tolist(),
        "prefill_tables": md.prefill_block_tables.tolist() if md.num_prefills else [],
        "decode_tables": md.decode_block_tables.tolist() if md.num_decodes else [],
    }


@pytest.mark.parametrize("seed", range(8))
def test_columnar_inputs_equal_the_per_row_build(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])

    def table(num_tokens: int) -> list[int]:
        return rng.sample(range(1000), -(-num_tokens // block_size))

    prefills = []
    for _ in range(rng.randint(0, 4)):
        start, n = rng.randint(0, 40), rng.randint(1, 30)
        prefills.append(
            PrefillRow(
                token_ids=[rng.randrange(VOCAB) for _ in range(n)], start_position=start, block_table=table(start + n)
            )
        )
    sample_prefill = [rng.choice([0, 1, 3]) if len(r.token_ids) >= 3 else 1 for r in prefills]
    decodes = []
    for _ in range(rng.randint(0 if prefills else 1, 40)):
        position = rng.randint(0, 90)
        decodes.append(DecodeRow(token_id=rng.randrange(VOCAB), position=position, block_table=table(position + 1)))
    want = _reference_inputs(prefills=prefills, decodes=decodes, sample_prefill=sample_prefill, block_size=block_size)
    from_rows = build_step_inputs(
        prefills=prefills, decodes=decodes, sample_prefill=sample_prefill, block_size=block_size, device=CPU
    )
    columnar = StepRows(prefills=prefills, decodes=DecodeRows.from_rows(decodes), sample_prefill=sample_prefill)
    assert _as_lists(from_rows) == want
    assert _as_lists(columnar.build(block_size=block_size, device=CPU)) == want
    assert from_rows.md.prefill_max_q_len == max((len(r.token_ids) for r in prefills), default=0)
    assert from_rows.md.decode_max_context_len == max((d.position + 1 for d in decodes), default=0)


def test_decode_rows_slice_and_iterate_like_a_list() -> None:
    rows = [DecodeRow(token_id=i, position=3 * i, block_table=list(range(i + 1))) for i in range(6)]
    columnar = DecodeRows.from_rows(rows)
    assert len(columnar) == 6
    part = columnar[2:5]
    assert len(part) == 3 and part.token_ids.tolist() == [2, 3, 4]
    # iteration yields the rows back (tables zero-padded to the widest)
    back = list(columnar)
    assert [r.token_id for r in back] == list(range(6)) and [r.position for r in back] == [0, 3, 6, 9, 12, 15]
    assert back[1].block_table == [0, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="one token id, position and block-table row"):
        DecodeRows(
            token_ids=np.zeros(2, dtype=np.int64),
            positions=np.zeros(3, dtype=np.int64),
            block_tables=np.zeros((3, 1), dtype=np.int32),
        )


def test_new_output_sets_every_field() -> None:
    out = new_output("r", [5], "x", None, "stop", 3, 1, 0, 0.5, [], 0.7)
    names = {f.name for f in dataclasses.fields(RequestOutput)}
    assert {name: getattr(out, name) for name in names} == dataclasses.asdict(
        RequestOutput(
            request_id="r",
            new_token_ids=[5],
            new_text="x",
            new_logprobs=None,
            finished=True,
            finish_reason="stop",
            num_prompt_tokens=3,
            num_output_tokens=1,
            num_cached_tokens=0,
            ttft_seconds=0.5,
            e2e_seconds=0.7,
        )
    )


# ------------------------------------------------------------------ asynchronous scheduling
class _Letters:
    """A detokenizer: token t is the letter ``chr(97 + t % 8)``; optionally slow (host work)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def step(self, token_id: int) -> str:
        if self.delay_s:
            time.sleep(self.delay_s)
        return chr(97 + token_id % 8)

    def flush(self) -> str:
        return ""


def _letters(prompt: list[int], *, delay_s: float = 0.0) -> Detokenizer:
    return _Letters(delay_s)


def _engine(
    *,
    async_scheduling: bool,
    eos: tuple[int, ...] = (),
    delay_s: float = 0.0,
    forward_seconds: float = 0.0,
    **overrides: object,
) -> LLMEngine:
    model = NullModel(vocab_size=VOCAB, forward_seconds=forward_seconds)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    return LLMEngine(
        model=model,
        kv_spec=spec,
        vocab_size=VOCAB,
        config=_config(async_scheduling=async_scheduling, **overrides),
        device=CPU,
        eos_token_ids=eos,
        detokenizer_factory=partial(_letters, delay_s=delay_s),
    )


def _greedy(prompt: list[int], n: int) -> list[int]:
    out, token = [], prompt[-1]
    for _ in range(n):
        token = null_next_token(token, vocab_size=VOCAB)
        out.append(token)
    return out


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    return [
        (shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for i in range(14)
    ]


EOS = _greedy(_prompts()[1], 6)[5]  # request r1 (greedy) meets its eos as its 6th token


def _mixed_workload(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Greedy and seeded requests, eos / stop tokens / stop strings / min_tokens / max_tokens,
    shared prefixes, preemption (small pool), and aborts while running and while waiting."""
    rng = random.Random(4)
    outs: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(_prompts()):
        greedy = _greedy(prompt, 8)
        text = "".join(chr(97 + t % 8) for t in greedy)
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=None if i % 2 else i,
            max_tokens=rng.randint(8, 24),
            ignore_eos=i % 5 == 0,
            stop_token_ids=[greedy[2]] if i % 4 == 3 else [],
            stop=[text[3:5]] if i in (5, 9) else [],
            min_tokens=4 if i == 7 else 0,
            logprobs=1 if i % 5 == 1 else None,
        )
        engine.add_request(request_id=f"r{i}", prompt_token_ids=prompt, params=params)
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        if step == 3:
            for rid in ("r4", "r13"):  # r13 is still waiting
                final = engine.abort_request(rid)
                if final is not None:
                    outs.setdefault(rid, []).append(final)
    return outs


def _comparable(outs: dict[str, list[RequestOutput]]) -> dict[str, object]:
    return {
        rid: [
            (
                o.new_token_ids,
                o.new_text,
                o.finished,
                o.finish_reason,
                o.num_output_tokens,
                o.num_cached_tokens,
                None if o.new_logprobs is None else [lp.token_id for lp in o.new_logprobs],
            )
            for o in seq
        ]
        for rid, seq in sorted(outs.items())
    }


def test_async_scheduling_gives_the_synchronous_results() -> None:
    sync = _engine(async_scheduling=False, eos=(EOS,), num_kv_blocks=24, max_num_batched_tokens=24)
    overlapped = _engine(async_scheduling=True, eos=(EOS,), num_kv_blocks=24, max_num_batched_tokens=24)
    assert not sync.async_scheduling and overlapped.async_scheduling
    want, got = _mixed_workload(sync), _mixed_workload(overlapped)
    assert _comparable(got) == _comparable(want)
    reasons = {rid: o[-1].finish_reason for rid, o in want.items()}
    assert reasons["r1"] == "stop" and len(want["r1"]) == 6  # eos
    assert reasons["r3"] == reasons["r11"] == "stop"  # stop tokens (greedy r3, r11)
    assert reasons["r5"] == reasons["r9"] == "stop"  # stop strings
    assert reasons["r4"] == reasons["r13"] == "abort"
    a, b = sync.stats(), overlapped.stats()
    assert a.preemptions_total > 0
    for field in (
        "generation_tokens_total",
        "prompt_tokens_total",
        "prefix_cache_hit_tokens_total",
        "prefix_cache_queried_tokens_total",
    ):
        assert getattr(b, field) == getattr(a, field), field
    for engine in (sync, overlapped):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.runner.sampler._generators == {}
        assert engine.scheduler._by_id == {} and not engine.scheduler.waiting
        engine.close()


def test_async_scheduling_does_not_schedule_past_max_tokens() -> None:
    engine = build_null_engine(config=_config(async_scheduling=True))
    engine.add_request(request_id="a", prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=4))
    outs = _run(engine)["a"]
    assert len(outs) == 4 and outs[-1].finish_reason == "length"
    assert engine.runner.model.num_forward_calls == 4  # type: ignore[attr-defined]
    engine.close()


def test_async_scheduling_keeps_kv_like_synchronous_steps() -> None:
    kept = {}
    for mode in (False, True):
        engine = _engine(async_scheduling=mode, eos=(5,))
        engine.add_request(
            request_id="p",
            prompt_token_ids=list(range(40, 53)),
            params=SamplingParams(temperature=0, max_tokens=1),
            keep_kv=True,
        )
        engine.add_request(
            request_id="q",
            prompt_token_ids=list(range(60, 70)),
            params=SamplingParams(temperature=0, max_tokens=6),
            keep_kv=True,
        )
        _run(engine)
        kept[mode] = [(k.token_ids, k.block_ids) for k in (engine.kept_kv("p"), engine.kept_kv("q")) if k]
        assert len(kept[mode]) == 2
        assert engine.release_kept_kv("p") and engine.release_kept_kv("q")
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        engine.close()
    assert kept[True] == kept[False]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_ends_at_its_prefill_leaves_its_prefix_cached(async_scheduling: bool) -> None:
    # a prefill pod's requests: max_tokens=1, each ends in the step that computes its prompt
    engine = build_null_engine(config=_config(async_scheduling=async_scheduling))
    shared = list(range(100, 124))  # 6 blocks of 4
    for i in range(3):
        engine.add_request(
            request_id=f"p{i}",
            prompt_token_ids=[*shared, 200 + i],
            params=SamplingParams(temperature=0, max_tokens=1),
            keep_kv=i == 0,
        )
        _run(engine)
    assert engine.stats().prefix_cache_hit_tokens_total == 2 * len(shared)
    kept = engine.kept_kv("p0")
    assert kept is not None and kept.num_tokens == len(shared) + 1
    engine.close()


def test_async_scheduling_is_off_where_it_cannot_work() -> None:
    spec = SpeculativeConfig(method="ngram", num_tokens=2)
    model = NullModel(vocab_size=VOCAB)
    kv = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    speculating = LLMEngine(model=model, kv_spec=kv, vocab_size=VOCAB, config=_config(), device=CPU, speculative=spec)
    assert not speculating.async_scheduling
    with pytest.raises(ValueError, match="speculative decoding"):
        LLMEngine(
            model=model,
            kv_spec=kv,
            vocab_size=VOCAB,
            config=_config(async_scheduling=True),
            device=CPU,
            speculative=spec,
        )

    class Driver(ModelRunner):  # like the parallel driver: its forward talks to other ranks
        def before_forward(self, rows: StepRows) -> None:
            pass

    driven = LLMEngine(model=model, kv_spec=kv, vocab_size=VOCAB, config=_config(), device=CPU, runner_factory=Driver)
    assert not driven.async_scheduling
    with pytest.raises(ValueError, match="other ranks"):
        LLMEngine(
            model=model,
            kv_spec=kv,
            vocab_size=VOCAB,
            config=_config(async_scheduling=True),
            device=CPU,
            runner_factory=Driver,
        )
