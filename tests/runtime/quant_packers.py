"""Quantized-checkpoint packers for tests, written from each format's description
(AutoAWQ ``gemm`` order, GPTQ's ``zero - 1`` convention, compressed-tensors' ``value + 8``
nibbles, AutoFP8's scalar scales) independently of the runtime's decoders, so a decoder that
reads the wrong nibble, order or zero convention fails an exact-equality test.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from splitserve_runtime.quant.formats import Fp8Weight, Int4Weight, Int8Weight

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# (stored tensors of one module, the dense weight those tensors mean)
Encoded = tuple[dict[str, torch.Tensor], torch.Tensor]


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in LINEAR_SUFFIXES


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """``[..., 8]`` values 0..15 → int32 words with nibble i at bits 4i (two's complement wrap)."""
    shifts = torch.tensor([4 * i for i in range(8)], dtype=torch.int64)
    words = (nibbles.to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _rtn_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric RTN with integer zero points: q [K, N], scales [G, N], zeros [G, N] (ints)."""
    n, k = w.shape
    g = w.t().reshape(k // group, group, n)
    low, high = g.amin(dim=1), g.amax(dim=1)
    scales = ((high - low) / 15).clamp(min=1e-8).half().float()
    zeros = torch.round(-low / scales).clamp(0, 15)
    q = torch.round(g / scales[:, None] + zeros[:, None]).clamp(0, 15)
    return q.reshape(k, n).to(torch.int64), scales, zeros.to(torch.int64)


def _dense_of(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    s = scales.repeat_interleave(group, dim=0)
    z = zeros.float().repeat_interleave(group, dim=0)
    return ((q.float() - z) * s).t().contiguous()


def encode_awq(w: torch.Tensor, group: int) -> Encoded:
    q, scales, zeros = _rtn_int4(w, group)
    k, n = q.shape
    qweight = _words(q.reshape(k, n // 8, 8)[:, :, list(AWQ_ORDER)])
    qzeros = _words(zeros.reshape(-1, n // 8, 8)[:, :, list(AWQ_ORDER)])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.half()}, _dense_of(q, scales, zeros, group)


def encode_gptq(w: torch.Tensor, group: int, *, sym: bool) -> Encoded:
    n, k = w.shape
    if sym:
        g = w.t().reshape(k // group, group, n)
        scales = (g.abs().amax(dim=1) / 7.5).clamp(min=1e-8).half().float()
        zeros = torch.full_like(scales, 8).to(torch.int64)
        q = torch.round(g / scales[:, None] + 8).clamp(0, 15).reshape(k, n).to(torch.int64)
    else:
        q, scales, zeros = _rtn_int4(w, group)
    qweight = _words(q.reshape(k // 8, 8, n).transpose(1, 2))
    qzeros = _words((zeros - 1).clamp(min=0).reshape(-1, n // 8, 8))  # stored zero = zero - 1 (gptq v1)
    stored_zeros = (zeros - 1).clamp(min=0) + 1
    g_idx = (torch.arange(k) // group).to(torch.int32)
    return (
        {"qweight": qweight, "qzeros": qzeros, "scales": scales.half(), "g_idx": g_idx},
        _dense_of(q, scales, stored_zeros, group),
    )


def encode_ct_int4(w: torch.Tensor, group: int) -> Encoded:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    scales = (g.abs().amax(dim=2) / 7.5).clamp(min=1e-8)  # [N, G]
    signed = torch.round(g / scales[:, :, None]).clamp(-8, 7).reshape(n, k).to(torch.int64)
    packed = _words((signed + 8).reshape(n, k // 8, 8))
    dense = (signed.float().reshape(n, k // group, group) * scales[:, :, None]).reshape(n, k)
    return {"weight_packed": packed, "weight_scale": scales, "weight_shape": torch.tensor([n, k])}, dense


def encode_fp8(w: torch.Tensor, *, per_tensor: bool) -> Encoded:
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).float()
    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    stored = scale.reshape(()) if per_tensor else scale  # AutoFP8: scalar; compressed-tensors: [N, 1]
    return {"weight": q, "weight_scale": stored}, q.float() * scale


def encode_int8(w: torch.Tensor) -> Encoded:
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).float()
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def ct_config(weights: dict[str, Any], *, fmt: str, acts: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
    }


def write_quantized(
    src: Path, dst: Path, *, config: dict[str, Any], encode: Callable[[torch.Tensor], Encoded]
) -> dict[str, torch.Tensor]:
    """Copy ``src`` to ``dst`` with every decoder linear encoded; returns module → meant weight."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    meant: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _is_linear(name):
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        stored, meant[module] = encode(tensor.float())
        out.update({f"{module}.{suffix}": value.contiguous() for suffix, value in stored.items()})
    save_file(out, dst / "model.safetensors")
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(raw))
    return meant


def fused_expectations(meant: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}."
    return {
        "qkv_proj": torch.cat([meant[p + f"self_attn.{m}"] for m in ("q_proj", "k_proj", "v_proj")]),
        "o_proj": meant[p + "self_attn.o_proj"],
        "gate_up_proj": torch.cat([meant[p + f"mlp.{m}"] for m in ("gate_proj", "up_proj")]),
        "down_proj": meant[p + "mlp.down_proj"],
    }


FORMATS: dict[str, tuple[dict[str, Any], Callable[[torch.Tensor], Encoded], type]] = {
    "awq-g64": (
        {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
        lambda w: encode_awq(w, 64),
        Int4Weight,
    ),
    "awq-g32": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        lambda w: encode_awq(w, 32),
        Int4Weight,
    ),
    "gptq-sym": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
        lambda w: encode_gptq(w, 32, sym=True),
        Int4Weight,
    ),
    "gptq-asym": (
        {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False},
        lambda w: encode_gptq(w, 64, sym=False),
        Int4Weight,
    ),
    "ct-int4": (
        ct_config(
            {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
            fmt="pack-quantized",
            acts=None,
        ),
        lambda w: encode_ct_int4(w, 32),
        Int4Weight,
    ),
    "ct-fp8": (
        ct_config(
            {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            fmt="float-quantized",
            acts={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        ),
        lambda w: encode_fp8(w, per_tensor=False),
        Fp8Weight,
    ),
    "autofp8": (
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        lambda w: encode_fp8(w, per_tensor=True),
        Fp8Weight,
    ),
    "ct-int8": (
        ct_config(
            {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
            fmt="int-quantized",
            acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
        ),
        encode_int8,
        Int8Weight,
    ),
    "ct-int8-w8a16": (
        ct_config(
            {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}, fmt="naive-quantized", acts=None
        ),
        encode_int8,
        Int8Weight,
    ),
}
