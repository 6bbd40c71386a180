"""Per-token (per-row) symmetric quantization of activations to fp8 e4m3 or int8.

The W8A8 GEMMs need their activation operand in 8 bits; a row's scale is
``max(amax(|x_row|), ACT_AMAX_FLOOR) / qmax`` (qmax = 448 for e4m3, 127 for int8) and its
values ``x / scale`` clamped to ``±qmax``, then cast to e4m3 (round to nearest even, the
hardware conversion) or rounded half-to-even to int8. Divisions use ``div_rn`` so the
GPU result is bit-identical to the torch reference
(:func:`splitserve_runtime.quant.reference.quantize_per_token_fp8` / ``_int8``).

Grid ``(row,)``: one program reads its row twice (amax, then quantize) in ``BLOCK_K`` chunks.

CPU interpreter (``TRITON_INTERPRET=1``): Triton 3.6's interpreter stores fp8 as uint8 and
converts exactly *from* fp8, but its fp32 -> fp8 conversion drops the mantissa carry (31.6
becomes 16, not 32) and does not round ties to even; ``libdevice.rint`` is not available
either. Under the interpreter (constexpr ``INTERPRET``) values are therefore first rounded
onto the e4m3 grid (or to integers) in fp32 arithmetic, so the conversion only ever sees
exact values. The GPU path uses the hardware conversion and ``rint``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_tensor, interpreting, next_power_of_2

ACT_AMAX_FLOOR = 1e-8
"""Same constant as :data:`splitserve_runtime.quant.reference.ACT_AMAX_FLOOR`."""
FP8_MAX = 448.0
INT8_MAX = 127.0


@triton.jit
def _rint_exact(y):
    """Round fp32 ``|y| < 2**22`` half to even in plain fp32 arithmetic (interpreter only):
    adding 1.5 * 2**23 leaves no fraction bits, so the addition itself rounds."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _round_to_e4m3_grid(v):
    """Nearest (ties to even) e4m3 value of fp32 ``|v| <= 448``, still in fp32 (interpreter)."""
    a = tl.abs(v)
    exponent = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # e4m3 min normal 2^-6
    ulp = ((exponent + (127 - 3)) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    r = _rint_exact(a / ulp) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    K,
    QMAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    TO_FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR), QMAX)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        if TO_FP8:
            if INTERPRET:
                v = _round_to_e4m3_grid(v)  # the GPU conversion rounds by itself
        elif INTERPRET:
            v = _rint_exact(v)
        else:
            v = tl.extra.cuda.libdevice.rint(v)
        tl.store(q_row + k0 + offs, v.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_per_token(
    *,
    x: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``dtype [M, K]`` contiguous, fp32 row scales ``[M]``) with
    ``x ≈ q * scale[:, None]``; ``dtype`` is ``torch.float8_e4m3fn`` or ``torch.int8``."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if dtype == torch.float8_e4m3fn:
        qmax = FP8_MAX
    elif dtype == torch.int8:
        qmax = INT8_MAX
    else:
        raise ValueError(f"dtype must be float8_e4m3fn or int8, got {dtype}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    if k == 0:
        scale.fill_(ACT_AMAX_FLOOR).div_(qmax)
        return q, scale
    block_k = min(next_power_of_2(k), 4096)
    _act_quant_kernel[(m,)](
        x,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        k,
        QMAX=qmax,
        AMAX_FLOOR=ACT_AMAX_FLOOR,
        TO_FP8=dtype == torch.float8_e4m3fn,
        INTERPRET=interpreting(),
        BLOCK_K=block_k,
        num_warps=8 if block_k >= 2048 else 4,
    )
    return q, scale
