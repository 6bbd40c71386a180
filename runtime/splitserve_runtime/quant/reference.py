"""Torch reference GEMMs for the quantized layouts: the CPU path and the kernels' oracle.

Each function reproduces the numerics the GPU kernel implements, not just the maths of the
dequantized weight: W8A8 layers quantize every activation row at run time (the quantization
error is part of the model's behaviour, so the CPU path must show it too), accumulate exactly
(int32 for int8, fp32 over exact fp8 products for fp8) and scale in the epilogue. Weight-only
layers multiply in fp32: W4A16 dequantizes its groups, W8A16 applies its per-channel scale
to the product (the kernel's epilogue). Outputs are rounded once, to ``x``'s dtype.

No dense copy of a weight is ever kept: a layer's weight is dequantized per call, a slab of
output features at a time (:data:`DEQUANT_CHUNK_ELEMENTS` fp32 values), so peak extra memory
stays a few tens of MB whatever the layer size - the point of quantizing is the memory.

Per-token activation scales are ``max(amax(|x_row|), ACT_AMAX_FLOOR) / qmax``; the floor keeps
an all-zero row finite (and matches :mod:`splitserve_runtime.kernels.act_quant`). On a
tensor-parallel rank's share of a row-parallel projection, ``x_row`` is only the rank's slice of
the input: the weight's ``act_amax_reduce`` then turns the slice's amax into the whole row's
(a max over the ranks), so every rank quantizes its slice with the scale one process would use.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Final

import torch
import torch.nn.functional as F

from .formats import (
    FP8_DTYPE,
    FP8_MAX,
    INT4_PACK,
    INT8_MAX,
    AmaxReduce,
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    LinearWeight,
)

ACT_AMAX_FLOOR: Final = 1e-8
"""Smallest row amax used for an activation scale (a zero row quantizes to zeros)."""
DEQUANT_CHUNK_ELEMENTS: Final = 1 << 21
"""fp32 weight values dequantized at once (8 MB): bounds the per-call temporary and keeps
the few elementwise passes over it in cache (4x faster than 32 MB slabs on a laptop CPU)."""


def quant_linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight.T (+ bias)`` → ``[M, N]`` in ``x``'s dtype, for any layout."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    if isinstance(weight, Int4Weight):
        return int4_linear(x, weight, bias)
    if isinstance(weight, torch.Tensor):
        _check_inputs(x, in_features=weight.shape[-1], out_features=weight.shape[0], bias=bias)
        return F.linear(x, weight, bias)
    raise ValueError(f"unsupported linear weight type {type(weight).__name__}")


def quantize_per_token_fp8(x: torch.Tensor, amax_reduce: AmaxReduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``float8_e4m3fn [M, K]``, fp32 scales ``[M, 1]``), ``x ≈ xq * scale``;
    ``amax_reduce``: the row amax is over the other ranks' slices too (module docstring)."""
    xf = x.float()
    scale = _row_amax(xf, amax_reduce) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token_int8(
    x: torch.Tensor, amax_reduce: AmaxReduce | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``int8 [M, K]``, fp32 scales ``[M, 1]``), symmetric, round half to even;
    ``amax_reduce`` as for :func:`quantize_per_token_fp8`."""
    xf = x.float()
    scale = _row_amax(xf, amax_reduce) / INT8_MAX
    return torch.round((xf / scale).clamp(-INT8_MAX, INT8_MAX)).to(torch.int8), scale


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 FP8: ``(fp8(x / sx) @ qweight.T) * sx * weight_scale (+ bias)``."""
    _check_inputs(x, in_features=weight.in_features, out_features=weight.out_features, bias=bias)
    xq, sx = quantize_per_token_fp8(x, weight.act_amax_reduce)
    qweight = weight.qweight
    # fp8 x fp8 products are exact in fp32, so an fp32 matmul of the upcast operands is the
    # tensor core's computation up to summation order.
    acc = _matmul_by_chunks(xq.float(), qweight.shape[0], qweight.shape[1], lambda lo, hi: qweight[lo:hi].float())
    return _epilogue(acc, sx, weight.weight_scale, bias, x.dtype)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 (``act_quant``): exact int32 GEMM of int8 rows and weights, then scales;
    W8A16: ``(x @ qweight.T) * weight_scale`` in fp32 (= ``x @ dequantize(weight).T``)."""
    _check_inputs(x, in_features=weight.in_features, out_features=weight.out_features, bias=bias)
    qweight, scale = weight.qweight, weight.weight_scale
    if not weight.act_quant:
        # The scale is per output channel: applied to the product, as the kernel's epilogue does.
        out = (
            _matmul_by_chunks(x.float(), qweight.shape[0], qweight.shape[1], lambda lo, hi: qweight[lo:hi].float())
            * scale
        )
        return _add_bias(out, bias).to(x.dtype)
    xq, sx = quantize_per_token_int8(x, weight.act_amax_reduce)
    return _epilogue(_int8_matmul(xq, qweight), sx, scale, bias, x.dtype)


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """W4A16: ``x @ w.T`` with ``w[n, k] = q * scales[k // g, n] + offsets[k // g, n]`` in fp32."""
    _check_inputs(x, in_features=weight.in_features, out_features=weight.out_features, bias=bias)
    k, n, group = weight.in_features, weight.out_features, weight.group_size
    scales, offsets = weight.scales.float(), weight.offsets.float()

    def dequant_columns(lo: int, hi: int) -> torch.Tensor:
        q = _unpack_int4_columns(weight.qweight[:, lo:hi]).view(k // group, group, hi - lo)
        w = torch.addcmul(offsets[:, None, lo:hi], q, scales[:, None, lo:hi], out=q)
        return w.view(k, hi - lo).t()

    out = _matmul_by_chunks(x.float(), n, k, dequant_columns)
    return _add_bias(out, bias).to(x.dtype)


def _unpack_int4_columns(words: torch.Tensor) -> torch.Tensor:
    """``int32 [K/8, n]`` → fp32 ``[K, n]`` nibbles (:func:`formats.unpack_int4` order).

    Works on the words' bytes (a quarter of the int32 traffic): byte ``b`` of a word holds
    nibbles ``2b`` (low half) and ``2b + 1`` (high half) on a little-endian machine."""
    rows, cols = words.shape
    data = words.contiguous().view(torch.uint8).view(rows, cols, 4)
    if sys.byteorder == "big":
        data = data.flip(-1)
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1).view(rows, cols, INT4_PACK)
    out = torch.empty((rows, INT4_PACK, cols), dtype=torch.float32, device=words.device)
    out.copy_(nibbles.permute(0, 2, 1))  # converts and reorders in one pass
    return out.view(rows * INT4_PACK, cols)


def _row_amax(xf: torch.Tensor, amax_reduce: AmaxReduce | None = None) -> torch.Tensor:
    if xf.shape[1] == 0:
        amax = xf.new_full((xf.shape[0], 1), ACT_AMAX_FLOOR)
    else:
        amax = xf.abs().amax(dim=1, keepdim=True).clamp_min(ACT_AMAX_FLOOR)
    # max(floor, a) over the ranks is max(floor, max over the ranks of a): the floor commutes
    return amax if amax_reduce is None else amax_reduce(amax)


def _matmul_by_chunks(a: torch.Tensor, n: int, k: int, weight_rows: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """``a [M, K] @ W.T`` with fp32 ``W [N, K]`` produced a slab of rows at a time."""
    step = max(1, DEQUANT_CHUNK_ELEMENTS // max(k, 1))
    if n <= step:
        return a @ weight_rows(0, n).t()
    out = a.new_empty((a.shape[0], n))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        out[:, lo:hi] = a @ weight_rows(lo, hi).t()
    return out


def _int8_matmul(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """Exact ``xq @ qweight.T`` as fp32 (the int32 accumulator converted, as the kernel does)."""
    m, k = xq.shape
    n = qweight.shape[0]
    # torch._int_mm takes any shape on CPU; CUDA wants M > 16 and K, N multiples of 8.
    if xq.device.type == "cpu" or (m > 16 and k % 8 == 0 and n % 8 == 0):
        return torch._int_mm(xq, qweight.t()).float()
    return _int8_matmul_f64(xq, qweight)


def _int8_matmul_f64(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """Same result through float64: |products| <= 127^2, so the sums are exact below 2^53."""
    n, k = qweight.shape
    return _matmul_by_chunks(xq.double(), n, k, lambda lo, hi: qweight[lo:hi].double()).float()


def _epilogue(
    acc: torch.Tensor, sx: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    return _add_bias(acc * sx * weight_scale, bias).to(dtype)


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias.float()


def _check_inputs(x: torch.Tensor, *, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating [M, K] tensor, got {what}")
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects {in_features}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
