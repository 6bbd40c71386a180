"""Load-time quantization of a dense weight (``--quantization fp8|int8|int4`` on a bf16/fp32
checkpoint): round-to-nearest, data-free, one projection at a time.

- fp8: per-output-channel scale ``amax / 448`` (e4m3), activations dynamic per token at run time;
- int8: symmetric per-channel ``amax / 127``, W8A8 (activations per token at run time);
- int4: asymmetric min-max per group of :data:`INT4_GROUP_SIZE` input columns, W4A16.

No calibration data is needed for any of them, which is why these three are the load-time
choices; calibrated methods (AWQ, GPTQ, SmoothQuant) come as pre-quantized checkpoints.
Quantization runs in float32 on the weight's device, so a GPU load quantizes on the GPU.
"""

from __future__ import annotations

from typing import Final

import torch

from .formats import FP8_DTYPE, FP8_MAX, INT8_MAX, Fp8Weight, Int4Weight, Int8Weight, pack_int4

INT4_GROUP_SIZE: Final = 128
_TINY: Final = 1e-12


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(qweight=q, weight_scale=scale.contiguous())


def quantize_int8(weight: torch.Tensor, *, act_quant: bool = True) -> Int8Weight:
    w = weight.float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=_TINY)
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(qweight=q, weight_scale=scale.contiguous(), act_quant=act_quant)


def int4_group_size(in_features: int, *, preferred: int = INT4_GROUP_SIZE) -> int:
    """The largest of ``preferred``, 64, 32 that divides ``in_features`` (tiny test models
    have narrow layers); ValueError when none does. ``in_features`` is the whole projection's,
    never a tensor-parallel share's: the groups must not depend on the split."""
    for size in (preferred, 64, 32):
        if size <= preferred and in_features % size == 0:
            return size
    raise ValueError(f"int4: in_features {in_features} is not a multiple of 32")


def quantize_int4(
    weight: torch.Tensor, *, group_size: int = INT4_GROUP_SIZE, scale_dtype: torch.dtype | None = None
) -> Int4Weight:
    """Asymmetric RTN per group: ``q = round((w - min) / s)`` in 0..15 with ``s = (max - min) / 15``;
    scales and offsets (``= min``) in ``scale_dtype`` (default: the weight's dtype)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4: in_features {k} is not a multiple of group size {group_size}")
    w = weight.float().t().reshape(k // group_size, group_size, n)  # [G, gs, N]
    low = w.amin(dim=1)
    high = w.amax(dim=1)
    scale = ((high - low) / 15.0).clamp(min=_TINY)
    q = torch.round((w - low[:, None, :]) / scale[:, None, :]).clamp(0, 15).to(torch.int32)
    dtype = scale_dtype or weight.dtype
    return Int4Weight(
        qweight=pack_int4(q.reshape(k, n)),
        scales=scale.to(dtype).contiguous(),
        offsets=low.to(dtype).contiguous(),
        group_size=group_size,
    )
