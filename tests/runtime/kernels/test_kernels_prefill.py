"""Causal varlen prefill / extend attention over the paged cache vs a dense reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_refs import (
    DEVICE,
    assert_close,
    dense_attention,
    gather_seq,
    make_paged_kv,
    tolerance,
)

from splitserve_runtime.kernels.prefill_attention import prefill_attention


def _check_prefill(
    *,
    q_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    block_m: int = 16,
    block_n: int = 16,
    seed: int = 0,
) -> None:
    kv = make_paged_kv(
        context_lens=context_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(seed + 7)
    q = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    out = prefill_attention(
        q=q,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_tables=kv.block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=cu,
        max_q_len=max(q_lens),
        max_context_len=max(context_lens),
        scale=scale,
        block_m=block_m,
        block_n=block_n,
    )
    assert out.shape == q.shape and out.dtype == dtype
    for b, (q_len, ctx) in enumerate(zip(q_lens, context_lens, strict=True)):
        k, v = gather_seq(kv, b)
        rows = slice(int(cu[b]), int(cu[b + 1]))
        positions = [ctx - q_len + i for i in range(q_len)]
        ref = dense_attention(q=q[rows], k=k, v=v, q_positions=positions, scale=scale)
        assert_close(out[rows].double().cpu(), ref, tol=tolerance(dtype), what=f"sequence {b}")


@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 4), (1, 8)])
def test_prefill_fresh_prompts_ragged(num_kv_heads: int, group: int) -> None:
    # Lengths 1, one page - 1, one q block + 1, two pages + 1.
    q_lens = [1, 15, 17, 33]
    _check_prefill(
        q_lens=q_lens,
        context_lens=q_lens,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        dtype=torch.float32,
    )


def test_prefill_prefix_cached_and_chunks() -> None:
    # (q_len, context): prefix hit of 2 pages, 1-token extend, chunk crossing a page,
    # a chunk ending exactly on a page boundary, a fresh prompt in the same batch.
    q_lens = [9, 1, 20, 16, 5]
    context_lens = [41, 16, 37, 48, 5]
    _check_prefill(
        q_lens=q_lens, context_lens=context_lens, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )


def test_prefill_empty_sequence_in_batch() -> None:
    # A sequence with no query rows this step (cu_seqlens repeats) contributes nothing.
    _check_prefill(
        q_lens=[4, 0, 18], context_lens=[4, 8, 18], num_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32
    )


def test_prefill_head_dim_128_bf16_larger_tiles() -> None:
    _check_prefill(
        q_lens=[33, 1, 70],
        context_lens=[33, 50, 100],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype=torch.bfloat16,
        block_m=32,
        block_n=32,
    )


def test_prefill_head_dim_not_power_of_two() -> None:
    _check_prefill(q_lens=[18, 3], context_lens=[18, 20], num_heads=4, num_kv_heads=2, head_dim=80, dtype=torch.float32)


@pytest.mark.parametrize("block_size,block_m,block_n", [(8, 32, 16), (32, 16, 16)])
def test_prefill_page_and_tile_sizes(block_size: int, block_m: int, block_n: int) -> None:
    _check_prefill(
        q_lens=[31, 12],
        context_lens=[40, 12],
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        dtype=torch.float32,
        block_size=block_size,
        block_m=block_m,
        block_n=block_n,
    )


def test_prefill_leaves_rows_of_other_steps_alone() -> None:
    # An `out` buffer with extra trailing rows (e.g. the decode part of the step) must only
    # be written in the prefill rows.
    kv = make_paged_kv(context_lens=[5], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, seed=5)
    q = torch.randn((5, 2, 64), device=DEVICE)
    out = torch.full((5, 2, 64), 7.0, device=DEVICE)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)  # only 3 of 5 rows are ours
    prefill_attention(
        q=q,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_tables=kv.block_tables,
        context_lens=torch.tensor([3], dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=cu,
        max_q_len=3,
        max_context_len=3,
        scale=0.125,
        out=out,
    )
    assert torch.all(out[3:] == 7.0)
    assert not torch.any(out[:3] == 7.0)
