"""W8A16 GEMM: 16-bit activations x int8 weights dequantized in registers.

``out = (x @ qweight.T) * weight_scale[None, :] (+ bias)``: the per-output-channel scale is
constant along K, so it is applied once in the epilogue rather than to every weight element;
the int8 tile is converted to the activation dtype (exact: |q| <= 127 fits bf16/fp16) and
multiplied on the tensor cores with fp32 accumulation. HBM traffic is the int8 weight, half
of a bf16 one, which is what a decode-sized GEMM is bound by.

Grid and tile order as the other GEMMs (:mod:`._gemm_common`). fp32 activations (tests,
debugging) use exact fp32 dots; under the CPU interpreter every dot runs in fp32 because the
interpreter mis-computes bf16 dots and converts int8 to bf16 incorrectly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_common import dot_precision
from ._common import check_tensor, interpreting
from ._gemm_common import GemmConfig, check_activation_and_bias, gemm_config, grid, store_tile
from ._gemm_common import tile_coords as _tile_coords


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = rows % M
    w_cols = cols % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + w_cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N] view
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < K - k0, other=0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = acc * tl.load(w_scale_ptr + w_cols)[None, :]
    store_tile(out_ptr, out, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS)


def w8a16_linear(
    *,
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ (qweight [N, K] * weight_scale[:, None]).T (+ bias)`` → ``[M, N]`` in
    ``x``'s dtype; ``qweight`` int8, ``weight_scale`` fp32 per output channel."""
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int8,))
    check_tensor("weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,))
    n, k = qweight.shape
    if weight_scale.shape[0] != n:
        raise ValueError(f"weight_scale must be [{n}], got {tuple(weight_scale.shape)}")
    check_activation_and_bias(
        x, bias, in_features=k, out_features=n, weights={"qweight": qweight, "weight_scale": weight_scale}
    )
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(torch.zeros_like(out) if bias is None else bias.expand(m, n))
    cfg = config or gemm_config(m=m, n=n, k=k, default_block_k=(128, 64))
    interp = interpreting()
    _w8a16_kernel[grid(cfg, m, n)](
        x,
        qweight,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        DOT_FP32=interp or x.dtype == torch.float32,
        INPUT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
