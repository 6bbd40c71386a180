"""Split-KV paged decode attention against a dense float64 reference."""

from __future__ import annotations

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

from splitserve_runtime.kernels.decode_attention import (
    MAX_SPLITS,
    choose_num_splits,
    decode_attention,
)


def _check_decode(
    *,
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None,
    block_n: int | None,
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
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn((len(context_lens), num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    out = decode_attention(
        q=q,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_tables=kv.block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        max_context_len=max(context_lens),
        scale=scale,
        num_splits=num_splits,
        block_n=block_n,
    )
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(context_lens):
        k, v = gather_seq(kv, b)
        ref = dense_attention(q=q[b : b + 1], k=k, v=v, q_positions=[n - 1], scale=scale)[0]
        assert_close(out[b].double().cpu(), ref, tol=tolerance(dtype), what=f"sequence {b}")


# Context lengths straddle page (16) and tile boundaries: k*16 - 1, k*16, k*16 + 1, and 1.
RAGGED = [1, 15, 16, 17, 47, 49]


@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_gqa_ratios_fp32(num_kv_heads: int, group: int, num_splits: int | None) -> None:
    # num_splits=3 over at most 4 tiles of 16 leaves empty splits for short sequences.
    _check_decode(
        context_lens=RAGGED,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        num_splits=num_splits,
        block_n=16,
    )


def test_decode_head_dim_128_bf16() -> None:
    _check_decode(
        context_lens=[1, 31, 33, 64],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        num_splits=2,
        block_n=32,
    )


def test_decode_head_dim_not_power_of_two() -> None:
    _check_decode(
        context_lens=[5, 33],
        num_heads=4,
        num_kv_heads=2,
        head_dim=80,
        block_size=16,
        dtype=torch.float32,
        num_splits=2,
        block_n=16,
    )


@pytest.mark.parametrize("block_size,block_n", [(32, 16), (8, 32)])
def test_decode_tile_smaller_and_larger_than_page(block_size: int, block_n: int) -> None:
    _check_decode(
        context_lens=[7, 40, 65],
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        num_splits=2,
        block_n=block_n,
    )


def test_decode_many_splits_long_context() -> None:
    # More splits than a short sequence has tiles; one sequence spans 10 pages.
    _check_decode(
        context_lens=[3, 160],
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        num_splits=8,
        block_n=16,
    )


def test_decode_ignores_stale_rows_past_context() -> None:
    ctx = [17]
    kv = make_paged_kv(context_lens=ctx, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, seed=3)
    q = torch.randn((1, 4, 64), device=DEVICE)
    args = dict(
        q=q,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_tables=kv.block_tables,
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
        max_context_len=17,
        scale=0.125,
        num_splits=1,
        block_n=16,
    )
    before = decode_attention(**args)
    second = int(kv.block_tables[0, 1])
    kv.k_cache[second, 1:] = 1e4  # slots after position 16 are garbage
    kv.v_cache[second, 1:] = float("nan")
    after = decode_attention(**args)
    torch.testing.assert_close(after, before, atol=0.0, rtol=0.0)


def test_choose_num_splits() -> None:
    # Batch 1, 8 KV heads, 32k context on 132 SMs: 2*132/8 = 33 -> 32 splits.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context_len=32768, block_n=64, num_sms=132) == 32
    # Large batches fill the GPU without splitting.
    assert choose_num_splits(batch=64, num_kv_heads=8, max_context_len=32768, block_n=64, num_sms=132) == 1
    # Short contexts keep >= 2 tiles per split.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context_len=256, block_n=64, num_sms=132) == 2
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context_len=10**6, block_n=64, num_sms=132) == MAX_SPLITS


def test_decode_padding_rows_with_zero_context_are_zero_not_nan() -> None:
    # CUDA-graph padding rows carry context_len 0: they must produce finite zeros and leave
    # the real rows intact.
    kv = make_paged_kv(context_lens=[20, 1], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=4)
    q = torch.randn((2, 4, 64), device=DEVICE)
    lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    out = decode_attention(
        q=q,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_tables=kv.block_tables,
        context_lens=lens,
        max_context_len=20,
        scale=0.125,
        num_splits=2,
        block_n=16,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    k, v = gather_seq(kv, 0)
    ref = dense_attention(q=q[:1], k=k, v=v, q_positions=[19], scale=0.125)[0]
    assert_close(out[0].double().cpu(), ref, tol=tolerance(torch.float32))
