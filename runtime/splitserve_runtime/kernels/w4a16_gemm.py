"""W4A16 GEMM: 16-bit activations x 4-bit grouped weights unpacked in registers.

The weight is the GPTQ-style packed layout ``qweight int32 [K / 8, N]`` (nibble ``j`` of word
``[r, n]`` is ``k = 8 r + j``) with per-group ``scales`` / ``offsets`` ``[K / group, N]``:
``w[k, n] = q * scales[k // group, n] + offsets[k // group, n]``. A program loads a
``[BLOCK_K / 8, BLOCK_N]`` tile of packed words (HBM traffic: half a byte per weight),
expands it to ``[BLOCK_K / 8, 8, BLOCK_N]`` nibbles with one shift and mask, reshapes to
``[BLOCK_K, BLOCK_N]``, applies the group scale and offset in fp32, and feeds the tile to
``tl.dot`` in the activation dtype with fp32 accumulation. No dequantized copy of the
weight exists outside registers/shared memory.

When ``BLOCK_K`` divides the group size (the default choice) a K tile lies in one group, so
scales and offsets are one ``[BLOCK_N]`` row per tile; otherwise they are gathered per K row.

fp32 activations use exact fp32 dots; under the CPU interpreter every dot runs in fp32
(the interpreter mis-computes bf16 dots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_common import dot_precision
from ._common import FLOAT_DTYPES, check_tensor, interpreting
from ._gemm_common import (
    DECODE_MAX_M,
    GemmConfig,
    check_activation_and_bias,
    gemm_config,
    grid,
    store_tile,
)
from ._gemm_common import tile_coords as _tile_coords

PACK = 8
"""4-bit values per int32 word."""


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    offsets_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_og,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
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
    offs_p = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    x_ptrs = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    q_ptrs = qw_ptr + offs_p[:, None] * stride_qk + w_cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            words = tl.load(q_ptrs)
        else:
            x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            words = tl.load(q_ptrs, mask=offs_p[:, None] < (K - k0) // 8, other=0)
        nibbles = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)).to(tl.float32)
        if ONE_GROUP_PER_TILE:
            group = k0 // GROUP_SIZE
            scale = tl.load(scales_ptr + group * stride_sg + w_cols).to(tl.float32)
            offset = tl.load(offsets_ptr + group * stride_og + w_cols).to(tl.float32)
            w = q * scale[None, :] + offset[None, :]
        else:
            # Rows past K (masked tail) read the last group: finite, and x is 0 there.
            group = tl.minimum((k0 + offs_k) // GROUP_SIZE, K // GROUP_SIZE - 1)
            scale = tl.load(scales_ptr + group[:, None] * stride_sg + w_cols[None, :])
            offset = tl.load(offsets_ptr + group[:, None] * stride_og + w_cols[None, :])
            w = q * scale.to(tl.float32) + offset.to(tl.float32)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        x_ptrs += BLOCK_K
        q_ptrs += (BLOCK_K // 8) * stride_qk
    store_tile(out_ptr, acc, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS)


def default_block_k(group_size: int, *, decode: bool) -> int:
    """Largest power of two <= 128 (decode) / 64 (prefill) dividing ``group_size``, so a K
    tile stays in one group; 64 when the group size has no power-of-two factor >= 16."""
    cap = 128 if decode else 64
    block = 16
    while block * 2 <= cap and group_size % (block * 2) == 0:
        block *= 2
    return block if group_size % block == 0 else 64


def w4a16_linear(
    *,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ w.T (+ bias)`` → ``[M, N]`` in ``x``'s dtype for the packed 4-bit weight
    ``qweight int32 [K / 8, N]`` with ``scales`` / ``offsets`` ``[K / group_size, N]``."""
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,))
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size <= 0 or group_size % PACK != 0 or k % group_size != 0:
        raise ValueError(f"group_size {group_size} must be a positive multiple of {PACK} dividing K={k}")
    groups = k // group_size
    for name, t in (("scales", scales), ("offsets", offsets)):
        check_tensor(name, t, ndim=2, dtypes=FLOAT_DTYPES)
        if tuple(t.shape) != (groups, n):
            raise ValueError(f"{name} must be [{groups}, {n}], got {tuple(t.shape)}")
    check_activation_and_bias(
        x, bias, in_features=k, out_features=n, weights={"qweight": qweight, "scales": scales, "offsets": offsets}
    )
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(torch.zeros_like(out) if bias is None else bias.expand(m, n))
    decode = m <= DECODE_MAX_M
    block_k = default_block_k(group_size, decode=decode)
    cfg = config or gemm_config(m=m, n=n, k=k, default_block_k=(block_k, block_k))
    interp = interpreting()
    _w4a16_kernel[grid(cfg, m, n)](
        x,
        qweight,
        scales,
        offsets,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        offsets.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        ONE_GROUP_PER_TILE=group_size % cfg.block_k == 0,
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
