"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

One module serves all three architectures; they differ only in config (Qwen2 adds a QKV
bias, Mistral may have a sliding window that the config clamps away). Q/K/V and gate/up
projections are fused into one matmul each; the loader concatenates the checkpoint's
separate tensors at load time. The forward takes a flat ragged batch (prefill/extend rows
first, then one row per decode sequence, as described by :class:`AttentionMetadata`) and
calls the kernels only through an :class:`Ops` backend, so the same module runs on the
torch and Triton backends.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from splitserve_contract.model_config import ModelConfig

from ..ops.interface import AttentionMetadata, Ops
from ..quant.formats import LinearWeight, weight_nbytes
from .pipeline import PipelineStage
from .rope import build_cos_sin_cache
from .tensor_parallel import Collectives, TensorParallelLayout


def _param(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The layer's fused linear projections: each holds a dense ``[N, K]`` parameter or a
quantized layout (:mod:`splitserve_runtime.quant.formats`) set by the loader."""


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block.

    ``linear_device`` is where the dense projection parameters are allocated: ``meta`` (no
    memory) when the loader will put quantized weights there instead."""

    qkv_proj: LinearWeight
    o_proj: LinearWeight
    gate_up_proj: LinearWeight
    down_proj: LinearWeight

    def __init__(
        self,
        *,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        linear_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        qkv_rows = config.q_size + 2 * config.kv_size
        linear_device = linear_device or device
        self.input_layernorm = _param((hidden,), dtype=dtype, device=device)
        self.qkv_proj = _param((qkv_rows, hidden), dtype=dtype, device=linear_device)
        self.qkv_bias = _param((qkv_rows,), dtype=dtype, device=device) if config.attention_bias else None
        self.o_proj = _param((hidden, config.q_size), dtype=dtype, device=linear_device)
        self.post_attention_layernorm = _param((hidden,), dtype=dtype, device=device)
        self.gate_up_proj = _param((2 * config.intermediate_size, hidden), dtype=dtype, device=linear_device)
        self.down_proj = _param((hidden, config.intermediate_size), dtype=dtype, device=linear_device)
        # Per-tensor scales of an fp8 KV cache (cache = k / k_scale); 1.0 without calibration.
        self.k_scale: float = 1.0
        self.v_scale: float = 1.0

    def set_linear(self, name: str, weight: LinearWeight) -> None:
        """Put ``weight`` (dense or quantized) in projection ``name``; its shape must match."""
        if name not in LINEAR_NAMES:
            raise ValueError(f"unknown projection {name!r}")
        current = getattr(self, name)
        expected = _shape(current)
        if _shape(weight) != expected:
            raise ValueError(f"{name}: weight of shape {_shape(weight)} does not fit {expected}")
        if name in self._parameters:
            del self._parameters[name]
        if isinstance(weight, torch.Tensor):
            self.register_parameter(name, nn.Parameter(weight, requires_grad=False))
        else:
            object.__setattr__(self, name, weight)


def _shape(weight: LinearWeight) -> tuple[int, int]:
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0]), int(weight.shape[1])
    return weight.out_features, weight.in_features


class LlamaForCausalLM(nn.Module):
    """Causal LM with a paged KV cache; see the module docstring.

    With ``parallel`` (a layout and its group's collectives) this is one tensor-parallel rank's
    shard (:mod:`.tensor_parallel`): ``config`` is then the rank's local config, and the
    forward sums partial results after the embedding, ``o_proj`` and ``down_proj``.

    With ``stage`` it is one pipeline stage (:mod:`.pipeline`; ``config`` has the stage's
    layer count): only the first stage embeds, only the last has the final norm and the LM
    head, and :meth:`forward` takes the previous stage's ``carried`` hidden states and
    residual and returns them stacked (``[2, num_tokens, hidden]``) for the next, except on
    the last stage, which returns the normed hidden states like an unsplit model."""

    def __init__(
        self,
        *,
        config: ModelConfig,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        quantized_linears: bool = False,
        parallel: tuple[TensorParallelLayout, Collectives] | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.layout: TensorParallelLayout | None = parallel[0] if parallel is not None else None
        self.collectives: Collectives | None = parallel[1] if parallel is not None else None
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim**-0.5
        self.embed_tokens: nn.Parameter | None = (
            _param((config.vocab_size, config.hidden_size), dtype=dtype, device=device)
            if stage is None or stage.holds_embedding
            else None
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config=config,
                dtype=dtype,
                device=device,
                linear_device=torch.device("meta") if quantized_linears else device,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.has_head = stage is None or stage.is_last
        """Whether this model ends in the LM head (every model but a non-last pipeline stage)."""
        self.norm: nn.Parameter | None = (
            _param((config.hidden_size,), dtype=dtype, device=device) if self.has_head else None
        )
        self.lm_head: nn.Parameter | None = (
            None
            if config.tie_word_embeddings or not self.has_head
            else _param((config.vocab_size, config.hidden_size), dtype=dtype, device=device)
        )
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(
                head_dim=config.head_dim,
                max_positions=config.max_position_embeddings,
                rope_theta=config.rope_theta,
                rope_scaling=config.rope_scaling,
                device=device,
            ),
            persistent=False,
        )

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast(list[LlamaDecoderLayer], list(self.layers))

    def weight_nbytes(self) -> int:
        """Bytes of every weight as held (quantized projections at their packed size)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters() if p.device.type != "meta")
        for layer in self.decoder_layers():
            total += sum(
                weight_nbytes(w) for name in LINEAR_NAMES if not isinstance(w := getattr(layer, name), torch.Tensor)
            )
        return total

    @torch.inference_mode()
    def forward(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        carried: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` after the final norm (a non-last
        pipeline stage: hidden states and residual ``[2, num_tokens, hidden_size]``).

        Writes this step's K/V into ``kv_caches[layer]`` at ``md.slot_mapping`` first, so
        attention reads prefix, earlier chunks and the new tokens uniformly from the cache.
        ``carried``: the previous pipeline stage's output (zeros when absent on a later stage:
        a memory measurement runs a stage alone).
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache layers, got {len(kv_caches)}")
        cfg = self.config
        ops = self.ops
        num_tokens = input_ids.shape[0]
        num_prefill = md.num_prefill_tokens
        num_attended = num_prefill + md.num_decodes
        if num_attended > num_tokens:
            raise ValueError(f"metadata describes {num_attended} rows but the step has {num_tokens} tokens")
        residual: torch.Tensor | None = None
        if self.stage is None or self.stage.is_first:
            hidden = self._embed(input_ids)
        else:
            if carried is None:
                carried = torch.zeros((2, num_tokens, cfg.hidden_size), dtype=self.dtype, device=input_ids.device)
            hidden, residual = carried[0], carried[1]
        layers = cast(list[LlamaDecoderLayer], list(self.layers))
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, layer.input_layernorm, cfg.rms_norm_eps)
            else:
                hidden, residual = ops.fused_add_rms_norm(
                    hidden,
                    residual,
                    layer.input_layernorm,
                    cfg.rms_norm_eps,
                )
            qkv = ops.linear(hidden, layer.qkv_proj, layer.qkv_bias)
            q, k, v = torch.split(qkv, [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(num_tokens, cfg.num_attention_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            q, k = ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
            ops.write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping, k_scale=layer.k_scale, v_scale=layer.v_scale)
            attn = self._attention(
                q=q, k_cache=k_cache, v_cache=v_cache, md=md, k_scale=layer.k_scale, v_scale=layer.v_scale
            )
            hidden = self._reduce(ops.linear(attn.reshape(num_tokens, cfg.q_size), layer.o_proj, None))
            hidden, residual = ops.fused_add_rms_norm(
                hidden,
                residual,
                layer.post_attention_layernorm,
                cfg.rms_norm_eps,
            )
            gate_up = ops.linear(hidden, layer.gate_up_proj, None)
            hidden = self._reduce(ops.linear(ops.silu_and_mul(gate_up), layer.down_proj, None))
        if self.norm is None:
            assert residual is not None  # a stage holds at least one layer
            return torch.stack((hidden, residual))
        if residual is None:
            return ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.norm, cfg.rms_norm_eps)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None  # the first stage holds it
        if self.layout is None:
            return F.embedding(input_ids, self.embed_tokens)
        # vocabulary-parallel: rows outside this rank's slice contribute zeros to the sum
        local = input_ids - self.layout.vocab_start
        inside = (local >= 0) & (local < self.layout.vocab_rows)
        hidden = F.embedding(local.clamp(0, self.layout.vocab_rows - 1), self.embed_tokens)
        return self._reduce(hidden * inside.unsqueeze(-1).to(hidden.dtype))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.collectives is None else self.collectives.all_reduce(partial)

    def _attention(
        self,
        *,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        num_prefill = md.num_prefill_tokens
        num_attended = num_prefill + md.num_decodes
        if md.num_decodes == 0 and num_prefill == q.shape[0]:
            return self.ops.prefill_attention(q, k_cache, v_cache, md, self.scale, k_scale=k_scale, v_scale=v_scale)
        if num_prefill == 0 and md.num_decodes == q.shape[0]:
            return self.ops.decode_attention(q, k_cache, v_cache, md, self.scale, k_scale=k_scale, v_scale=v_scale)
        out = torch.zeros_like(q)
        if num_prefill > 0:
            out[:num_prefill] = self.ops.prefill_attention(
                q[:num_prefill],
                k_cache,
                v_cache,
                md,
                self.scale,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if md.num_decodes > 0:
            out[num_prefill:num_attended] = self.ops.decode_attention(
                q[num_prefill:num_attended],
                k_cache,
                v_cache,
                md,
                self.scale,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[n, vocab_size]`` for hidden rows ``[n, hidden_size]``."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        if not self.has_head or weight is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        logits = F.linear(hidden, weight).float()
        if self.layout is None or self.collectives is None:
            return logits
        return self.collectives.gather_vocab(logits, vocab_size=self.layout.config.vocab_size)
