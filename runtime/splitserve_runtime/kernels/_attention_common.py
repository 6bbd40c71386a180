"""Validation shared by the two paged-attention launchers (decode and prefill).

Both read K/V from ``[num_blocks, block_size, num_kv_heads, head_dim]`` caches through a
block table; this module checks the pieces they have in common and returns the derived
sizes, so the launchers stay short. The cache is in q's dtype, or fp8 (e4m3) with per-tensor
``k_scale``/``v_scale`` for any q dtype (see :mod:`._fp8`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._common import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from ._fp8 import KV_CACHE_DTYPES, check_kv_scale, is_fp8_kv

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PagedShapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    group: int
    kv_fp8: bool


def check_paged_inputs(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> PagedShapes:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    kv_fp8 = is_fp8_kv(k_cache.dtype)
    if q.dtype != k_cache.dtype and not kv_fp8:
        raise ValueError(f"q is {q.dtype} but the KV cache is {k_cache.dtype}")
    check_kv_scale("k_scale", k_scale)
    check_kv_scale("v_scale", v_scale)
    if not block_tables.is_contiguous():
        raise ValueError("block_tables must be contiguous")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if head_dim < 16 or head_dim > 256:
        raise ValueError(f"head_dim must be in 16..256, got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1) != 0:
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if context_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"context_lens has {context_lens.shape[0]} entries, block_tables has {block_tables.shape[0]} rows"
        )
    if max_context_len < 0:
        raise ValueError(f"max_context_len must be >= 0, got {max_context_len}")
    needed_blocks = -(-max_context_len // block_size)
    if needed_blocks > block_tables.shape[1]:
        raise ValueError(
            f"max_context_len {max_context_len} needs {needed_blocks} blocks per sequence, "
            f"block_tables has {block_tables.shape[1]} columns"
        )
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    return PagedShapes(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        group=num_heads // num_kv_heads,
        kv_fp8=kv_fp8,
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches (tests, debugging) get exact fp32 dots; bf16/fp16 ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"
