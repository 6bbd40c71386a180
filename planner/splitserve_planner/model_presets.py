"""Named model shapes (Hugging Face ``config.json`` dicts) and loading a config from a path.

Only the shape matters to the planner (layers, widths, heads, vocabulary), so the presets copy
the published ``config.json`` fields of each model; ``tiny`` is the runtime's test checkpoint
(:func:`splitserve_runtime.model.tiny.write_tiny_model` defaults). Parsing goes through the
runtime's torch-free :class:`~splitserve_contract.model_config.ModelConfig`, so the planner
accepts exactly the models the runtime can serve.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splitserve_contract.model_config import ModelConfig, ModelLoadError

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}

HF_IDS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen2-7b": "Qwen/Qwen2-7B-Instruct",
}


def load_model(*, name_or_path: str) -> tuple[str, ModelConfig]:
    """``(display name, config)`` for a preset name or a ``config.json`` path (or its directory).

    Raises ValueError with the preset list or the parse problem.
    """
    if name_or_path in PRESETS:
        return name_or_path, ModelConfig.from_dict(PRESETS[name_or_path], source=f"preset {name_or_path}")
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(sorted(PRESETS))}) "
            "and not a config.json file or a directory holding one"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    try:
        return path.parent.name or str(path), ModelConfig.from_dict(raw, source=str(path))
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from exc
