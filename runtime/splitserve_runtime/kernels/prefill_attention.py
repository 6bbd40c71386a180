"""Causal varlen prefill / extend attention over the paged KV cache.

Grid ``(q_block, head, seq)``. A program takes ``BLOCK_M`` query rows of one head of one
sequence and runs an online softmax (log2 domain, ``tl.exp2``) over that sequence's K/V,
gathered tile by tile through its block table, so the same loop serves a fresh prompt, a
prompt whose prefix is already cached (``context_len > q_len``) and a later chunk of a
chunked prefill. Query row i of a sequence sits at absolute position
``context_len - q_len + i`` and sees cache positions ``0..position``.

The key range is cut in two loops: tiles that lie entirely before the block's first query
position need no mask at all (the bulk of the work for long prompts and prefix hits); the
remaining tiles up to the block's last position apply the causal and length masks.
Programs whose query block lies past the end of a short sequence exit at once, and query
blocks are issued last-first so the longest causal ranges start early (less tail at the end).

An fp8 (e4m3) cache is read as fp8 and converted in registers to q's dtype (exact);
``k_scale`` is folded into the score scale and ``v_scale`` into the output (see
:mod:`._fp8`), under the ``KV_FP8`` constexpr so 16/32-bit caches compile as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_common import LOG2E, check_paged_inputs, dot_precision
from ._common import INDEX_DTYPES, check_tensor, interpreting, next_power_of_2


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    tile_start,
    table_row,
    k_cache_ptr,
    v_cache_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    kv_head,
    q_pos,
    kv_end,
    qk_scale,
    d,
    d_mask,
    MASKED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    offs = tile_start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = offs < kv_end
        block = tl.load(table_row + offs // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        block = tl.load(table_row + offs // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    in_block = offs % BLOCK_SIZE
    k_rows = block * stride_kb + in_block * stride_kt + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
    if DOT_FP32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if MASKED:
        visible = (offs[None, :] <= q_pos[:, None]) & (offs[None, :] < kv_end)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows with nothing visible yet keep m = -inf; shift by 0 there to avoid inf - inf.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_rows = block * stride_vb + in_block * stride_vt + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    if DOT_FP32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    cu_seqlens_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    qk_scale,
    v_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Heaviest (last, longest-causal-range) query blocks first: better tail balance.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    block_first = q_block * BLOCK_M
    if block_first >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prefix_len = context_len - q_len
    kv_head = head // GROUP

    rows = block_first + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + rows) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = prefix_len + rows

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    # Keys before the first row's position are visible to every row of the block.
    full_end = ((prefix_len + block_first) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(prefix_len + block_first + BLOCK_M, context_len)
    for tile_start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            tile_start,
            table_row,
            k_cache_ptr,
            v_cache_ptr,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            kv_head,
            q_pos,
            kv_end,
            qk_scale,
            d,
            d_mask,
            False,
            BLOCK_SIZE,
            BLOCK_N,
            DOT_FP32,
            INPUT_PRECISION,
            KV_FP8,
        )
    for tile_start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            tile_start,
            table_row,
            k_cache_ptr,
            v_cache_ptr,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            kv_head,
            q_pos,
            kv_end,
            qk_scale,
            d,
            d_mask,
            True,
            BLOCK_SIZE,
            BLOCK_N,
            DOT_FP32,
            INPUT_PRECISION,
            KV_FP8,
        )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    o_rows = (q_start + rows) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :]
    )


def prefill_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_q_len: int,
    max_context_len: int,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the flattened ``q [num_tokens, num_heads, head_dim]`` rows.

    Sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and has ``context_lens[b]``
    (>= its q_len) tokens in the cache, this step's included. ``max_q_len`` and
    ``max_context_len`` are host-side bounds (grid size, table-width check). Returns a tensor
    shaped like q. Block sizes and launch options can be overridden (benchmarks, tests).
    ``k_scale``/``v_scale``: per-tensor scales of an fp8 cache (ignored for 16/32-bit caches).
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
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES)
    num_seqs = block_tables.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q must have {num_seqs + 1} entries, got {cu_seqlens_q.shape[0]}")
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q is on {cu_seqlens_q.device}, q on {q.device}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in head_dim")
    if max_q_len < 0 or max_q_len > max(max_context_len, 0):
        raise ValueError(f"max_q_len {max_q_len} must be in 0..max_context_len ({max_context_len})")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must match q {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)}")
    if num_seqs == 0 or max_q_len == 0 or q.shape[0] == 0:
        return out

    interp = interpreting()
    head_dim = shapes.head_dim
    if block_m is None:
        block_m = 32 if interp else 128
    if block_n is None:
        block_n = 32 if interp else 64
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1) != 0:
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if num_warps is None:
        num_warps = 8 if block_m >= 128 and head_dim >= 128 else 4
    if num_stages is None:
        num_stages = 3 if head_dim <= 128 else 2
    grid = (triton.cdiv(max_q_len, block_m), shapes.num_heads, num_seqs)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        cu_seqlens_q,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        scale * LOG2E * (k_scale if shapes.kv_fp8 else 1.0),
        v_scale,
        GROUP=shapes.group,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=shapes.block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=interp or q.dtype == torch.float32,
        INPUT_PRECISION=dot_precision(q.dtype),
        KV_FP8=shapes.kv_fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
