"""Quantized models: every checkpoint format decodes to the numbers it stores, load-time
quantization keeps the model close to the dense one, and every unsupported or contradictory
setting is refused with one clear ModelLoadError.

The checkpoints here are written by packers in this file, coded from each format's
description (AutoAWQ ``gemm`` order, GPTQ's ``zero - 1`` convention, compressed-tensors'
``value + 8`` nibbles) independently of the decoders under test: a decoder that reads the
wrong nibble, order or zero convention fails the exact-equality checks.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve_runtime.model import ModelLoadError
from splitserve_runtime.model.llama import LINEAR_NAMES, LlamaForCausalLM
from splitserve_runtime.model.loader import load_model
from splitserve_runtime.ops import AttentionMetadata, get_ops
from splitserve_runtime.quant.formats import Fp8Weight, Int4Weight, Int8Weight, dequantize

CPU = torch.device("cpu")
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# (stored tensors of one module, the dense weight those tensors mean)
Encoded = tuple[dict[str, torch.Tensor], torch.Tensor]


def _load(model_dir: Path, quantization: str = "none") -> LlamaForCausalLM:
    return load_model(model_dir=model_dir, ops=get_ops(name="torch", device=CPU), dtype=torch.float32,
                      device=CPU, quantization=quantization)


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
    return ({"qweight": qweight, "qzeros": qzeros, "scales": scales.half(), "g_idx": g_idx},
            _dense_of(q, scales, stored_zeros, group))


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


def _ct_config(weights: dict[str, Any], *, fmt: str, acts: dict[str, Any] | None) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def write_quantized(src: Path, dst: Path, *, config: dict[str, Any],
                    encode: Callable[[torch.Tensor], Encoded]) -> dict[str, torch.Tensor]:
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


def _fused(meant: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}."
    return {
        "qkv_proj": torch.cat([meant[p + f"self_attn.{m}"] for m in ("q_proj", "k_proj", "v_proj")]),
        "o_proj": meant[p + "self_attn.o_proj"],
        "gate_up_proj": torch.cat([meant[p + f"mlp.{m}"] for m in ("gate_proj", "up_proj")]),
        "down_proj": meant[p + "mlp.down_proj"],
    }


FORMATS: dict[str, tuple[dict[str, Any], Callable[[torch.Tensor], Encoded], type]] = {
    "awq-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                lambda w: encode_awq(w, 64), Int4Weight),
    "awq-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                lambda w: encode_awq(w, 32), Int4Weight),
    "gptq-sym": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
                 lambda w: encode_gptq(w, 32, sym=True), Int4Weight),
    "gptq-asym": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False},
                  lambda w: encode_gptq(w, 64, sym=False), Int4Weight),
    "ct-int4": (_ct_config({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
                           fmt="pack-quantized", acts=None), lambda w: encode_ct_int4(w, 32), Int4Weight),
    "ct-fp8": (_ct_config({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                          fmt="float-quantized",
                          acts={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
               lambda w: encode_fp8(w, per_tensor=False), Fp8Weight),
    "autofp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"},
                lambda w: encode_fp8(w, per_tensor=True), Fp8Weight),
    "ct-int8": (_ct_config({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                           fmt="int-quantized",
                           acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
                encode_int8, Int8Weight),
    "ct-int8-w8a16": (_ct_config({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                                 fmt="naive-quantized", acts=None), encode_int8, Int8Weight),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_checkpoint_formats_decode_to_the_stored_numbers(tiny_llama_dir: Path, tmp_path: Path, fmt: str) -> None:
    config, encode, layout = FORMATS[fmt]
    meant = write_quantized(tiny_llama_dir, tmp_path / fmt, config=config, encode=encode)
    model = _load(tmp_path / fmt)
    for index, layer in enumerate(model.decoder_layers()):
        for name, expected in _fused(meant, index).items():
            weight = getattr(layer, name)
            assert isinstance(weight, layout), (name, type(weight))
            torch.testing.assert_close(dequantize(weight), expected, rtol=0, atol=2e-6)
    if fmt == "ct-int8-w8a16":
        assert isinstance(model.decoder_layers()[0].qkv_proj, Int8Weight)
        assert not model.decoder_layers()[0].qkv_proj.act_quant
    # the dense parameters of the projections were never allocated
    assert not any(name.endswith(LINEAR_NAMES) for name, _ in model.named_parameters())


def _logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Full-prompt logits through the paged-KV forward (one prefill of one sequence)."""
    n, block = len(token_ids), 16
    blocks = (n + block - 1) // block
    cfg = model.config
    caches = [(torch.zeros(blocks, block, cfg.num_key_value_heads, cfg.head_dim),
               torch.zeros(blocks, block, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
    md = AttentionMetadata(
        slot_mapping=torch.arange(n), num_prefills=1, num_prefill_tokens=n,
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0), prefill_max_q_len=n,
        prefill_max_context_len=n, num_decodes=0, decode_context_lens=torch.zeros(0, dtype=torch.int32),
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32), decode_max_context_len=0, block_size=block)
    hidden = model(input_ids=torch.tensor(token_ids), positions=torch.arange(n), kv_caches=caches, md=md)
    return model.compute_logits(hidden)


@pytest.mark.parametrize(("method", "layout", "max_rel"), [
    ("fp8", Fp8Weight, 0.08), ("int8", Int8Weight, 0.03), ("int4", Int4Weight, 0.35)])
def test_load_time_quantization_stays_close_to_dense(tiny_llama_dir: Path, method: str, layout: type,
                                                      max_rel: float) -> None:
    dense = _load(tiny_llama_dir)
    quantized = _load(tiny_llama_dir, quantization=method)
    assert all(isinstance(getattr(layer, name), layout)
               for layer in quantized.decoder_layers() for name in LINEAR_NAMES)
    assert quantized.weight_nbytes() < dense.weight_nbytes()
    prompt = list(range(3, 40))
    reference, got = _logits(dense, prompt), _logits(quantized, prompt)
    relative = float((got - reference).norm() / reference.norm())
    assert 0 < relative < max_rel, relative  # quantized (not identical), yet close
    assert float((got.argmax(-1) == reference.argmax(-1)).float().mean()) >= (0.9 if method != "int4" else 0.6)


def test_contradicting_quantization_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config, encode, _ = FORMATS["awq-g64"]
    write_quantized(tiny_llama_dir, tmp_path / "awq", config=config, encode=encode)
    with pytest.raises(ModelLoadError, match=r"already quantized \(awq \(gemm, group size 64\), a int4 method\); "
                                             r"quantization fp8 contradicts it: set quantization to none or int4"):
        _load(tmp_path / "awq", quantization="fp8")
    assert isinstance(_load(tmp_path / "awq", quantization="int4").decoder_layers()[0].o_proj, Int4Weight)


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit gptq is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-scaled FP8 \(weight_block_size \[128, 128\]\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "gptq checkpoint_format 'marlin'"),
    (_ct_config({"num_bits": 8, "type": "float", "strategy": "block"}, fmt="float-quantized", acts=None),
     "FP8 with 'block' weight scales"),
    (_ct_config({"num_bits": 4, "type": "float"}, fmt="nvfp4-pack-quantized", acts=None),
     "compressed-tensors format 'nvfp4-pack-quantized' with 4-bit float weights"),
])
def test_unsupported_schemes_are_refused_by_name(model_copy: Path, config: dict[str, Any], message: str) -> None:
    raw = json.loads((model_copy / "config.json").read_text())
    raw["quantization_config"] = config
    (model_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=message):
        _load(model_copy)


def test_act_order_gptq_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def shuffled(w: torch.Tensor) -> Encoded:
        stored, meant = encode_gptq(w, 32, sym=True)
        stored["g_idx"] = stored["g_idx"].flip(0).contiguous()
        return stored, meant
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
    write_quantized(tiny_llama_dir, tmp_path / "g", config=config, encode=shuffled)
    with pytest.raises(ModelLoadError, match=r"act-order \(desc_act\) with a permuted g_idx is not supported"):
        _load(tmp_path / "g")


def test_missing_and_unexpected_quantized_tensors_are_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config, encode, _ = FORMATS["gptq-sym"]
    write_quantized(tiny_llama_dir, tmp_path / "m", config=config, encode=encode)
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.qzeros"):
        _load(tmp_path / "m")
    tensors["model.layers.1.mlp.down_proj.qzeros"] = tensors["model.layers.0.mlp.down_proj.qzeros"].clone()
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(1)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.up_proj\.weight_scale'"):
        _load(tmp_path / "m")


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
