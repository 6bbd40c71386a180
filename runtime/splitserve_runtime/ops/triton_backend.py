"""The Triton kernel backend: the GPU implementation of the :class:`Ops` protocol.

A thin adapter from :class:`~splitserve_runtime.ops.interface.AttentionMetadata` to the
launchers in :mod:`splitserve_runtime.kernels`; all validation and launch configuration
lives there. Semantics match :class:`~splitserve_runtime.ops.torch_backend.TorchOps`:
every op but :meth:`write_kv_cache` returns new tensors and leaves its inputs alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.activation import silu_and_mul
from ..kernels.decode_attention import decode_attention
from ..kernels.kv_cache_write import write_kv_cache
from ..kernels.prefill_attention import prefill_attention
from ..kernels.rmsnorm import fused_add_rms_norm, rms_norm
from ..kernels.rotary import rotary_embedding
from ..kernels.scaled_gemm import scaled_gemm, w8a8_linear
from ..kernels.w4a16_gemm import w4a16_linear
from ..kernels.w8a16_gemm import w8a16_linear
from ..quant.formats import Fp8Weight, Int4Weight, Int8Weight, LinearWeight
from ..quant.reference import quantize_per_token_fp8, quantize_per_token_int8
from .interface import AttentionMetadata


class TritonOps:
    """:class:`~splitserve_runtime.ops.interface.Ops` backed by the Triton kernels."""

    name = "triton"

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
        write_kv_cache(
            key=key,
            value=value,
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
        )

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
        if q.shape[0] != md.num_prefill_tokens:
            raise ValueError(f"q has {q.shape[0]} rows, metadata has {md.num_prefill_tokens} prefill tokens")
        if md.num_prefills == 0 or md.num_prefill_tokens == 0:
            return q.new_empty(q.shape)
        return prefill_attention(
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=md.prefill_block_tables,
            context_lens=md.prefill_context_lens,
            cu_seqlens_q=md.prefill_cu_seqlens_q,
            max_q_len=md.prefill_max_q_len,
            max_context_len=md.prefill_max_context_len,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )

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
        if q.shape[0] != md.num_decodes:
            raise ValueError(f"q has {q.shape[0]} rows, metadata has {md.num_decodes} decodes")
        if md.num_decodes == 0:
            return q.new_empty(q.shape)
        return decode_attention(
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=md.decode_block_tables,
            context_lens=md.decode_context_lens,
            max_context_len=md.decode_max_context_len,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x=x, weight=weight, eps=eps)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x=x, residual=residual, weight=weight, eps=eps)

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x=x)

    def linear(
        self,
        x: torch.Tensor,
        weight: LinearWeight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Dense weights go to cuBLAS (``F.linear``); quantized layouts to their kernel.

        A row-parallel W8A8 share (``act_amax_reduce`` set) quantizes its activation slice in
        torch with the whole row's scale (a max over the ranks, which the fused per-token kernel
        cannot take), then runs the same scaled GEMM: the torch quantizer is bit-identical to
        the kernel's."""
        if (
            isinstance(weight, Fp8Weight | Int8Weight)
            and weight.act_amax_reduce is not None
            and (isinstance(weight, Fp8Weight) or weight.act_quant)
        ):
            quantize = quantize_per_token_fp8 if isinstance(weight, Fp8Weight) else quantize_per_token_int8
            xq, x_scale = quantize(x, weight.act_amax_reduce)
            return scaled_gemm(
                a=xq.contiguous(),
                a_scale=x_scale.reshape(-1).contiguous(),
                b=weight.qweight,
                b_scale=weight.weight_scale,
                bias=bias,
                out_dtype=x.dtype,
            )
        if isinstance(weight, Fp8Weight) or (isinstance(weight, Int8Weight) and weight.act_quant):
            return w8a8_linear(x=x, qweight=weight.qweight, weight_scale=weight.weight_scale, bias=bias)
        if isinstance(weight, Int8Weight):
            return w8a16_linear(x=x, qweight=weight.qweight, weight_scale=weight.weight_scale, bias=bias)
        if isinstance(weight, Int4Weight):
            return w4a16_linear(
                x=x,
                qweight=weight.qweight,
                scales=weight.scales,
                offsets=weight.offsets,
                group_size=weight.group_size,
                bias=bias,
            )
        return F.linear(x, weight, bias)
