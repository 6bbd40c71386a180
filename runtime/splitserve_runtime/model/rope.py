"""Rotary position embedding tables (plain, linear-scaled and Llama-3.1-scaled).

The model computes the table once at start-up and every layer indexes it by position, so
the per-step cost is a gather. Frequencies and the table are computed in fp32 exactly as
Hugging Face ``modeling_rope_utils`` does (``inv_freq`` from an int64 ``arange``, llama3
wavelength bands with smooth interpolation), which keeps our logits within fp32 noise of HF.
Layout: ``[max_positions, head_dim]`` = ``cat(cos, sin)`` over the ``head_dim / 2`` frequencies.
"""

from __future__ import annotations

import math

import torch

from splitserve_contract.model_config import RopeScaling


def inverse_frequencies(
    *,
    head_dim: int,
    rope_theta: float,
    rope_scaling: RopeScaling | None,
) -> torch.Tensor:
    """fp32 ``[head_dim / 2]`` inverse frequencies after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_scaling is None:
        return inv_freq
    if rope_scaling.rope_type == "linear":
        return inv_freq / rope_scaling.factor
    if rope_scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_scaling.rope_type!r}")
    factor = rope_scaling.factor
    low = rope_scaling.low_freq_factor
    high = rope_scaling.high_freq_factor
    old_context_len = rope_scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    *,
    head_dim: int,
    max_positions: int,
    rope_theta: float,
    rope_scaling: RopeScaling | None,
    device: torch.device,
) -> torch.Tensor:
    """fp32 ``[max_positions, head_dim]`` table ``cat(cos, sin)`` for the Ops rotary kernel."""
    inv_freq = inverse_frequencies(head_dim=head_dim, rope_theta=rope_theta, rope_scaling=rope_scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
