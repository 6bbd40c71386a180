"""The fp8 (e4m3) KV cache encoding in plain torch: the CPU path and the kernels' oracle.

A cache of dtype ``float8_e4m3fn`` holds ``clamp(x / scale, ±448)`` rounded to nearest even
(``torch``'s cast and the GPU's ``cvt.rn.satfinite`` agree; the clamp keeps torch from
turning out-of-range values into NaN), with one per-tensor ``scale`` per layer for K and one
for V. Reading multiplies back by the scale. A cache of any other dtype ignores the scales,
so a bf16/fp32 cache behaves exactly as without this module. CPU torch has no
``index_copy_`` for fp8, so rows are scattered through ``uint8`` views (same bytes).
"""

from __future__ import annotations

import torch

from ..quant.formats import FP8_DTYPE, FP8_MAX


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def encode_kv(x: torch.Tensor, *, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as stored in a cache of ``cache_dtype`` (quantized when that is fp8)."""
    if not is_fp8_kv(cache_dtype):
        return x.to(cache_dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def decode_kv(x: torch.Tensor, *, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache values ``x`` as ``dtype`` (dequantized when ``x`` is fp8)."""
    out = x.to(dtype)
    if is_fp8_kv(x.dtype) and scale != 1.0:
        out = out * scale
    return out


def scatter_kv_rows(
    *,
    cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
) -> None:
    """Write ``rows [n, num_kv_heads, head_dim]`` to flat ``slots`` of ``cache`` in place."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    flat = cache.view(-1, num_kv_heads, head_dim)
    encoded = encode_kv(rows, cache_dtype=cache.dtype, scale=scale)
    if is_fp8_kv(cache.dtype):
        flat, encoded = flat.view(torch.uint8), encoded.view(torch.uint8)
    flat.index_copy_(0, slots, encoded)
