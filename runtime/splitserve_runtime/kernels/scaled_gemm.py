"""W8A8 GEMM: 8-bit activations x 8-bit weights on the tensor cores, scales in the epilogue.

``out[m, n] = (xq[m] . wq[n]) * x_scale[m] * w_scale[n] (+ bias[n])`` in the activation dtype,
for fp8 e4m3 operands (fp32 accumulation; ``tl.dot`` on float8e4nv needs sm_89+, wgmma on
Hopper) and int8 operands (exact int32 accumulation). The activation rows are quantized
first by :mod:`.act_quant`; the weight is ``[N, K]`` row-major, i.e. K-major for both
operands, the layout the 8-bit tensor-core instructions want.

Grid: one program per ``BLOCK_M x BLOCK_N`` output tile in grouped order
(:func:`._gemm_common.tile_coords`). Rows and columns past the edge are clamped (``% M``)
for the loads instead of masked, and masked only at the store.

Hopper's fp8 wgmma accumulates in reduced precision (Triton's sm_90 default never promotes);
``max_num_imprecise_acc=BLOCK_K`` adds each K tile's partial product into the fp32
accumulator, as cuBLAS does without fast accumulation (``fast_accum=True`` skips that:
faster, since each tile's wgmma must otherwise complete before the add, but less exact).

CPU interpreter: Triton 3.6's interpreter loads fp8 as raw bytes and its ``tl.dot`` upcasts
fp8 operands to fp16 (exact) before a fp32 NumPy matmul, and int8 dots accumulate in int32,
so this kernel needs no interpreter-specific path; only the activation quantization does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensor
from ._gemm_common import GemmConfig, check_activation_and_bias, gemm_config, grid, store_tile
from ._gemm_common import tile_coords as _tile_coords
from .act_quant import quantize_per_token

_OPERAND_DTYPES = (torch.float8_e4m3fn, torch.int8)


@triton.jit
def _scaled_gemm_kernel(
    a_ptr,
    b_ptr,
    a_scale_ptr,
    b_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = rows % M
    b_cols = cols % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + b_cols.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [K, N] view
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=IMPRECISE_ACC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + a_rows)
    b_scale = tl.load(b_scale_ptr + b_cols)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    store_tile(out_ptr, out, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS)


def scaled_gemm(
    *,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a [M, K] @ b [N, K].T) * a_scale[:, None] * b_scale[None, :] (+ bias)`` as
    ``out_dtype [M, N]``; ``a`` and ``b`` both fp8 e4m3 or both int8, scales fp32.
    ``fast_accum`` leaves fp8 partial sums in Hopper's reduced-precision accumulator."""
    check_tensor("a", a, ndim=2, dtypes=_OPERAND_DTYPES)
    check_tensor("b", b, ndim=2, dtypes=_OPERAND_DTYPES)
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} but b is {b.dtype}")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"a has K={k}, b has K={b.shape[1]}")
    check_tensor("a_scale", a_scale, ndim=1, dtypes=(torch.float32,))
    check_tensor("b_scale", b_scale, ndim=1, dtypes=(torch.float32,))
    if a_scale.shape[0] != m or b_scale.shape[0] != n:
        raise ValueError(
            f"a_scale must be [{m}] and b_scale [{n}], got {tuple(a_scale.shape)} and {tuple(b_scale.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(torch.float16, torch.bfloat16, torch.float32))
        if bias.shape[0] != n:
            raise ValueError(f"bias must have {n} entries, got {bias.shape[0]}")
    for name, t in (("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    _check_fp8_support(a)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(torch.zeros_like(out) if bias is None else bias.expand(m, n))
    cfg = config or gemm_config(m=m, n=n, k=k, default_block_k=(256, 128), min_block_k=32)
    if cfg.block_k < 32:
        raise ValueError(f"8-bit dots need block_k >= 32, got {cfg.block_k}")
    int8 = a.dtype == torch.int8
    _scaled_gemm_kernel[grid(cfg, m, n)](
        a,
        b,
        a_scale,
        b_scale,
        bias if bias is not None else b_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        ACC_DTYPE=tl.int32 if int8 else tl.float32,
        IMPRECISE_ACC=None if int8 or fast_accum else cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def w8a8_linear(
    *,
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """W8A8 linear layer: quantize ``x [M, K]`` per token to ``qweight``'s dtype (fp8 e4m3 or
    int8), then :func:`scaled_gemm` with ``qweight [N, K]`` and its per-channel fp32 scales.
    Returns ``[M, N]`` in ``x``'s dtype."""
    check_tensor("qweight", qweight, ndim=2, dtypes=_OPERAND_DTYPES)
    check_tensor("weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,))
    check_activation_and_bias(
        x,
        bias,
        in_features=qweight.shape[1],
        out_features=qweight.shape[0],
        weights={"qweight": qweight, "weight_scale": weight_scale},
    )
    _check_fp8_support(qweight)
    xq, x_scale = quantize_per_token(x=x, dtype=qweight.dtype)
    return scaled_gemm(
        a=xq,
        a_scale=x_scale,
        b=qweight,
        b_scale=weight_scale,
        bias=bias,
        out_dtype=x.dtype,
        config=config,
        fast_accum=fast_accum,
    )


def _check_fp8_support(operand: torch.Tensor) -> None:
    if operand.dtype == torch.float8_e4m3fn and operand.is_cuda:
        major, minor = torch.cuda.get_device_capability(operand.device)
        if (major, minor) < (8, 9):
            raise ValueError(f"fp8 GEMM needs compute capability >= 8.9, got {major}.{minor}")
