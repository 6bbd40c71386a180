"""Neox-style ("rotate-half", as HF Llama) rotary position embedding for Q and K.

One program per token rotates all query and key heads of that token, so the
``cos_sin_cache[position]`` row (``cat(cos[:D/2], sin[:D/2])``, fp32) is read once and shared.
For each head, with ``x1 = x[:D/2]`` and ``x2 = x[D/2:]``::

    out[:D/2] = x1 * cos - x2 * sin
    out[D/2:] = x2 * cos + x1 * sin

computed in fp32 and rounded once. Out-of-place by default (the ``Ops`` contract); the
launcher can also rotate in place. Q and K may be strided views of a fused QKV output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor, next_power_of_2


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    token,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src = src_ptr + token * stride_st + heads * stride_sh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    dst = dst_ptr + token * stride_dt + heads * stride_dh + dims
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_cs,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims, mask=dmask, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        token,
        cos,
        sin,
        NUM_Q_HEADS,
        HALF,
        BLOCK_QH,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        token,
        cos,
        sin,
        NUM_K_HEADS,
        HALF,
        BLOCK_KH,
        BLOCK_HALF,
    )


def rotary_embedding(
    *,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions [T]``.

    ``cos_sin_cache`` is ``[max_pos, D]``; positions must be below ``max_pos`` (not checked
    on the device). Returns new tensors, or ``(q, k)`` rotated in place if ``inplace``.
    """
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens/head_dim")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}], got {tuple(cos_sin_cache.shape)}")
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_qh = next_power_of_2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        positions,
        cos_sin_cache,
        q,
        k,
        q_out,
        k_out,
        cos_sin_cache.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        BLOCK_QH=block_qh,
        BLOCK_KH=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
        num_warps=4 if block_qh * half >= 1024 else 2,
    )
    return q_out, k_out
