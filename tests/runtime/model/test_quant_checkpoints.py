"""The quantized-checkpoint makers write what each format says (``splitserve_e2e.quant_checkpoints``).

Every check reads the written files back by a route independent of the maker: AWQ and GPTQ
tensors are unpacked here from the formats' definitions (and AWQ also by compressed-tensors'
own AutoAWQ converter), compressed-tensors checkpoints are loaded by transformers (which
decompresses them on the CPU) and decoded here from the stored integers and scales. The
decoded weights must equal the round-to-nearest result exactly and the dense weights within
the quantization step; unquantized tensors and tokenizer files must come through untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve_e2e.quant_checkpoints import (
    AWQ_PACK_ORDER,
    FP8_MAX,
    main,
    make_autofp8,
    make_awq,
    make_compressed_tensors,
    make_gptq,
    quantized_linear_names,
    read_dense,
    rtn_int4,
)

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return loaded


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Unpack int32 words into their 8 nibbles (bits 4 j .. 4 j + 3 → j) along a new axis
    placed after ``dim``, flattened into ``dim``; values 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 1:
        return ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(w.shape[0], -1)
    return ((w.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF).reshape(-1, w.shape[1])


def _decode_awq(t: dict[str, torch.Tensor], module: str, group_size: int) -> torch.Tensor:
    """AWQ gemm tensors → float32 ``[N, K]``, from the format: nibble ``i`` of word ``c`` is
    column ``8 c + order[i]``."""
    inverse = torch.tensor([AWQ_PACK_ORDER.index(j) for j in range(8)])

    def unpack(words: torch.Tensor) -> torch.Tensor:
        n = _nibbles(words, dim=1).reshape(words.shape[0], -1, 8)
        return n[:, :, inverse].reshape(words.shape[0], -1)

    q = unpack(t[f"{module}.qweight"])  # [K, N]
    z = unpack(t[f"{module}.qzeros"]).repeat_interleave(group_size, dim=0)
    s = t[f"{module}.scales"].float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).t()


def _decode_gptq(t: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """GPTQ v1 tensors → float32 ``[N, K]``: ``(q - (stored_zero + 1)) * scale[g_idx]``."""
    q = _nibbles(t[f"{module}.qweight"], dim=0)  # [K, N]
    g_idx = t[f"{module}.g_idx"].long()
    z = (_nibbles(t[f"{module}.qzeros"], dim=1) + 1)[g_idx]
    s = t[f"{module}.scales"].float()[g_idx]
    return ((q - z).float() * s).t()


def _assert_side_files_copied(dense: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (dense / name).read_bytes(), name


def _assert_within_step(decoded: torch.Tensor, dense: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    """Round-to-nearest: each weight is within half a step (plus the fp16 rounding of the
    scale, which can clip the group's extreme by a hair)."""
    step = scales.float().repeat_interleave(group_size, dim=1)
    assert bool(((decoded - dense.float()).abs() <= 0.51 * step + 1e-7).all())


# ---------------------------------------------------------------- RTN


def test_rtn_int4_asymmetric_covers_each_group_with_an_exact_zero() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 64) * 0.1
    w[0, :32] = w[0, :32].abs() + 0.01  # an all-positive group: the range is widened to 0
    g = rtn_int4(w, group_size=32, symmetric=False)
    assert g.values.dtype == torch.int32 and int(g.values.min()) >= 0 and int(g.values.max()) <= 15
    assert tuple(g.zeros.shape) == (16, 2) and tuple(g.scales.shape) == (16, 2)
    assert g.scales.dtype == torch.float16
    assert int(g.zeros[0, 0]) == 0
    _assert_within_step(g.dequantize(), w, g.scales, 32)
    v1 = rtn_int4(w, group_size=32, symmetric=False, min_zero=1)
    assert int(v1.zeros.min()) >= 1
    _assert_within_step(v1.dequantize(), w, v1.scales, 32)


def test_rtn_int4_symmetric_has_zero_point_eight() -> None:
    torch.manual_seed(1)
    w = torch.randn(8, 128) * 0.05
    g = rtn_int4(w, group_size=64, symmetric=True)
    assert bool((g.zeros == 8).all())
    absmax = w.abs().reshape(8, 2, 64).amax(-1)
    torch.testing.assert_close(g.scales.float(), (2 * absmax / 15).half().float())
    step = g.scales.float().repeat_interleave(64, dim=1)
    # +absmax maps to 7.5 steps above zero and is clipped to 7: error up to one step there
    assert bool(((g.dequantize() - w).abs() <= 1.01 * step).all())


def test_rtn_int4_refuses_a_group_size_that_does_not_divide_k() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        rtn_int4(torch.zeros(8, 96), group_size=64, symmetric=False)


# ---------------------------------------------------------------- AWQ


@pytest.mark.parametrize("group_size", [64, 32])
def test_awq_checkpoint_decodes_to_the_rtn_weights(
    tiny_llama_dir: Path,
    tmp_path: Path,
    group_size: int,
) -> None:
    out = make_awq(dense_dir=tiny_llama_dir, out_dir=tmp_path / "awq", group_size=group_size)
    config = _config(out)
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    assert config["torch_dtype"] == "float16"
    dense, written = read_dense(tiny_llama_dir), read_dense(out)
    modules = quantized_linear_names(dense)
    assert {m.rsplit(".", 1)[1] for m in modules} == set(LINEAR_SUFFIXES)
    for module in modules:
        n, k = dense[f"{module}.weight"].shape
        assert f"{module}.weight" not in written
        assert (written[f"{module}.qweight"].dtype, tuple(written[f"{module}.qweight"].shape)) == (
            torch.int32,
            (k, n // 8),
        )
        assert (written[f"{module}.qzeros"].dtype, tuple(written[f"{module}.qzeros"].shape)) == (
            torch.int32,
            (k // group_size, n // 8),
        )
        assert (written[f"{module}.scales"].dtype, tuple(written[f"{module}.scales"].shape)) == (
            torch.float16,
            (k // group_size, n),
        )
        decoded = _decode_awq(written, module, group_size)
        expected = rtn_int4(dense[f"{module}.weight"], group_size=group_size, symmetric=False)
        assert torch.equal(decoded, expected.dequantize()), module
        _assert_within_step(decoded, dense[f"{module}.weight"], expected.scales, group_size)
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert written[name].dtype == torch.float16
        assert torch.equal(written[name], dense[name].half()), name
    assert len(written) == len(dense) + 2 * len(modules)
    _assert_side_files_copied(tiny_llama_dir, out)


def test_awq_checkpoint_is_read_by_compressed_tensors_autoawq_converter(
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert import AutoAWQConverter

    out = make_awq(dense_dir=tiny_llama_dir, out_dir=tmp_path / "awq", group_size=32)
    converter = AutoAWQConverter.from_autoawq_config(_config(out)["quantization_config"])
    scheme = converter.update_config(None).config_groups["config_group_0"]
    dense, written = read_dense(tiny_llama_dir), read_dense(out)
    for module in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        converted = converter.process({k: v for k, v in written.items() if k.startswith(module + ".")})
        local = {k.removeprefix(module + "."): v for k, v in converted.items()}
        weight = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        expected = rtn_int4(dense[f"{module}.weight"], group_size=32, symmetric=False).dequantize()
        torch.testing.assert_close(weight.float(), expected, rtol=1e-3, atol=1e-6)


def test_awq_refuses_a_group_size_that_does_not_divide_a_projection(
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"_proj\.weight \(\d+, 64\): group size 128 does not divide"):
        make_awq(dense_dir=tiny_llama_dir, out_dir=tmp_path / "awq", group_size=128)
    assert not (tmp_path / "awq").exists()


# ---------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_checkpoint_decodes_to_the_rtn_weights(
    tiny_llama_dir: Path,
    tmp_path: Path,
    sym: bool,
) -> None:
    out = make_gptq(dense_dir=tiny_llama_dir, out_dir=tmp_path / "gptq", group_size=32, sym=sym)
    qc = _config(out)["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"], qc["checkpoint_format"]) == (
        "gptq",
        4,
        32,
        sym,
        False,
        "gptq",
    )
    dense, written = read_dense(tiny_llama_dir), read_dense(out)
    for module in quantized_linear_names(dense):
        n, k = dense[f"{module}.weight"].shape
        shapes = {
            s: (written[f"{module}.{s}"].dtype, tuple(written[f"{module}.{s}"].shape))
            for s in ("qweight", "qzeros", "scales", "g_idx")
        }
        assert shapes == {
            "qweight": (torch.int32, (k // 8, n)),
            "qzeros": (torch.int32, (k // 32, n // 8)),
            "scales": (torch.float16, (k // 32, n)),
            "g_idx": (torch.int32, (k,)),
        }, module
        assert torch.equal(written[f"{module}.g_idx"], torch.arange(k, dtype=torch.int32) // 32)
        if sym:  # zero point 8 stored as 7 in every nibble
            assert bool((written[f"{module}.qzeros"] == 0x77777777).all())
        decoded = _decode_gptq(written, module)
        expected = rtn_int4(dense[f"{module}.weight"], group_size=32, symmetric=sym, min_zero=1)
        assert torch.equal(decoded, expected.dequantize()), module
    assert torch.equal(written["lm_head.weight"], dense["lm_head.weight"].half())
    _assert_side_files_copied(tiny_llama_dir, out)


# ---------------------------------------------------------------- AutoFP8


def test_autofp8_checkpoint_has_per_tensor_scales(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = make_autofp8(dense_dir=tiny_llama_dir, out_dir=tmp_path / "fp8")
    assert _config(out)["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "ignored_layers": ["lm_head"],
    }
    dense, written = read_dense(tiny_llama_dir), read_dense(out)
    for module in quantized_linear_names(dense):
        weight, scale = written[f"{module}.weight"], written[f"{module}.weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == dense[f"{module}.weight"].shape
        assert scale.dtype == torch.float32 and scale.dim() == 0
        original = dense[f"{module}.weight"]
        torch.testing.assert_close(scale, original.abs().max() / FP8_MAX)
        # e4m3: 3 mantissa bits (relative error <= 2**-4), subnormal step 2**-9 of the scale
        error = (weight.float() * scale - original).abs()
        assert bool((error <= original.abs() * 2**-4 + scale * 2**-9 + 1e-9).all()), module
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(written[name], dense[name]), name
    _assert_side_files_copied(tiny_llama_dir, out)


# ---------------------------------------------------------------- compressed-tensors

_CT_EXPECTED = {
    # scheme: (format, weight type, weight dtype, activations quantized)
    "FP8_DYNAMIC": ("float-quantized", "float", torch.float8_e4m3fn, True),
    "W8A8": ("int-quantized", "int", torch.int8, True),
    "W8A16": ("pack-quantized", "int", torch.int32, False),
}


def _decode_ct(t: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """Stored integers/fp8 times the per-channel scale; ``pack-quantized`` int8 holds four
    values per int32 (bits ``8 j``), offset by +128."""
    scale = t[f"{module}.weight_scale"].float()
    if f"{module}.weight_packed" in t:
        packed = t[f"{module}.weight_packed"].to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(0, 32, 8, dtype=torch.int64)
        values = ((packed.unsqueeze(-1) >> shifts) & 0xFF).reshape(packed.shape[0], -1) - 128
        n, k = (int(x) for x in t[f"{module}.weight_shape"])
        return values[:, :k].float().reshape(n, k) * scale
    return t[f"{module}.weight"].float() * scale


@pytest.mark.parametrize("scheme", sorted(_CT_EXPECTED))
def test_compressed_tensors_checkpoint_loads_in_transformers(
    tiny_llama_dir: Path,
    tmp_path: Path,
    scheme: str,
) -> None:
    from transformers import AutoModelForCausalLM

    fmt, kind, stored_dtype, act_quant = _CT_EXPECTED[scheme]
    out = make_compressed_tensors(dense_dir=tiny_llama_dir, out_dir=tmp_path / "ct", scheme=scheme)
    qc = _config(out)["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"], qc["ignore"]) == (
        "compressed-tensors",
        fmt,
        "compressed",
        ["lm_head"],
    )
    (group,) = qc["config_groups"].values()
    assert (
        group["weights"]["num_bits"],
        group["weights"]["type"],
        group["weights"]["strategy"],
        group["weights"]["symmetric"],
    ) == (8, kind, "channel", True)
    if act_quant:
        acts = group["input_activations"]
        assert (acts["num_bits"], acts["type"], acts["strategy"], acts["dynamic"]) == (8, kind, "token", True)
    else:
        assert group["input_activations"] is None
    dense, written = read_dense(tiny_llama_dir), read_dense(out)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():  # the first forward decompresses the modules (compressed-tensors' hook)
        logits = model(torch.tensor([[1, 5, 9, 22, 40]])).logits
    assert bool(torch.isfinite(logits).all())
    loaded = dict(model.named_parameters())
    for module in quantized_linear_names(dense):
        stored = written.get(f"{module}.weight", written.get(f"{module}.weight_packed"))
        assert stored is not None and stored.dtype == stored_dtype, module
        n = dense[f"{module}.weight"].shape[0]
        assert tuple(written[f"{module}.weight_scale"].shape) == (n, 1)
        decoded = _decode_ct(written, module)
        torch.testing.assert_close(loaded[f"{module}.weight"], decoded, rtol=0, atol=0)
        original = dense[f"{module}.weight"]
        scale = written[f"{module}.weight_scale"].float()
        bound = (original.abs() * 2**-4 + scale * 2**-9) if kind == "float" else 0.5 * scale
        assert bool(((decoded - original).abs() <= bound + 1e-7).all()), module
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(written[name], dense[name]), name
        assert torch.equal(loaded[name], dense[name]), name
    _assert_side_files_copied(tiny_llama_dir, out)


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    from splitserve_runtime.model.tiny import write_tiny_model

    dense_dir = write_tiny_model(out_dir=tmp_path / "tied", tie_word_embeddings=True)
    ct = make_compressed_tensors(dense_dir=dense_dir, out_dir=tmp_path / "ct", scheme="W8A8")
    awq = make_awq(dense_dir=dense_dir, out_dir=tmp_path / "awq", group_size=64)
    for out in (ct, awq):
        written = read_dense(out)
        assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written, out
        assert _config(out)["tie_word_embeddings"] is True


# ---------------------------------------------------------------- refusals and CLI


def test_makers_refuse_existing_output_and_quantized_sources(
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        make_autofp8(dense_dir=tiny_llama_dir, out_dir=tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x"
    quantized = make_autofp8(dense_dir=tiny_llama_dir, out_dir=tmp_path / "fp8")
    with pytest.raises(ValueError, match="already quantized"):
        make_gptq(dense_dir=quantized, out_dir=tmp_path / "again", group_size=32)


def test_command_line_writes_the_named_checkpoint(
    tiny_llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["gptq-asym-g64", str(tiny_llama_dir), str(tmp_path / "q")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "q")
    assert _config(tmp_path / "q")["quantization_config"]["sym"] is False
    with pytest.raises(SystemExit):
        main(["awq-g128", str(tiny_llama_dir), str(tmp_path / "r")])
    assert "group size 128" in capsys.readouterr().err


# ---------------------------------------------------------------- the runtime reads them

_FUSED = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


@pytest.mark.parametrize(
    "kind", ["ct-fp8", "ct-int8", "ct-w8a16", "autofp8", "awq-g32", "gptq-sym-g64", "gptq-asym-g64"]
)
def test_runtime_loads_each_checkpoint_to_the_weights_it_means(
    tiny_llama_dir: Path,
    tmp_path: Path,
    kind: str,
) -> None:
    """The runtime's loader (written apart from these makers) holds exactly the numbers each
    checkpoint stands for, in the layout of its kernel family."""
    from splitserve_e2e.quant_checkpoints import MAKERS
    from splitserve_runtime.model.loader import load_model
    from splitserve_runtime.ops import get_ops
    from splitserve_runtime.quant.formats import Fp8Weight, Int4Weight, Int8Weight, dequantize

    out = MAKERS[kind](tiny_llama_dir, tmp_path / kind)
    dense, written = read_dense(tiny_llama_dir), read_dense(out)

    def meant(module: str) -> torch.Tensor:
        weight = dense[f"{module}.weight"]
        if kind.startswith("awq"):
            return rtn_int4(weight, group_size=32, symmetric=False).dequantize()
        if kind.startswith("gptq"):
            return rtn_int4(weight, group_size=64, symmetric=kind.startswith("gptq-sym"), min_zero=1).dequantize()
        if kind == "autofp8":
            return written[f"{module}.weight"].float() * written[f"{module}.weight_scale"]
        return _decode_ct(written, module)

    layouts: dict[str, type[Fp8Weight | Int8Weight | Int4Weight]] = {
        "ct-fp8": Fp8Weight,
        "autofp8": Fp8Weight,
        "ct-int8": Int8Weight,
        "ct-w8a16": Int8Weight,
    }
    layout = layouts.get(kind, Int4Weight)
    device = torch.device("cpu")
    model = load_model(model_dir=out, ops=get_ops(name="torch", device=device), dtype=torch.float32, device=device)
    for i, layer in enumerate(model.decoder_layers()):
        for fused, parts in _FUSED.items():
            held = getattr(layer, fused)
            assert isinstance(held, layout), (kind, fused, type(held))
            if isinstance(held, Int8Weight):
                assert held.act_quant == (kind == "ct-int8")  # W8A16 keeps activations 16/32-bit
            expected = torch.cat([meant(f"model.layers.{i}.{p}") for p in parts])
            torch.testing.assert_close(dequantize(held), expected, rtol=1e-6, atol=1e-7)
    assert model.embed_tokens is not None
    assert torch.equal(model.embed_tokens.data, written["model.embed_tokens.weight"].float())
