"""SiLU-and-mul, the gated activation of Llama's MLP: ``silu(x[..., :I]) * x[..., I:]``.

Grid (row, column block). The gate and up halves of one ``[rows, 2I]`` row are read in the
same program, the sigmoid runs in fp32, and the SiLU result is rounded to the input dtype
before the product (HF's eager ``act_fn(gate) * up`` rounding). Row offsets are 64-bit so
``rows * 2I`` may exceed 2^31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_tensor, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(*, x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I] -> [..., I]``; returns a new contiguous tensor."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor with at least one dimension")
    check_tensor("x", x, ndim=x.dim(), dtypes=FLOAT_DTYPES)
    width = x.shape[-1]
    if width == 0 or width % 2 != 0:
        raise ValueError(f"last dimension of x must be even and non-zero, got {width}")
    half = width // 2
    x2d = x.reshape(-1, width)
    out = torch.empty((x2d.shape[0], half), dtype=x.dtype, device=x.device)
    if x2d.shape[0] > 0:
        block = min(next_power_of_2(half), 1024)
        grid = (x2d.shape[0], triton.cdiv(half, block))
        _silu_and_mul_kernel[grid](
            x2d,
            out,
            x2d.stride(0),
            out.stride(0),
            half,
            BLOCK=block,
            num_warps=4 if block >= 512 else 2,
        )
    return out.view(*x.shape[:-1], half)
