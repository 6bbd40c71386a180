"""The tiny checkpoint generator: determinism, layout, CLI, and that HF reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve_runtime.model.tiny import main, write_tiny_model


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = _files(write_tiny_model(out_dir=tmp_path / "a", seed=7))
    b = _files(write_tiny_model(out_dir=tmp_path / "b", seed=7))
    c = _files(write_tiny_model(out_dir=tmp_path / "c", seed=8))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_sharded_layout_has_a_complete_index(tmp_path: Path) -> None:
    out = write_tiny_model(out_dir=tmp_path / "m", num_shards=3, num_layers=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all((out / s).is_file() for s in shards)
    assert not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] > 0


def test_cli_writes_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli"), "--arch", "qwen2", "--num-layers", "1", "--tie-word-embeddings"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--num-heads", "3"])


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model arch 'gpt2'"):
        write_tiny_model(out_dir=tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        write_tiny_model(out_dir=tmp_path, vocab_size=100)
