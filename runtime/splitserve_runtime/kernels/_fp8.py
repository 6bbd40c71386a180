"""FP8 (e4m3) KV cache encoding shared by the KV write and the two attention kernels.

An fp8 KV cache stores ``fp8(clamp(x / scale, ±448))`` with one float scale per layer for K
and one for V (per-tensor, as vLLM does; 1.0 without calibration). Attention never
materialises ``fp8 * scale``: the cache tile is converted to the query's dtype (exact: every
e4m3 value is a bf16/fp16/fp32 value) and the scales are folded where they cost nothing,
``k_scale`` into the score scale and ``v_scale`` into the output, since
``q·(s k) = s (q·k)`` and ``Σ p (s v) = s Σ p v``.

The GPU path casts with ``.to(tl.float8e4nv)`` (``cvt.rn.satfinite`` on sm_89+: round to
nearest even). Triton 3.6's CPU interpreter implements that cast with a bit-twiddling
converter that mis-rounds (a mantissa carry is dropped, e.g. 0.4997 becomes 0.25) but is
exact for values already on the e4m3 grid, and its fp8 loads are exact. Under the
interpreter the write therefore first rounds in fp32 to the nearest e4m3 value (ties to
even) with :func:`round_to_e4m3_grid`, so interpreter and GPU store the same bytes as
``torch``'s own ``.to(torch.float8_e4m3fn)``; compiled kernels never contain that code.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES

KV_FP8_DTYPE = torch.float8_e4m3fn
KV_CACHE_DTYPES = (*FLOAT_DTYPES, KV_FP8_DTYPE)
FP8_MAX = tl.constexpr(448.0)
"""Largest finite e4m3fn value; larger magnitudes saturate to it instead of becoming NaN."""
_ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2**23: adding then subtracting it rounds an fp32 of magnitude < 2**22 to an integer,
ties to even."""


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype == KV_FP8_DTYPE


def check_kv_scale(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")


@triton.jit
def round_to_e4m3_grid(y):
    """Round fp32 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to even, in fp32."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # Subnormal e4m3 values share the spacing of the smallest normal binade, 2^-6 * 2^-3.
    step_exp = tl.maximum(exponent, -6) - 3
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    step = ((127 + step_exp) << 23).to(tl.float32, bitcast=True)
    units = tl.abs(y) * inv_step
    units = (units + _ROUND_MAGIC) - _ROUND_MAGIC
    magnitude = (units * step).to(tl.int32, bitcast=True)
    sign = bits ^ (bits & 0x7FFFFFFF)  # y's sign bit, so -0.0 stays -0.0 as in a real cast
    return (magnitude | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_fp8(x, inv_scale, EXACT_ROUNDING: tl.constexpr):
    """``fp8(clamp(x * inv_scale, ±448))``; ``EXACT_ROUNDING`` only under the interpreter."""
    y = x.to(tl.float32) * inv_scale
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if EXACT_ROUNDING:
        y = round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv)
