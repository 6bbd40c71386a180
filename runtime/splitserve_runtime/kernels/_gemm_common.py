"""Pieces shared by the quantized GEMM launchers: tile order, epilogue, launch configs, checks.

All three GEMM kernels (W8A8 scaled, W8A16, W4A16) compute ``out[M, N] = x[M, K] @ W.T``
with one output tile per program; they share:

- the grouped tile order (``GROUP_M`` row-tiles walk the same column-tiles together, so a
  weight tile is reused from L2 by neighbouring programs in a prefill-sized GEMM);
- the launch configuration: decode-sized ``M`` (<= 64) gets a row tile just big enough and
  narrow column tiles (enough programs to keep every SM streaming the weight, which is the
  whole cost there); prefill-sized ``M`` gets 128 x 128 tiles, 8 warps, 4 stages;
- input validation with ``ValueError`` messages that name the argument.

Layouts here are raw tensors: the kernels sit below :mod:`splitserve_runtime.quant`, so the
backend unpacks a :mod:`~splitserve_runtime.quant.formats` weight into these arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2

DECODE_MAX_M = 64
"""Up to this many rows a GEMM is weight-bandwidth bound: small row tiles, many programs."""


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1) != 0:
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("group_m", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1) != 0:
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def gemm_config(
    *,
    m: int,
    n: int,
    k: int,
    default_block_k: tuple[int, int],
    min_block_k: int = 16,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> GemmConfig:
    """Launch configuration for an ``[m, k] x [k, n]`` GEMM; any field can be overridden.

    ``default_block_k`` is (decode, prefill) K-tile, chosen per operand width by the caller.
    Tiles never exceed the problem (rounded up to a power of two) so small layers waste no
    work on masked lanes.
    """
    decode = m <= DECODE_MAX_M
    if block_m is None:
        block_m = max(16, next_power_of_2(m)) if decode else 128
    if block_n is None:
        block_n = (64 if n >= 8192 else 32) if decode else 128
        block_n = min(block_n, max(16, next_power_of_2(n)))
    if block_k is None:
        block_k = min(default_block_k[0 if decode else 1], max(min_block_k, next_power_of_2(k)))
    if num_warps is None:
        num_warps = 8 if block_m >= 128 and block_n >= 128 else 4
    if num_stages is None:
        num_stages = 4
    return GemmConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        group_m=1 if decode else 8,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def grid(cfg: GemmConfig, m: int, n: int) -> tuple[int]:
    return (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def check_activation_and_bias(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    in_features: int,
    out_features: int,
    weights: dict[str, torch.Tensor],
) -> None:
    """``x [M, in_features]`` floating with unit last stride, ``bias [out_features]`` or None,
    and every tensor on one device; the weight tensors must be contiguous."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects {in_features}")
    tensors = {"x": x, **weights}
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        if bias.shape[0] != out_features:
            raise ValueError(f"bias must have {out_features} entries, got {bias.shape[0]}")
        if bias.stride(0) != 1 and out_features > 1:
            raise ValueError("bias must be contiguous")
        tensors["bias"] = bias
    check_same_device(**tensors)
    for name, t in weights.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, strides {t.stride()}")


@triton.jit
def tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program, GROUP_M row tiles per column sweep."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def store_tile(out_ptr, out, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """Add the bias (fp32) to the fp32 tile and store the valid part in the output dtype."""
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))
