"""The kernel interface the model calls, implemented by a torch backend and a Triton backend.

The model never imports a kernel directly: it receives an :class:`Ops` object. The torch
backend (`ops/torch_backend.py`) is the reference and the fast CPU path; the Triton backend
(`ops/triton_backend.py`, kernels in `kernels/`) is the GPU path, tested against the torch
one under TRITON_INTERPRET=1.

Tensor layouts (all contiguous unless noted):
- KV cache, per layer: ``k_cache``/``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- A step's tokens are flattened: ``num_tokens`` rows, sequence by sequence (ragged).
- ``slot_mapping[i] = block_id * block_size + offset`` is where token i's K/V is written;
  a negative slot means "do not write" (padding).
- ``block_tables[b, j]`` is the j-th KV block of sequence b (int32, padded with 0).
- ``context_lens[b]`` counts all tokens of sequence b whose K/V is in the cache *after*
  this step's write (cached prefix + earlier chunks + this step's tokens).
- ``cu_seqlens_q[b]`` is the offset of sequence b's first query row (int32, len B+1).
- A KV cache is in the activation dtype, or ``float8_e4m3fn`` holding ``k / k_scale`` and
  ``v / v_scale`` saturated to ±448 (per-tensor, per-layer scales; see ``ops/kv_fp8.py``).
  The attention and write ops take the scales as keywords and ignore them for other caches.
Query row i of sequence b sits at absolute position
``context_lens[b] - q_len_b + i`` and attends causally to cache positions ``0..position``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..quant.formats import LinearWeight


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the engine and shared by all layers.

    The step's flattened tokens are ordered: first every prefill/extend sequence's query
    rows (``num_prefill_tokens`` of them, ``num_prefills`` sequences), then one row per
    decode sequence (``num_decodes``). Either part may be empty.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    # prefill / extend part (sequences with q_len >= 1 that go through the varlen kernel)
    num_prefills: int
    num_prefill_tokens: int
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32
    prefill_context_lens: torch.Tensor  # [num_prefills] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_max_q_len: int
    prefill_max_context_len: int
    # decode part (exactly one query row per sequence)
    num_decodes: int
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_max_context_len: int
    block_size: int


class Ops(Protocol):
    """Kernels used by the model. Every function is shape-preserving unless stated."""

    name: str

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Scatter key/value ``[num_tokens, num_kv_heads, head_dim]`` into the cache."""

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal varlen attention of ``q [num_prefill_tokens, num_heads, head_dim]`` over the
        paged cache (prefix-cached blocks included). Returns the same shape as q."""

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Paged attention of one query row per sequence ``q [num_decodes, num_heads, head_dim]``."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual; return rms_norm(residual) * weight, residual``."""

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half, as HF Llama) RoPE. ``q [T, Hq, D]``, ``k [T, Hkv, D]``,
        ``cos_sin_cache [max_pos, D]`` = cat(cos[:, :D/2], sin[:, :D/2]) in fp32."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]``."""

    def linear(self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K] @ weight.T (+ bias)`` → ``[M, N]`` in ``x``'s dtype, for a dense ``[N, K]``
        weight or any quantized layout of :mod:`splitserve_runtime.quant.formats`."""
