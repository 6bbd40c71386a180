"""Config parsing and checkpoint loading: every malformed input fails with a clear message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve_runtime.model import ModelConfig, ModelLoadError, load_model_config
from splitserve_runtime.model.loader import load_model
from splitserve_runtime.model.tiny import write_tiny_model
from splitserve_runtime.model.tokenizer import Tokenizer
from splitserve_runtime.ops import get_ops

CPU = torch.device("cpu")


def _load(model_dir: Path) -> Any:
    return load_model(model_dir=model_dir, ops=get_ops(name="torch", device=CPU), dtype=torch.float32, device=CPU)


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_weights(model_dir: Path, edit: Any) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_tiny_config_parses(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = load_model_config(model_dir=tiny_llama_dir)
    assert (llama.architecture, llama.head_dim, llama.num_key_value_heads) == ("LlamaForCausalLM", 16, 2)
    assert not llama.attention_bias and llama.bos_token_id == 0
    assert llama.eos_token_ids == (1, 4)  # config.json's eos first, then generation_config's
    assert llama.num_kv_bytes_per_token(dtype_bytes=2) == 2 * 2 * 2 * 16 * 2
    qwen = load_model_config(model_dir=tiny_qwen2_dir)
    assert qwen.attention_bias and qwen.bos_token_id is None and qwen.sliding_window is None


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"missing config\.json in .*"):
        _load(tmp_path)


def test_unsupported_architecture(model_copy: Path) -> None:
    _edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ModelLoadError,
        match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
    ):
        _load(model_copy)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"quantization_config": "awq"}, "quantization_config must be an object"),
        ({"vocab_size": "512"}, "'vocab_size' must be a positive integer"),
    ],
)
def test_bad_config_fields(model_copy: Path, changes: dict[str, Any], message: str) -> None:
    _edit_config(model_copy, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(model_dir=model_copy)


def test_rope_parameters_format_of_transformers_5() -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [7, 8],
    }
    config = ModelConfig.from_dict(raw, generation_config={"eos_token_id": 9})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    assert config.eos_token_ids == (7, 8, 9) and config.num_key_value_heads == 2


def test_mistral_sliding_window_clamps_max_model_len() -> None:
    raw = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    config = ModelConfig.from_dict(raw)
    assert config.resolve_max_model_len() == 4096
    assert config.resolve_max_model_len(requested_tokens=2048) == 2048
    with pytest.raises(ModelLoadError, match="max_model_len=8192 exceeds the model's limit 4096 .*sliding_window"):
        config.resolve_max_model_len(requested_tokens=8192)
    assert ModelConfig.from_dict({**raw, "sliding_window": None}).resolve_max_model_len() == 32768


def test_missing_tensor(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(model_copy)


def test_wrong_shape_names_tensor_and_both_shapes(model_copy: Path) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _edit_weights(model_copy, shrink)
    with pytest.raises(
        ModelLoadError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in model\.safetensors has shape \(16, 64\), expected \(32, 64\)",
    ):
        _load(model_copy)


def test_unexpected_tensor(model_copy: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    _edit_weights(model_copy, add)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        _load(model_copy)


def test_missing_weights_and_missing_shard(model_copy: Path, tmp_path: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors or model.safetensors.index.json"):
        _load(model_copy)
    sharded = write_tiny_model(out_dir=tmp_path / "sharded", num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="lists shard model-00002-of-00002.safetensors, which is missing"):
        _load(sharded)


def test_corrupt_weight_file(model_copy: Path) -> None:
    (model_copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read .*model.safetensors"):
        _load(model_copy)


def test_missing_tokenizer(model_copy: Path) -> None:
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing tokenizer\.json in "):
        Tokenizer.from_dir(model_dir=model_copy)


def test_tied_checkpoint_with_redundant_lm_head_loads(model_copy: Path) -> None:
    _edit_config(model_copy, tie_word_embeddings=True)
    model = _load(model_copy)  # lm_head.weight present in the file: accepted and ignored
    assert model.lm_head is None
