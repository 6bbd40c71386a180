"""Paged decode attention as split-KV flash-decoding (one query row per sequence).

Stage 1, grid ``(batch, kv_head, num_splits)``: each program owns one KV head of one
sequence and one contiguous slice of its context. All ``group = num_heads / num_kv_heads``
query heads that share the KV head are packed into one ``[BLOCK_G, head_dim]`` tile
(``BLOCK_G`` = group padded to a power of two >= 16, the smallest ``tl.dot`` M), so K/V
are read from HBM once per group and the score and PV products run on tensor cores. K/V
rows are gathered through the block table tile by tile (``BLOCK_N`` tokens, any multiple or
fraction of the page size). An online softmax in the log2 domain (scores prescaled by
``scale * log2(e)``, ``tl.exp2``) yields the slice's normalised partial output and its
log-sum-exp, written to an fp32 workspace ``[batch, num_heads, num_splits, head_dim]``.

Stage 2, grid ``(batch, num_heads)``: merges the splits with the usual LSE weights. Empty
splits (short sequences in a batch sized for long ones) write ``lse = -inf`` and drop out.

An fp8 (e4m3) cache is read as fp8 and converted in registers to q's dtype (exact);
``k_scale`` is folded into the score scale and ``v_scale`` into each split's output (see
:mod:`._fp8`), under the ``KV_FP8`` constexpr so 16/32-bit caches compile as before.

The split count is a runtime argument (no recompilation when it changes) chosen on the host
from the batch's maximum context length and the SM count so that ``batch * kv_heads *
splits`` fills the GPU; each sequence divides its own context into that many slices, so
short sequences get short slices.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._attention_common import LOG2E, check_paged_inputs, dot_precision
from ._common import interpreting, next_power_of_2

MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 2


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    num_splits,
    qk_scale,
    v_scale,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        offs = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs < end
        block = tl.load(table_row + offs // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = block * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = block * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out_ptrs = part_out_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(out_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(lse - m)
    total = tl.sum(w, axis=0)
    parts = tl.load(
        part_out_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_num_splits(
    *,
    batch: int,
    num_kv_heads: int,
    max_context_len: int,
    block_n: int,
    num_sms: int,
) -> int:
    """Splits per sequence so that ``batch * kv_heads * splits`` covers ~2 waves of SMs.

    Never more than :data:`MAX_SPLITS`, and every split keeps at least
    :data:`MIN_TILES_PER_SPLIT` tiles of ``block_n`` tokens of the longest sequence.
    Rounded down to a power of two so only a handful of reduce-kernel variants exist.
    """
    tiles = max(1, -(-max_context_len // block_n))
    wanted = -(-2 * num_sms // max(1, batch * num_kv_heads))
    splits = max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def decode_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``q [batch, num_heads, head_dim]`` over each sequence's paged context.

    ``context_lens[b]`` (>= 1) tokens of sequence b are read through ``block_tables[b]``;
    ``max_context_len`` bounds them (host value, used only to size the split count and to
    check the table width). Returns ``[batch, num_heads, head_dim]`` in q's dtype.
    ``num_splits``/``block_n``/``num_warps``/``num_stages`` override the heuristics
    (benchmarks, tests). ``k_scale``/``v_scale``: per-tensor scales of an fp8 cache (ignored
    for 16/32-bit caches).
    """
    shapes = check_paged_inputs(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        context_lens=context_lens,
        max_context_len=max_context_len,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    batch = q.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(f"q has {batch} rows but block_tables has {block_tables.shape[0]}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in head_dim")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must match q {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)}")
    if batch == 0:
        return out

    interp = interpreting()
    if block_n is None:
        block_n = 32 if interp else 64
    if block_n < 16 or block_n & (block_n - 1) != 0:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if q.device.type == "cuda" else 8
        num_splits = choose_num_splits(
            batch=batch, num_kv_heads=shapes.num_kv_heads, max_context_len=max_context_len, block_n=block_n, num_sms=sms
        )
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in 1..1024, got {num_splits}")

    head_dim = shapes.head_dim
    block_d = next_power_of_2(head_dim)
    part_out = torch.empty((batch, shapes.num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, shapes.num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, shapes.num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        num_splits,
        scale * LOG2E * (k_scale if shapes.kv_fp8 else 1.0),
        v_scale,
        GROUP=shapes.group,
        BLOCK_G=max(16, next_power_of_2(shapes.group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=shapes.block_size,
        BLOCK_N=block_n,
        DOT_FP32=interp or q.dtype == torch.float32,
        INPUT_PRECISION=dot_precision(q.dtype),
        KV_FP8=shapes.kv_fp8,
        num_warps=num_warps or 4,
        num_stages=num_stages or 2,
    )
    _decode_reduce_kernel[(batch, shapes.num_heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=next_power_of_2(num_splits),
        num_warps=2 if head_dim <= 64 else 4,
    )
    return out
