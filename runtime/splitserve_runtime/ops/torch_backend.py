"""The torch kernel backend: the numerical reference for the Triton kernels and the CPU path.

Every op is a handful of vectorised torch calls with no per-sequence Python loop, so the same
code is reasonably fast on CPU and usable (if not optimal) on a GPU. Attention gathers each
sequence's K/V out of the paged cache through its block table into a padded
``[batch, num_kv_heads, max_context, head_dim]`` tensor and runs one
``scaled_dot_product_attention`` call:

- prefill/extend: query row i of a sequence sits at position ``context_len - q_len + i`` and
  sees cache positions up to it (prefix-cached and earlier-chunk tokens included); an explicit
  boolean mask encodes that offset and hides padding columns. When no sequence has a cached
  prefix (one host read of ``sum(context_lens)`` tells), SDPA's own causal mode is exact and
  about 1.3x faster on CPU. Grouped-query attention uses SDPA's ``enable_gqa``.
- decode: one query row per sequence, so each KV head's query heads are folded into its query
  rows (``[B, Hkv, H/Hkv, D]``) and the KV is never expanded; a length mask hides padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.formats import LinearWeight
from ..quant.reference import quant_linear
from .interface import AttentionMetadata
from .kv_fp8 import decode_kv, scatter_kv_rows


def _gather_kv(
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return K, V as ``[B, num_kv_heads, max_context_len, D]`` and the validity mask ``[B, L]``."""
    device = k_cache.device
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    positions = torch.arange(max_context_len, device=device)
    block_index = (positions // block_size).unsqueeze(0).expand(block_tables.shape[0], -1)
    block_ids = torch.gather(block_tables.long(), 1, block_index)
    slots = block_ids * block_size + (positions % block_size).unsqueeze(0)
    valid = positions.unsqueeze(0) < context_lens.long().unsqueeze(1)
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    k = flat_k[slots].transpose(1, 2)
    v = flat_v[slots].transpose(1, 2)
    return k, v, valid


class TorchOps:
    """:class:`~splitserve_runtime.ops.interface.Ops` built from plain torch operators."""

    name = "torch"

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
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        scatter_kv_rows(cache=k_cache, slots=slots, rows=key[keep], scale=k_scale)
        scatter_kv_rows(cache=v_cache, slots=slots, rows=value[keep], scale=v_scale)

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
        num_seqs = md.num_prefills
        if num_seqs == 0 or md.num_prefill_tokens == 0:
            return q.new_empty(q.shape)
        device = q.device
        max_q_len = md.prefill_max_q_len
        cu = md.prefill_cu_seqlens_q.to(device=device, dtype=torch.long)
        q_lens = cu[1:] - cu[:-1]
        context_lens = md.prefill_context_lens.to(device=device, dtype=torch.long)
        # Padded query rows: row i of sequence b is flattened token cu[b] + i.
        rows = torch.arange(max_q_len, device=device)
        row_valid = rows.unsqueeze(0) < q_lens.unsqueeze(1)
        token_index = torch.where(row_valid, cu[:-1].unsqueeze(1) + rows, torch.zeros_like(rows))
        q_padded = q[token_index].transpose(1, 2)  # [B, H, max_q, D]
        k, v, col_valid = _gather_kv(
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=md.prefill_block_tables.to(device),
            context_lens=context_lens,
            max_context_len=md.prefill_max_context_len,
            block_size=md.block_size,
        )
        k, v = decode_kv(k, dtype=q.dtype, scale=k_scale), decode_kv(v, dtype=q.dtype, scale=v_scale)
        gqa = q.shape[1] != k.shape[1]
        if int(context_lens.sum()) == md.num_prefill_tokens:
            # No cached prefix anywhere (context_len == q_len for every sequence): the plain
            # causal mask is exact for every real row (padding rows/columns come last and are
            # dropped), and SDPA's causal path skips the masked half of the work.
            out = F.scaled_dot_product_attention(
                q_padded,
                k.to(q.dtype),
                v.to(q.dtype),
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
        else:
            # Query row i sits at absolute position context_len - q_len + i.
            q_positions = (context_lens - q_lens).unsqueeze(1) + rows  # [B, max_q]
            cols = torch.arange(md.prefill_max_context_len, device=device)
            mask = (cols.view(1, 1, -1) <= q_positions.unsqueeze(2)) & col_valid.unsqueeze(1)
            out = F.scaled_dot_product_attention(
                q_padded,
                k.to(q.dtype),
                v.to(q.dtype),
                attn_mask=mask.unsqueeze(1),
                scale=scale,
                enable_gqa=gqa,
            )  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(num_seqs * max_q_len, q.shape[1], q.shape[2])
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=device),
            q_lens,
            output_size=md.num_prefill_tokens,
        )
        row_of_token = torch.arange(md.num_prefill_tokens, device=device) - cu[seq_of_token]
        return out[seq_of_token * max_q_len + row_of_token]

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
        if md.num_decodes == 0:
            return q.new_empty(q.shape)
        k, v, col_valid = _gather_kv(
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=md.decode_block_tables.to(q.device),
            context_lens=md.decode_context_lens.to(q.device),
            max_context_len=md.decode_max_context_len,
            block_size=md.block_size,
        )
        k, v = decode_kv(k, dtype=q.dtype, scale=k_scale), decode_kv(v, dtype=q.dtype, scale=v_scale)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        # One query row per sequence, so the heads sharing a KV head can be treated as that
        # KV head's queries: [B, Hkv, H/Hkv, D] against [B, Hkv, L, D], no KV expansion.
        grouped_q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=col_valid.view(num_seqs, 1, 1, -1),
            scale=scale,
        )
        return out.reshape(num_seqs, num_heads, head_dim)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(dim=-1, keepdim=True)
        return weight * (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, D/2] each
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]

    def linear(
        self,
        x: torch.Tensor,
        weight: LinearWeight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        return quant_linear(x, weight, bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
