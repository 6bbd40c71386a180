"""RMSNorm and fused residual-add + RMSNorm, one row per program, fp32 accumulation.

The whole row (hidden size up to 64k elements) lives in one tile, so the row is read once:
sum of squares in fp32, then ``(x * rstd)`` rounded to the input dtype and multiplied by the
weight, which reproduces HF Llama's ``weight * hidden.to(input_dtype)`` rounding. The fused
variant first forms ``residual = x + residual`` in the input dtype (as the model's eager code
does), stores it, and normalises it, saving one full read and write of the hidden state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_out,
    stride_rout,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_rout + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, int]:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor with at least one dimension")
    check_tensor("x", x, ndim=x.dim(), dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    check_same_device(x=x, weight=weight)
    hidden = x.shape[-1]
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} elements, x rows have {hidden}")
    if hidden == 0 or hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size must be in 1..{MAX_HIDDEN}, got {hidden}")
    if not eps > 0.0:
        raise ValueError(f"eps must be positive, got {eps}")
    return x.reshape(-1, hidden), hidden


def _launch_config(hidden: int) -> tuple[int, int]:
    block = next_power_of_2(hidden)
    num_warps = min(max(block // 512, 1), 16)
    return block, num_warps


def rms_norm(*, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim; returns a new tensor."""
    x2d, hidden = _check(x, weight, eps)
    out = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    if x2d.shape[0] > 0:
        block, num_warps = _launch_config(hidden)
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d,
            x2d,
            weight,
            out,
            out,
            x2d.stride(0),
            x2d.stride(0),
            out.stride(0),
            out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=False,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out.view(x.shape)


def fused_add_rms_norm(
    *,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; return ``(rms_norm(s) * weight, s)`` as new tensors."""
    x2d, hidden = _check(x, weight, eps)
    check_tensor("residual", residual, ndim=x.dim(), dtypes=(x.dtype,))
    check_same_device(x=x, residual=residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")
    r2d = residual.reshape(-1, hidden)
    out = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    if x2d.shape[0] > 0:
        block, num_warps = _launch_config(hidden)
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d,
            r2d,
            weight,
            out,
            residual_out,
            x2d.stride(0),
            r2d.stride(0),
            out.stride(0),
            residual_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=True,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out.view(x.shape), residual_out.view(x.shape)
