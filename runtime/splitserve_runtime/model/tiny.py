"""Write a tiny, random, fully self-contained checkpoint for tests and the CPU demo.

The directory looks exactly like a Hugging Face download (``config.json``,
``generation_config.json``, safetensors weights with an index when sharded,
``tokenizer.json`` + ``tokenizer_config.json`` with a chat template), so the same files feed
our loader and ``transformers`` (the numerical oracle in tests). The tokenizer is a byte-level
BPE trained offline on the small built-in corpus below; the Llama flavour uses Llama-3 special
tokens and chat format, the Qwen2 flavour ChatML with no BOS. Weights are drawn from a seeded
generator with a scale (0.1 rather than HF's 0.02) large enough that every layer shapes the
output and greedy continuations depend on the whole prompt, not only its last token. The same
arguments always give byte-identical files.

Command line: ``splitserve make-tiny-model OUT_DIR [--arch llama|qwen2] ...`` (see :func:`main`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ARCHES = ("llama", "qwen2")
WEIGHT_STD = 0.1

_CORPUS_LINES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A language model predicts the next token from the tokens that came before it.",
    "Kubernetes schedules pods onto nodes and restarts containers that fail.",
    "The operator watches an InferenceService and keeps its deployments converged.",
    "Prefill computes the key and value cache for the whole prompt in one pass.",
    "Decode produces one token per step and reads the cache of every earlier token.",
    "Disaggregated serving runs prefill and decode on separate pools of machines.",
    "Hello, how are you today? I am fine, thank you, and you?",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short poem about the sea, the wind and the morning light.",
    "Once upon a time there was a small robot who wanted to learn to paint.",
    "She opened the window, and the cold air of the mountains filled the room.",
    "Numbers like 1, 2, 3, 42, 100 and 2048 appear in code and in prose.",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}',
    "The router sends each request to the pod that already holds its prefix.",
    "Blocks of sixteen tokens are hashed so that shared prefixes can be reused.",
    "When memory runs out the scheduler preempts the newest running request.",
    "Autoscaling reads queue depth and cache usage from Prometheus every interval.",
    "Good morning! Good evening! Good night! See you tomorrow.",
    "The library was quiet except for the sound of turning pages.",
    "Rain fell softly on the roof while the children slept upstairs.",
    "A cup of coffee, a slice of bread, and a long walk in the park.",
    "Science is a way of thinking much more than it is a body of knowledge.",
    "Café, naïve, résumé and façade keep their accents in English text.",
    "Grüße aus München! Ça va? ¿Qué tal? Ελληνικά, русский, 日本語, 中文, 한국어.",
    "Emoji also need several bytes: 🙂 🚀 🌍 ✨.",
    "user assistant system tool function call response message content role",
)


@dataclass(frozen=True)
class _Flavour:
    """Architecture-specific names, special tokens and chat format."""

    architecture: str
    model_type: str
    special_tokens: tuple[str, ...]
    bos_token: str | None
    eos_token: str
    generation_eos: tuple[str, ...]
    pad_token: str
    chat_template: str


_LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "{{- raise_exception('Unsupported role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "{%- if message['role'] == 'system' %}\n"
    "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

_CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message['role'] != 'system' %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_FLAVOURS = {
    "llama": _Flavour(
        architecture="LlamaForCausalLM",
        model_type="llama",
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|finetune_right_pad_id|>",
        ),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        generation_eos=("<|end_of_text|>", "<|eot_id|>"),
        pad_token="<|finetune_right_pad_id|>",
        chat_template=_LLAMA3_TEMPLATE,
    ),
    "qwen2": _Flavour(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos_token=None,
        eos_token="<|im_end|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        pad_token="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
    ),
}


def _corpus() -> list[str]:
    """The training text: the lines above plus deterministic recombinations of their words."""
    lines = list(_CORPUS_LINES)
    words = " ".join(_CORPUS_LINES).split()
    for i in range(200):
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)))
    return lines


def _train_tokenizer(*, flavour: _Flavour, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(flavour.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if flavour.bos_token is not None:
        bos_id = tokenizer.token_to_id(flavour.bos_token)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{flavour.bos_token} $A",
            pair=f"{flavour.bos_token} $A {flavour.bos_token}:1 $B:1",
            special_tokens=[(flavour.bos_token, bos_id)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _tensor_shapes(
    *,
    flavour: _Flavour,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = hidden_size // num_heads
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, hidden_size))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden_size,)),
            (p + "self_attn.q_proj.weight", (q, hidden_size)),
            (p + "self_attn.k_proj.weight", (kv, hidden_size)),
            (p + "self_attn.v_proj.weight", (kv, hidden_size)),
        ]
        if flavour.model_type == "qwen2":
            shapes += [
                (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.bias", (kv,)),
            ]
        shapes += [
            (p + "self_attn.o_proj.weight", (hidden_size, q)),
            (p + "post_attention_layernorm.weight", (hidden_size,)),
            (p + "mlp.gate_proj.weight", (intermediate_size, hidden_size)),
            (p + "mlp.up_proj.weight", (intermediate_size, hidden_size)),
            (p + "mlp.down_proj.weight", (hidden_size, intermediate_size)),
        ]
    shapes.append(("model.norm.weight", (hidden_size,)))
    if not tie_word_embeddings:
        shapes.append(("lm_head.weight", (vocab_size, hidden_size)))
    return shapes


def _random_weights(
    *,
    shapes: list[tuple[str, tuple[int, ...]]],
    seed: int,
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * noise  # norms near one, but not trivially one
        else:
            weights[name] = WEIGHT_STD * noise
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_weights(*, out_dir: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(weights)
    if num_shards == 1:
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: weights[n] for n in names[shard * per_shard : (shard + 1) * per_shard]}
        save_file(chunk, str(out_dir / file_name), metadata={"format": "pt"})
        for name, tensor in chunk.items():
            weight_map[name] = file_name
            total_bytes += tensor.numel() * tensor.element_size()
    _write_json(
        out_dir / "model.safetensors.index.json",
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
    )


def _check_arguments(
    *,
    arch: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    num_shards: int,
) -> _Flavour:
    """Validate ``write_tiny_model``'s arguments; return the flavour of ``arch``."""
    if arch not in _FLAVOURS:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of: {', '.join(ARCHES)}")
    flavour = _FLAVOURS[arch]
    if hidden_size % num_heads != 0 or (hidden_size // num_heads) % 2 != 0:
        raise ValueError(f"hidden_size {hidden_size} must split into {num_heads} heads of even size")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if not 1 <= num_shards <= num_layers + 2:
        raise ValueError(f"num_shards must be in 1..{num_layers + 2}, got {num_shards}")
    min_vocab = 256 + len(flavour.special_tokens) + 1
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be at least {min_vocab} (bytes + special tokens)")
    return flavour


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"special token {token!r} missing from the trained vocabulary")
    return int(found)


def _model_config(
    *,
    flavour: _Flavour,
    bos_id: int | None,
    eos_id: int,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    rope_scaling: dict[str, Any] | None,
    tie_word_embeddings: bool,
) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint (Hugging Face names)."""
    config: dict[str, Any] = {
        "architectures": [flavour.architecture],
        "model_type": flavour.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "initializer_range": WEIGHT_STD,
        "use_cache": True,
    }
    if flavour.model_type == "llama":
        config.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    else:
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers})
    return config


def _write_tokenizer(*, out_dir: Path, tokenizer: Tokenizer) -> None:
    """``tokenizer.json``: the trained tokenizer itself."""
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")


def _write_tokenizer_config(*, out_dir: Path, flavour: _Flavour, max_position_embeddings: int) -> None:
    """``tokenizer_config.json``: special tokens and the chat template."""
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": flavour.bos_token,
        "eos_token": flavour.eos_token,
        "pad_token": flavour.pad_token,
        "add_bos_token": flavour.bos_token is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": flavour.chat_template,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _write_generation_config(*, out_dir: Path, tokenizer: Tokenizer, flavour: _Flavour, bos_id: int | None) -> None:
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": bos_id,
            "eos_token_id": [_token_id(tokenizer, t) for t in flavour.generation_eos],
            "do_sample": False,
        },
    )


def write_tiny_model(
    *,
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    num_shards: int = 1,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random ``arch`` checkpoint with a trained tokenizer into ``out_dir``; return it."""
    flavour = _check_arguments(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_shards=num_shards,
    )
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(flavour=flavour, vocab_size=vocab_size)
    _write_tokenizer(out_dir=out_dir, tokenizer=tokenizer)
    bos_id = None if flavour.bos_token is None else _token_id(tokenizer, flavour.bos_token)
    config = _model_config(
        flavour=flavour,
        bos_id=bos_id,
        eos_id=_token_id(tokenizer, flavour.eos_token),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
    )
    _write_json(out_dir / "config.json", config)
    _write_generation_config(out_dir=out_dir, tokenizer=tokenizer, flavour=flavour, bos_id=bos_id)
    _write_tokenizer_config(out_dir=out_dir, flavour=flavour, max_position_embeddings=max_position_embeddings)

    shapes = _tensor_shapes(
        flavour=flavour,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    _write_weights(out_dir=out_dir, weights=_random_weights(shapes=shapes, seed=seed), num_shards=num_shards)
    return out_dir


def main(argv: list[str]) -> int:
    """``splitserve make-tiny-model OUT_DIR [options]``: write a tiny checkpoint, print its path."""
    parser = argparse.ArgumentParser(
        prog="splitserve make-tiny-model",
        description="Write a tiny random Llama/Qwen2 checkpoint with a trained tokenizer.",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=ARCHES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    args = parser.parse_args(argv)
    try:
        path = write_tiny_model(
            out_dir=args.out_dir,
            arch=args.arch,
            seed=args.seed,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            intermediate_size=args.intermediate_size,
            max_position_embeddings=args.max_position_embeddings,
            num_shards=args.num_shards,
            tie_word_embeddings=args.tie_word_embeddings,
        )
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    print(path)
    return 0
