"""CUDA graphs for pure-decode steps (``engine/cuda_graphs.py``), checked on the CPU.

The bucket logic is pure. The padded static-buffer path runs here through the eager-replay
backend (the same buffers, padding and fixed metadata a captured graph reads, without
``torch.cuda.CUDAGraph``): on the tiny Llama a decode step through it gives the normal path's
logits and leaves the KV caches exactly as the normal path does (so padded rows wrote
nothing), at batch sizes around the bucket edges; a whole engine gives the same tokens. The
flag's refusals (no CUDA device, asynchronous scheduling, tensor parallelism) are clear errors.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_to_completion

from splitserve_contract import ServeArgs, serve_argv
from splitserve_contract.flags import add_serve_arguments, serve_args_from_namespace
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.cuda_graphs import (
    DecodeBuffers,
    EagerReplay,
    bucket_for,
    check_buckets,
    decode_buckets,
)
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.model_runner import ModelRunner
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.step_inputs import DecodeRows, PrefillRow, StepRows

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
BASE = ServeArgs(
    device="cpu",
    block_size=BLOCK_SIZE,
    num_kv_blocks=96,
    max_model_len=MAX_MODEL_LEN,
    max_num_batched_tokens=256,
    max_num_seqs=16,
    prefix_caching=False,
)


# ---------------------------------------------------------------- buckets


@pytest.mark.parametrize(
    ("largest", "expected"),
    [
        (1, (1,)),
        (2, (1, 2)),
        (3, (1, 2, 4)),
        (4, (1, 2, 4)),
        (5, (1, 2, 4, 8)),
        (8, (1, 2, 4, 8)),
        (9, (1, 2, 4, 8, 16)),
        (20, (1, 2, 4, 8, 16, 24)),
    ],
)
def test_default_buckets_cover_the_largest_batch_with_the_fewest_padded_rows(
    largest: int, expected: tuple[int, ...]
) -> None:
    assert decode_buckets(largest) == expected


def test_default_buckets_are_1_2_4_and_every_multiple_of_8_up_to_512() -> None:
    buckets = decode_buckets(256)
    assert buckets[:4] == (1, 2, 4, 8) and buckets[-1] == 256 and len(buckets) == 35
    assert all(b - a == 8 for a, b in zip(buckets[3:], buckets[4:], strict=False))
    assert decode_buckets(4096)[-1] == 512 and decode_buckets(4096, cap=1024)[-1] == 1024


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_default_buckets_refuse_a_largest_batch_that_is_not_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="largest CUDA graph batch"):
        decode_buckets(bad)  # type: ignore[arg-type]


def test_explicit_buckets_are_sorted_and_bad_ones_refused_clearly() -> None:
    assert check_buckets([8, 1, 4]) == (1, 4, 8)
    with pytest.raises(ValueError, match="at least one"):
        check_buckets([])
    with pytest.raises(ValueError, match="integers >= 1, got 0"):
        check_buckets([4, 0])
    with pytest.raises(ValueError, match="integers >= 1"):
        check_buckets([1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="repeat"):
        check_buckets([2, 4, 2])


@pytest.mark.parametrize(
    ("rows", "bucket"),
    [
        (0, None),
        (1, 1),
        (2, 2),
        (3, 4),
        (4, 4),
        (5, 8),
        (8, 8),
        (9, 16),
        (16, 16),
        (17, None),
    ],
)
def test_a_batch_runs_in_the_smallest_bucket_that_holds_it_or_eagerly(rows: int, bucket: int | None) -> None:
    assert bucket_for(rows, (1, 2, 4, 8, 16)) == bucket


# ---------------------------------------------------------------- static buffers


def _rows(positions: list[int], tables: list[list[int]]) -> DecodeRows:
    width = max(len(t) for t in tables)
    block_tables = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    return DecodeRows(
        token_ids=np.arange(10, 10 + len(positions), dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        block_tables=block_tables,
    )


def test_buffers_hold_real_rows_then_padding_that_writes_nowhere() -> None:
    buffers = DecodeBuffers(
        max_batch_size=8,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
    )
    rows = _rows([5, 0, 9], [[7, 3], [2], [1, 4, 6]])
    buffers.fill(rows, 4)
    ids, positions, md = buffers.views(4)
    assert ids.tolist() == [10, 11, 12, 0] and positions.tolist() == [5, 0, 9, 0]
    assert md.slot_mapping.tolist() == [3 * 4 + 1, 2 * 4 + 0, 6 * 4 + 1, -1]
    assert md.decode_context_lens.tolist() == [6, 1, 10, 1]
    assert md.num_decodes == 4 and md.num_prefills == 0 and md.num_prefill_tokens == 0
    assert md.decode_block_tables.shape == (4, MAX_MODEL_LEN // BLOCK_SIZE)
    assert md.decode_block_tables[:, :3].tolist() == [[7, 3, 0], [2, 0, 0], [1, 4, 6], [0, 0, 0]]
    assert md.decode_max_context_len == MAX_MODEL_LEN
    # a smaller batch in the same bucket overwrites every row's ids, slot, context length and
    # the table columns its rows can read (the context's); later columns are never read
    buffers.fill(_rows([1], [[5]]), 4)
    assert ids.tolist() == [10, 0, 0, 0] and positions.tolist() == [1, 0, 0, 0]
    assert md.slot_mapping.tolist() == [5 * 4 + 1, -1, -1, -1]
    assert md.decode_context_lens.tolist() == [2, 1, 1, 1]
    assert md.decode_block_tables[:, 0].tolist() == [5, 0, 0, 0]


def test_buffers_refuse_rows_that_do_not_fit() -> None:
    buffers = DecodeBuffers(max_batch_size=4, max_model_len=8, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit bucket 2"):
        buffers.fill(_rows([1, 1, 1], [[1], [2], [3]]), 2)
    beyond = _rows([8], [[1, 2, 3]])
    assert not buffers.fits(beyond)
    with pytest.raises(ValueError, match="beyond max_model_len"):
        buffers.fill(beyond, 1)
    with pytest.raises(ValueError, match="larger than the buffers"):
        buffers.views(8)


# ---------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine.from_args(dataclasses.replace(BASE, model=str(tiny_llama_dir)))


def _fresh_runner(engine: LLMEngine) -> ModelRunner:
    """A runner on the engine's tiny model with KV caches of its own."""
    return ModelRunner(
        model=engine.runner.model,
        spec=engine.runner.spec,
        device=torch.device("cpu"),
        block_size=BLOCK_SIZE,
        num_blocks=96,
    )


def _prefill_sequences(runner: ModelRunner, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """Fill the KV of ``count`` sequences of different lengths in scrambled blocks (block 0, what
    padded rows read, belongs to one of them); their prompts and block tables."""
    gen = torch.Generator().manual_seed(count)
    free = torch.randperm(runner.num_blocks, generator=gen).tolist()
    free.remove(0)
    free.insert(5, 0)
    prompts, tables = [], []
    for i in range(count):
        length = 3 + 5 * i % 17
        prompt = torch.randint(1, 500, (length,), generator=gen).tolist()
        table = [free.pop(0) for _ in range(length // BLOCK_SIZE + 1)]  # room for one decode token
        with torch.inference_mode():
            runner.forward_logits(
                StepRows(
                    prefills=[PrefillRow(token_ids=prompt, start_position=0, block_table=table)],
                    decodes=[],
                    sample_prefill=[1],
                )
            )
        prompts.append(prompt)
        tables.append(table)
    return prompts, tables


def _decode_rows(prompts: list[list[int]], tables: list[list[int]]) -> DecodeRows:
    return _rows_with_ids([p[-1] for p in prompts], [len(p) for p in prompts], tables)


def _rows_with_ids(ids: list[int], positions: list[int], tables: list[list[int]]) -> DecodeRows:
    rows = _rows(positions, tables)
    rows.token_ids[:] = ids
    return rows


def _snapshot(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def _restore(runner: ModelRunner, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for (k, v), (k0, v0) in zip(runner.kv_caches, saved, strict=True):
        k.copy_(k0)
        v.copy_(v0)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 8, 9])
def test_a_decode_step_through_the_padded_buffers_matches_the_normal_path(engine: LLMEngine, num_rows: int) -> None:
    runner = _fresh_runner(engine)
    prompts, tables = _prefill_sequences(runner, num_rows)
    rows = StepRows(prefills=[], decodes=_decode_rows(prompts, tables), sample_prefill=[])
    before = _snapshot(runner)
    with torch.inference_mode():
        expected = runner.forward_logits(rows)
    written = _snapshot(runner)
    _restore(runner, before)

    runner.capture_decode_graphs(max_model_len=MAX_MODEL_LEN, buckets=(1, 2, 4, 8), backend=EagerReplay())
    assert _snapshot_equal(runner, before), "capturing wrote KV"
    graphs = runner.decode_graphs
    assert graphs is not None
    replays: list[int] = []
    graphs.forward = _counting(graphs.forward, replays)  # type: ignore[method-assign, assignment]
    with torch.inference_mode():
        got = runner.forward_logits(rows)
    assert replays == ([num_rows] if num_rows <= 8 else [])  # 9: above the largest bucket, eager
    assert expected is not None and got is not None and got.shape == expected.shape == (num_rows, 512)
    # equal up to fp32 rounding (the fixed metadata has attention read a longer, masked
    # context, which reorders SDPA's sums), and the same greedy tokens
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))
    # the real rows wrote what the normal path wrote (same rounding), nothing else changed
    real_slots = {
        t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(tables, (len(q) for q in prompts), strict=True)
    }
    untouched = torch.ones(runner.num_blocks * BLOCK_SIZE, dtype=torch.bool)
    untouched[sorted(real_slots)] = False
    for (k, v), (k0, v0), (kw, vw) in zip(runner.kv_caches, before, written, strict=True):
        for now, old, eager in ((k, k0, kw), (v, v0, vw)):
            flat, flat_old = now.flatten(0, 1), old.flatten(0, 1)
            assert torch.equal(flat[untouched], flat_old[untouched]), "a padded row wrote KV"
            torch.testing.assert_close(now, eager, rtol=0, atol=1e-5)


def _snapshot_equal(runner: ModelRunner, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(
        torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, saved, strict=True)
    )


def _counting(forward: Callable[[DecodeRows], torch.Tensor], calls: list[int]) -> Callable[[DecodeRows], torch.Tensor]:
    def counted(rows: DecodeRows) -> torch.Tensor:
        calls.append(len(rows))
        return forward(rows)

    return counted


def test_an_engine_with_decode_graphs_gives_the_eager_engines_tokens(tiny_llama_dir: Path) -> None:
    prompts = {f"r{i}": list(range(5 + i, 5 + i + 3 + 4 * i)) for i in range(11)}  # 3..43 tokens
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    args = dataclasses.replace(BASE, model=str(tiny_llama_dir), max_num_seqs=8)
    results = []
    replays: list[int] = []
    for graphs_on in (False, True):
        engine = LLMEngine.from_args(args)
        if graphs_on:
            engine.runner.capture_decode_graphs(
                max_model_len=engine.max_model_len, buckets=decode_buckets(8), backend=EagerReplay()
            )
            graphs = engine.runner.decode_graphs
            assert graphs is not None
            graphs.forward = _counting(graphs.forward, replays)  # type: ignore[method-assign, assignment]
        results.append(
            (
                run_to_completion(engine, prompts, greedy),
                run_to_completion(engine, {f"s{k}": p for k, p in prompts.items()}, sampled),
            )
        )
        engine.close()
    assert results[0] == results[1]
    # 11 requests, 8 at a time: decode steps of 8 (bucket 8), then of the last 3 (bucket 4, one
    # padded row) ran in graphs; prefill steps eagerly
    assert {8, 3} <= set(replays) and max(replays) <= 8


# ---------------------------------------------------------------- the flag


def test_the_serve_flag_reaches_the_engine_config_and_is_off_by_default() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert serve_args_from_namespace(parser.parse_args([])).cuda_graphs is False
    args = serve_args_from_namespace(parser.parse_args(["--cuda-graphs"]))
    assert args.cuda_graphs is True and "--cuda-graphs" in serve_argv(args)
    assert EngineConfig.from_serve_args(args, max_model_len=64).cuda_graphs is True
    assert EngineConfig(max_model_len=64).cuda_graphs is False


def test_the_flag_is_refused_where_graphs_cannot_run(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, this engine runs on cpu"):
        engine.runner.capture_decode_graphs(max_model_len=MAX_MODEL_LEN, buckets=(1, 2))
    with pytest.raises(ValueError, match="asynchronous scheduling"):
        EngineConfig(max_model_len=64, cuda_graphs=True, async_scheduling=True)
    for parallel in (
        ServeArgs(cuda_graphs=True, tensor_parallel_size=2),
        ServeArgs(cuda_graphs=True, pipeline_parallel_size=2),
    ):
        with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
            EngineConfig.from_serve_args(parallel, max_model_len=64)

    on_cuda = _fresh_runner(engine)
    on_cuda.device = torch.device("cuda")  # checked before anything touches the device
    with pytest.raises(ValueError, match="need the triton attention backend, not 'torch'"):
        on_cuda.capture_decode_graphs(max_model_len=MAX_MODEL_LEN, buckets=(1, 2))

    class DrivesOtherRanks(ModelRunner):
        def forward_logits(self, rows: StepRows) -> torch.Tensor | None:
            return super().forward_logits(rows)

    runner = DrivesOtherRanks(
        model=engine.runner.model,
        spec=engine.runner.spec,
        device=torch.device("cpu"),
        block_size=BLOCK_SIZE,
        num_blocks=4,
    )
    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        runner.capture_decode_graphs(max_model_len=MAX_MODEL_LEN, buckets=(1,), backend=EagerReplay())


def test_an_engine_built_with_the_flag_captures_or_refuses(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        LLMEngine.from_args(dataclasses.replace(BASE, model=str(tiny_llama_dir), cuda_graphs=True))
