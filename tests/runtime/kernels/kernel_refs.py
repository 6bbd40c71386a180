"""Naive references and random paged-cache builders for the kernel tests.

The references loop over sequences and gather K/V position by position from the paged
cache, then run dense attention in float64, so they share no code (and no layout
assumption beyond the documented one) with the kernels or the torch backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks], scrambled block ids
    context_lens: list[int]
    block_size: int


def make_paged_kv(
    *,
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    extra_blocks: int = 3,
) -> PagedKV:
    """Random caches whose blocks are handed out in a shuffled (non-contiguous) order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 1  # one padding column
    table = torch.zeros((len(context_lens), max_blocks), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        table[b, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
    return PagedKV(
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=table.to(DEVICE),
        context_lens=list(context_lens),
        block_size=block_size,
    )


def gather_seq(kv: PagedKV, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of sequence b as ``[context_len, num_kv_heads, head_dim]`` float64."""
    ks, vs = [], []
    table = kv.block_tables[b].tolist()
    for pos in range(kv.context_lens[b]):
        block = table[pos // kv.block_size]
        ks.append(kv.k_cache[block, pos % kv.block_size].double().cpu())
        vs.append(kv.v_cache[block, pos % kv.block_size].double().cpu())
    return torch.stack(ks), torch.stack(vs)


def dense_attention(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: list[int],
    scale: float,
) -> torch.Tensor:
    """``q [n, H, D]`` over ``k, v [L, Hkv, D]``; row i sees keys ``0..q_positions[i]``."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    kx = k.repeat_interleave(group, dim=1)  # [L, H, D]
    vx = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double().cpu(), kx) * scale
    cols = torch.arange(k.shape[0]).view(1, 1, -1)
    limit = torch.tensor(q_positions).view(1, -1, 1)
    scores = scores.masked_fill(cols > limit, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), vx)


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float


def tolerance(dtype: torch.dtype) -> Tol:
    """Attention tolerances. fp32: accumulation order only. bf16: inputs and output carry
    8 mantissa bits (output rounding alone is 2^-8 relative), plus the bf16 P in the PV dot
    on the GPU."""
    if dtype == torch.float32:
        return Tol(atol=2e-5, rtol=2e-5)
    if dtype == torch.float16:
        return Tol(atol=2e-3, rtol=2e-3)
    return Tol(atol=1.6e-2, rtol=1.6e-2)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, tol: Tol, what: str = "") -> None:
    """``torch.testing.assert_close`` with a typed tolerance and a label for the message."""

    def label(message: str) -> str:
        return f"{what}: {message}" if what else message

    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol, msg=label)
