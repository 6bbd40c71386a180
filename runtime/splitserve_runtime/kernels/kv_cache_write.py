"""Scatter a step's K/V rows into the paged cache by ``slot_mapping`` ("reshape_and_cache").

One program per token copies all ``num_kv_heads * head_dim`` elements of its key and value
row to ``slot = block_id * block_size + offset`` of the ``[num_blocks, block_size,
num_kv_heads, head_dim]`` caches. Negative slots (padding) are skipped with a mask, so the
kernel has no data-dependent control flow. Keys and values may be strided views (slices of a
fused QKV projection); only the last dimension must be contiguous.

An fp8 (e4m3) cache stores ``clamp(k / k_scale, ±448)`` rounded to e4m3 (see :mod:`._fp8`);
the ``KV_FP8`` constexpr keeps that code out of the bf16/fp16/fp32 kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_tensor,
    interpreting,
    next_power_of_2,
)
from ._fp8 import KV_CACHE_DTYPES, check_kv_scale, is_fp8_kv, quantize_fp8


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    KV_FP8: tl.constexpr,
    EXACT_FP8_ROUNDING: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HD)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = (offs < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
    src_k = token.to(tl.int64) * stride_kt + head * stride_kh + dim
    src_v = token.to(tl.int64) * stride_vt + head * stride_vh + dim
    dst = slot * stride_cache_slot + offs
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    if KV_FP8:
        k = quantize_fp8(k, inv_k_scale, EXACT_FP8_ROUNDING)
        v = quantize_fp8(v, inv_v_scale, EXACT_FP8_ROUNDING)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches in place.

    ``slot_mapping`` is ``[num_tokens]`` (int32/int64); negative entries are not written.
    Slots must be below ``num_blocks * block_size`` (not checked on the device).
    ``k_scale``/``v_scale`` are the per-tensor scales of an fp8 cache (ignored otherwise).
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    check_kv_scale("k_scale", k_scale)
    check_kv_scale("v_scale", v_scale)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_tokens, num_kv_heads, head_dim = key.shape
    if (k_cache.shape[2], k_cache.shape[3]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key has {num_kv_heads} heads of dim {head_dim}, cache has "
            f"{k_cache.shape[2]} heads of dim {k_cache.shape[3]}"
        )
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    block_hd = next_power_of_2(num_kv_heads * head_dim)
    _kv_cache_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads * head_dim,
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HD=block_hd,
        KV_FP8=is_fp8_kv(k_cache.dtype),
        EXACT_FP8_ROUNDING=interpreting(),
        num_warps=4 if block_hd >= 1024 else 2,
    )
