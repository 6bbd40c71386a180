"""Serve a llama.cpp ``.gguf`` checkpoint: its config, its tokenizer and its weights.

A GGUF file is a whole model in one file: hyper-parameters and the vocabulary as metadata
(llama.cpp's key names), the tensors under llama.cpp's names, most of them in a block
quantization. The rest of the runtime speaks Hugging Face (``config.json``, ``tokenizer.json``,
HF tensor names), so this module translates once, at load time, and nothing downstream knows
the file was a GGUF:

- **Config**: the metadata becomes a ``config.json``-equivalent dict that goes through the
  contract's own parser (:meth:`ModelConfig.from_dict`), so a GGUF is validated exactly like a
  HF directory (supported architecture, RoPE type, head sizes). ``general.architecture``
  ``llama`` maps to ``LlamaForCausalLM`` (Mistral GGUFs say ``llama`` too; llama.cpp keeps no
  sliding window for them and neither do we) and ``qwen2`` to ``Qwen2ForCausalLM``; anything
  else, and mixture-of-experts files (``llama.expert_count``), is refused naming it. Llama 3.1
  style RoPE is stored by llama.cpp as the tensor ``rope_freqs.weight`` rather than as
  parameters; it is matched back to the ``llama3`` parameters that produce it, or refused.
- **Tokenizer**: built with ``tokenizers`` alone from ``tokenizer.ggml.*``. transformers can
  convert GGUF vocabularies too, but it is a dev-only dependency (the runtime image stays
  light) and its converter is built on transformers' tokenizer classes, so it cannot run
  with just ``tokenizers`` + ``gguf``. Byte-level BPE (``tokenizer.ggml.model == "gpt2"``:
  SmolLM, Llama 3, Qwen2, ...) is a direct mapping: the vocabulary and merges are stored in
  the byte-level alphabet already, control tokens become special added tokens, user-defined
  ones plain added tokens, and ``tokenizer.ggml.pre`` selects the pre-tokenizer llama.cpp
  uses for that family (:data:`PRE_TOKENIZERS`). An unknown ``pre`` is refused, as llama.cpp
  does, rather than split text differently from how the merges were learned. SentencePiece
  vocabularies (``"llama"``: Llama 2, Mistral v0.1) are refused for now.
- **Weights**: :func:`lazy_gguf_tensors` maps llama.cpp names to HF names, each ``[out, in]``,
  decoded one at a time when the loader places it (the file is memory-mapped: host memory holds
  one decoded tensor beyond the model).
  Q4_0 and Q4_1 linear projections stay quantized as :class:`~..quant.formats.Int4Weight`
  (group 32, ``offset = -8 d`` / ``m``): the same numbers as the file, decoded by vectorised
  bit operations straight into the GPTQ-style packed layout. Every other type (F32, F16,
  BF16, Q8_0, K-quants, ...) is dequantized to float32 by ``gguf.quants.dequantize``; norms
  and embeddings are always dense. llama.cpp permutes the rows of Llama's Q and K projections
  (its RoPE rotates adjacent pairs, HF's rotates halves); the permutation is undone here, on
  output rows, which for an ``Int4Weight`` are the columns of ``qweight``/``scales``/``offsets``.

:func:`materialize_gguf_dir` writes the translated ``config.json``, ``generation_config.json``,
``tokenizer.json`` and ``tokenizer_config.json`` into a small sidecar directory (atomically,
with a stamp naming the source file), so :func:`~splitserve_contract.model_config.load_model_config`
and :meth:`~.tokenizer.Tokenizer.from_dir` read a GGUF model unchanged, and
:func:`gguf_source` leads the loader from that directory back to the file for the weights.

Runtime dependencies: ``gguf`` (the reader and the dequantizers; pure Python + numpy),
``numpy``, ``tokenizers``; ``torch`` for the weights only. Config, tokenizer and sidecar are
torch-free at import and at run time, so the router can resolve a GGUF model too.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from splitserve_contract.model_config import ModelConfig

from .errors import ModelLoadError

if TYPE_CHECKING:
    import gguf
    import torch

    from ..quant.formats import Int4Weight

log = logging.getLogger(__name__)

GGUF_SUFFIX: Final = ".gguf"
ARCHITECTURES: Final = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""``general.architecture`` -> the HF architecture it is served as."""
INT4_GROUP_SIZE: Final = 32
_NIBBLES_PER_WORD: Final = 8
"""4-bit values per int32 word of ``Int4Weight.qweight`` (``formats.INT4_PACK``)."""
"""Q4_0 and Q4_1 blocks: 32 weights along the input dimension share a scale (and a min)."""
SOURCE_STAMP: Final = "gguf_source.json"
"""In a sidecar directory: the GGUF file it was made from; written last (completeness mark)."""
_PERMUTED_ARCHITECTURES: Final = frozenset({"llama"})
"""Architectures whose Q/K rows llama.cpp's converter permutes (its ``LlamaModel.permute``)."""

# Token types of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``).
_CONTROL: Final = 3
_USER_DEFINED: Final = 4

_GPT2_SPLIT: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    """GPT-2's split regex plus the byte-to-unicode mapping (``tokenizers``' built-in)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    """StarCoder/SmolLM: every digit on its own, then GPT-2's split."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


PRE_TOKENIZERS: Final[dict[str, Callable[[], pre_tokenizers.PreTokenizer]]] = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "gpt2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "refact": _digits_then_byte_level,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
}
"""``tokenizer.ggml.pre`` -> the pre-tokenizer llama.cpp applies for it (``llama-vocab.cpp``)."""
_NFC_PRE: Final = frozenset({"qwen2", "deepseek-r1-qwen"})
"""Vocabularies whose HF tokenizer normalizes to NFC first (Qwen2's ``tokenizer.json``)."""


# ----------------------------------------------------------------------------------- reader


def is_gguf_path(path: Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; existence is checked on open)."""
    return path.suffix.lower() == GGUF_SUFFIX


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A memory-mapped reader of ``path``; every failure is a :class:`ModelLoadError`."""
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError(f"{path}: reading GGUF files needs the Python package 'gguf' (pip install gguf)") from exc
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc.strerror or type(exc).__name__}") from exc
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        # The reader's own messages are numpy's ("cannot reshape array ...") or quote the
        # file's keys: say what it means instead, and never repeat the file's content.
        raise ModelLoadError(f"{CORRUPT} {path}: {_why_unreadable(path, exc)}") from exc
    if reader.byte_order != "I":
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    return reader


CORRUPT: Final = "truncated or corrupt GGUF file"
"""How every message about a GGUF file that cannot be parsed begins."""
_GGUF_MAGIC: Final = b"GGUF"
_GGUF_HEADER_BYTES: Final = 24
"""Magic, version, tensor count and metadata count."""
_SHOWN_CHARACTERS: Final = 48


def _why_unreadable(path: Path, exc: BaseException) -> str:
    """What a reader failure means, from the file's size and first bytes (not the exception's
    text, which is numpy's or quotes the file)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(len(_GGUF_MAGIC))
    except OSError:
        return f"it cannot be parsed ({type(exc).__name__})"
    if head != _GGUF_MAGIC:
        return f"it does not start with the GGUF magic bytes ({size} bytes)"
    if size < _GGUF_HEADER_BYTES:
        return f"the file is {size} bytes, shorter than a GGUF header ({_GGUF_HEADER_BYTES} bytes)"
    if isinstance(exc, KeyError):
        return "its metadata holds a key twice"
    return (
        f"its metadata, tensor index or tensor data do not fit in the file's {size} bytes "
        "(an interrupted download or copy?)"
    )


def _quoted(value: object) -> str:
    """A metadata value for a message: quoted, escaped and cut short."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARACTERS else text[:_SHOWN_CHARACTERS] + "..."


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError, OverflowError) as exc:  # e.g. a string that is not UTF-8
        where = getattr(reader.data, "filename", None) or "(memory)"
        raise ModelLoadError(f"{CORRUPT} {where}: metadata {key!r} cannot be decoded ({type(exc).__name__})") from exc


def _architecture(reader: gguf.GGUFReader, source: str) -> str:
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{source}: missing general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {_quoted(arch)}; supported: {', '.join(ARCHITECTURES)}"
        )
    experts = _field(reader, f"{arch}.expert_count", 0)
    if experts:
        raise ModelLoadError(f"{source}: mixture-of-experts GGUF ({arch}.expert_count={experts}) is not supported")
    return arch


# ----------------------------------------------------------------------------------- config


def gguf_config_dicts(reader: gguf.GGUFReader, *, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config.json, generation_config.json)`` equivalents of the file's metadata."""
    arch = _architecture(reader, source)
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{source}: no token_embd.weight tensor")
    hidden = _required(reader, f"{arch}.embedding_length", source)
    heads = _required(reader, f"{arch}.attention.head_count", source)
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // max(heads, 1)
    value_dim = _field(reader, f"{arch}.attention.value_length") or head_dim
    if value_dim != head_dim:
        raise ModelLoadError(f"{source}: key_length {head_dim} != value_length {value_dim} is not supported")
    rotary = _field(reader, f"{arch}.rope.dimension_count") or head_dim
    if rotary != head_dim:
        raise ModelLoadError(
            f"{source}: partial rotary embeddings ({arch}.rope.dimension_count={rotary}, "
            f"head_dim={head_dim}) are not supported"
        )
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": _required(reader, f"{arch}.feed_forward_length", source),
        "num_hidden_layers": _required(reader, f"{arch}.block_count", source),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv") or heads,
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": _field(reader, f"{arch}.context_length") or 2048,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "torch_dtype": _float_dtype(reader),
    }
    scaling = _rope_scaling(reader, arch, tensors, theta=theta, head_dim=int(head_dim), source=source)
    if scaling is not None:
        raw["rope_scaling"] = scaling
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if bos is not None:
        raw["bos_token_id"] = int(bos)
    if eos is not None:
        raw["eos_token_id"] = int(eos)
    # llama.cpp stops at any end-of-generation token: EOS, end-of-turn, end-of-message.
    stops = [
        int(v) for key in ("eos", "eot", "eom") if (v := _field(reader, f"tokenizer.ggml.{key}_token_id")) is not None
    ]
    generation = {"eos_token_id": list(dict.fromkeys(stops))} if stops else {}
    return raw, generation


def load_gguf_config(path: Path, reader: gguf.GGUFReader | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file, parsed by the contract like a ``config.json``."""
    reader = reader if reader is not None else open_gguf(path)
    source = f"{path} (GGUF metadata)"
    raw, generation = gguf_config_dicts(reader, source=source)
    return ModelConfig.from_dict(raw, generation_config=generation, source=source)


def _required(reader: gguf.GGUFReader, key: str, source: str) -> int:
    value = _field(reader, key)
    if value is None:
        raise ModelLoadError(f"{source}: missing required metadata {key!r}")
    if isinstance(value, list):
        raise ModelLoadError(f"{source}: per-layer {key!r} ({value}) is not supported")
    return int(value)


def _float_dtype(reader: gguf.GGUFReader) -> str | None:
    """The activation dtype the file implies: bfloat16 when it stores BF16 tensors, else
    float16 when it holds F16 or block-quantized tensors (whose scales are f16 and which
    llama.cpp computes in f16), else none (an all-F32 file: the runtime's default)."""
    import gguf

    types = {t.tensor_type for t in reader.tensors}
    if gguf.GGMLQuantizationType.BF16 in types:
        return "bfloat16"
    if types - {gguf.GGMLQuantizationType.F32}:
        return "float16"
    return None


def _rope_scaling(
    reader: gguf.GGUFReader,
    arch: str,
    tensors: dict[str, Any],
    *,
    theta: float,
    head_dim: int,
    source: str,
) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"{source}: both rope_freqs.weight and rope.scaling.type={kind!r}")
        return _llama3_from_freqs(
            np.asarray(freqs.data, dtype=np.float32), theta=theta, head_dim=head_dim, source=source
        )
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = float(factor)
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling  # the contract refuses the types the runtime cannot run (yarn, ...)


_LLAMA3_CANDIDATES: Final = tuple(
    (low, high, original)
    for original in (8192, 4096, 16384, 32768, 2048)
    for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0))
)


def _llama3_from_freqs(freqs: npt.NDArray[np.float32], *, theta: float, head_dim: int, source: str) -> dict[str, Any]:
    """``llama3`` RoPE parameters that reproduce llama.cpp's ``rope_freqs`` (the factor its
    converter divides each frequency by): the factor is their maximum, the band settings the
    first usual ones whose factors match."""
    if freqs.shape != (head_dim // 2,):
        raise ModelLoadError(f"{source}: rope_freqs.weight has shape {freqs.shape}, expected ({head_dim // 2},)")
    factor = float(freqs.max())
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    wavelen = 2 * np.pi * theta**exponents
    for low, high, original in _LLAMA3_CANDIDATES:
        smooth = (original / wavelen - low) / (high - low)
        medium = 1 / ((1 - smooth) / factor + smooth)
        expected = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))
        if np.allclose(expected, freqs, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ModelLoadError(
        f"{source}: rope_freqs.weight (per-frequency RoPE factors) matches no llama3 RoPE scaling this runtime can run"
    )


# -------------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level vocabularies use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_gguf_tokenizer(reader: gguf.GGUFReader, *, source: str) -> tuple[HFTokenizer, dict[str, Any]]:
    """``(tokenizer, tokenizer_config.json dict)`` from ``tokenizer.ggml.*`` (byte-level BPE)."""
    model_type = _field(reader, "tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ModelLoadError(
            f"{source}: GGUF tokenizer model {_quoted(model_type)} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{source}: GGUF pre-tokenizer {_quoted(pre)} is not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens") or []
    merges_raw: list[str] = _field(reader, "tokenizer.ggml.merges") or []
    token_types: Sequence[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or not merges_raw:
        raise ModelLoadError(f"{source}: the GGUF holds no tokenizer.ggml.tokens/merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelLoadError(f"{source}: malformed merge {_quoted(merge)}")
        merges.append((left, right))
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre in _NFC_PRE:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>, ...) match whole and are special; user-defined ones match
    # whole too. Only ones that are vocabulary entries as written: another id would grow the
    # vocabulary past the embedding.
    added = [
        AddedToken(token, special=(kind == _CONTROL), normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind in (_CONTROL, _USER_DEFINED) and vocab.get(token) is not None
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])

    def text(key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None

    config: dict[str, Any] = {
        name: value
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        )
        if (value := text(key)) is not None
    }
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    config["add_bos_token"] = add_bos
    config["add_eos_token"] = add_eos
    template = _field(reader, "tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    single = ["$A"]
    specials: list[tuple[str, int]] = []
    for flag, key in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if flag and config.get(key) in vocab:
            specials.append((config[key], vocab[config[key]]))
            single = [config[key], *single] if key == "bos_token" else [*single, config[key]]
    if specials:
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tokenizer, config


# ---------------------------------------------------------------------------------- sidecar


def sidecar_dir(path: Path, *, cache_root: Path) -> Path:
    """Where :func:`materialize_gguf_dir` puts ``path``'s translated files under ``cache_root``:
    named by the file and keyed by its absolute path, size and modification time, so a
    replaced file gets a fresh directory."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root / "gguf" / f"{path.stem}-{key}"


def materialize_gguf_dir(path: Path, *, cache_root: Path, reader: gguf.GGUFReader | None = None) -> Path:
    """A directory with ``config.json``, ``generation_config.json``, ``tokenizer.json`` and
    ``tokenizer_config.json`` translated from ``path``, and :data:`SOURCE_STAMP` pointing
    back at it. Reused when complete; written to a temporary sibling then renamed, so a
    crash never leaves a directory that looks usable."""
    path = path.resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    target = sidecar_dir(path, cache_root=cache_root)
    if gguf_source(target) == path:
        return target
    reader = reader if reader is not None else open_gguf(path)
    source = f"{path} (GGUF metadata)"
    raw, generation = gguf_config_dicts(reader, source=source)
    ModelConfig.from_dict(raw, generation_config=generation, source=source)  # refuse early
    tokenizer, tok_config = build_gguf_tokenizer(reader, source=source)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)
        for name, data in (
            ("config.json", raw),
            ("generation_config.json", generation),
            ("tokenizer_config.json", tok_config),
        ):
            (staging / name).write_text(json.dumps(data, indent=2), encoding="utf-8")
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / SOURCE_STAMP).write_text(json.dumps({"gguf": str(path)}), encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        try:
            os.rename(staging, target)
        except OSError:
            if gguf_source(target) != path:  # not a concurrent writer that finished first
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a complete sidecar directory was made from, else None."""
    stamp = model_dir / SOURCE_STAMP
    if not stamp.is_file():
        return None
    try:
        value = json.loads(stamp.read_text(encoding="utf-8")).get("gguf")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(value) if isinstance(value, str) else None


# ---------------------------------------------------------------------------------- weights

_LAYER_NAMES: Final = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES: Final = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CONSUMED: Final = frozenset({"rope_freqs.weight"})
"""Tensors the config already took in (:func:`_llama3_from_freqs`)."""
_LAYER: Final = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(name: str) -> str | None:
    """The HF name of llama.cpp tensor ``name`` (None for an unknown one)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER.match(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            out |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return out


@dataclass(frozen=True)
class _Plan:
    """How one file tensor is read: its HF name, row permutation (Q/K), and whether it stays int4."""

    hf_name: str
    heads: int | None
    """Heads whose rows llama.cpp permuted (Q: attention heads, K: KV heads), else None."""
    int4: bool


def read_gguf_tensors(
    path: Path,
    config: ModelConfig,
    reader: gguf.GGUFReader | None = None,
) -> dict[str, torch.Tensor | Int4Weight]:
    """Every tensor of the GGUF file under its HF name, ``[out, in]``, all decoded at once (see
    :func:`lazy_gguf_tensors`, which the loader uses to decode one at a time)."""
    return {name: get() for name, get in lazy_gguf_tensors(path, config, reader).items()}


def lazy_gguf_tensors(
    path: Path,
    config: ModelConfig,
    reader: gguf.GGUFReader | None = None,
) -> dict[str, Callable[[], torch.Tensor | Int4Weight]]:
    """Every tensor of the GGUF file under its HF name, as a function that decodes it, ``[out,
    in]`` (see the module docstring): Q4_0/Q4_1 linear weights as :class:`Int4Weight`,
    everything else dense float32. The set of tensors and every shape is checked against
    ``config`` here, from the metadata alone, before anything is decoded.

    Why lazy: the reader maps the file, so an undecoded tensor costs no memory, while a decoded
    one is float32 (a Q8_0 or K-quant 8B file is ~32 GB of it). The loader decodes each tensor
    when it places it, so host memory holds one decoded tensor beyond the model, and a
    pipeline stage never decodes the layers it does not hold."""
    import gguf

    reader = reader if reader is not None else open_gguf(path)
    arch = _architecture(reader, str(path))
    expected = _expected_shapes(config)
    quantized4 = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1}
    out: dict[str, Callable[[], torch.Tensor | Int4Weight]] = {}
    kept: collections.Counter[str] = collections.Counter()
    dense: collections.Counter[str] = collections.Counter()
    for tensor in reader.tensors:
        if tensor.name in _CONSUMED:
            continue
        plan = _plan(tensor.name, tensor.tensor_type in quantized4, arch=arch, config=config, path=path)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists ne[0] (in) first
        want = expected.get(plan.hf_name)
        if want is None:
            raise ModelLoadError(
                f"{path}: unexpected tensor {_quoted(tensor.name)} ({plan.hf_name}) for {config.architecture}"
            )
        if shape != want:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} ({plan.hf_name}) has shape {shape}, expected {want} "
                "from the GGUF metadata"
            )
        if plan.hf_name in out:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} appears twice")
        (kept if plan.int4 else dense)[tensor.tensor_type.name] += 1
        out[plan.hf_name] = functools.partial(_decode, tensor, plan, shape=shape, path=path)
    missing = [name for name in expected if name not in out]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: GGUF is missing tensors: {shown}")
    log.info(
        "read %s: %d tensors; kept as int4 (group %d): %s; dequantized to float32: %s",
        path.name,
        len(out),
        INT4_GROUP_SIZE,
        _counts(kept),
        _counts(dense),
    )
    return out


def _decode(tensor: gguf.ReaderTensor, plan: _Plan, *, shape: tuple[int, ...], path: Path) -> torch.Tensor | Int4Weight:
    """One tensor of :func:`lazy_gguf_tensors`, decoded from the mapped file."""
    import gguf
    import torch

    if plan.int4:
        weight = decode_q4(
            np.asarray(tensor.data),
            tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1,
            out_features=shape[0],
            in_features=shape[1],
        )
        if plan.heads is not None:
            weight = _permute_int4_columns(weight, _reverse_permutation(shape[0], plan.heads))
        return weight
    try:
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        array = np.array(values, dtype=np.float32).reshape(shape)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}") from exc
    except (ValueError, IndexError) as exc:
        raise ModelLoadError(
            f"{CORRUPT} {path}: tensor {tensor.name!r} holds {np.asarray(tensor.data).nbytes} "
            f"bytes, which do not decode to shape {shape}"
        ) from exc
    dense_tensor = torch.from_numpy(array)
    if plan.heads is not None:
        dense_tensor = dense_tensor[torch.from_numpy(_reverse_permutation(shape[0], plan.heads))]
    return dense_tensor.contiguous()


def _counts(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counter.items())) or "none"


def _plan(name: str, is_q4: bool, *, arch: str, config: ModelConfig, path: Path) -> _Plan:
    hf_name = hf_tensor_name(name)
    if hf_name is None:
        raise ModelLoadError(f"{path}: unexpected tensor {_quoted(name)} for GGUF architecture {arch!r}")
    heads: int | None = None
    if arch in _PERMUTED_ARCHITECTURES:
        if ".attn_q." in name:
            heads = config.num_attention_heads
        elif ".attn_k." in name:
            heads = config.num_key_value_heads
    linear = hf_name.endswith("_proj.weight")
    return _Plan(hf_name=hf_name, heads=heads, int4=is_q4 and linear)


def _reverse_permutation(rows: int, heads: int) -> npt.NDArray[np.int64]:
    """Row indices undoing llama.cpp's Q/K permutation: ``fixed = stored[perm]``.

    llama.cpp stores, per head, the rotary pairs interleaved (row ``2 i + j`` of a head is HF's
    row ``j * half + i``); reading them back to HF's halves order is a reshape and swap of
    the (half, pair) axes."""
    half = rows // heads // 2
    index = np.arange(rows, dtype=np.int64).reshape(heads, half, 2)
    return index.swapaxes(1, 2).reshape(rows)


def _permute_int4_columns(weight: Int4Weight, perm: npt.NDArray[np.int64]) -> Int4Weight:
    import torch

    from ..quant.formats import Int4Weight

    index = torch.from_numpy(perm)
    return Int4Weight(
        qweight=weight.qweight[:, index].contiguous(),
        scales=weight.scales[:, index].contiguous(),
        offsets=weight.offsets[:, index].contiguous(),
        group_size=weight.group_size,
    )


def decode_q4(blocks: npt.NDArray[Any], with_min: bool, *, out_features: int, in_features: int) -> Int4Weight:
    """Q4_0 (``with_min=False``) or Q4_1 bytes ``[N, K / 32 * block_bytes]`` -> :class:`Int4Weight`.

    A block of 32 weights is ``d`` (f16), for Q4_1 ``m`` (f16), then 16 bytes: byte ``j`` holds
    weight ``j`` in its low nibble and weight ``j + 16`` in its high one. Q4_0 means
    ``w = (q - 8) d = q d - 8 d``, Q4_1 ``w = q d + m``: one affine form, exactly (``q d`` and
    ``8 d`` are exact in float32, so float32 evaluation gives llama.cpp's numbers bit for bit).
    The nibbles are re-packed eight per int32 along K (:func:`~..quant.formats.unpack_int4`'s
    order), vectorised over the whole tensor."""
    import torch

    from ..quant.formats import Int4Weight

    if in_features % INT4_GROUP_SIZE:
        raise ModelLoadError(f"Q4 tensor with K={in_features} is not a whole number of 32-weight blocks")
    header = 4 if with_min else 2
    block_bytes = header + INT4_GROUP_SIZE // 2
    groups = in_features // INT4_GROUP_SIZE
    data = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(out_features, groups, block_bytes)
    d = data[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    offsets = data[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if with_min else -8.0 * d
    qs = data[:, :, header:]  # [N, G, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out_features, in_features)  # [N, K]
    words = q.reshape(out_features, in_features // _NIBBLES_PER_WORD, _NIBBLES_PER_WORD).astype(np.uint32)
    shifts = (4 * np.arange(_NIBBLES_PER_WORD, dtype=np.uint32)).reshape(1, 1, -1)
    packed = np.bitwise_or.reduce(words << shifts, axis=-1)  # [N, K/8] uint32
    return Int4Weight(
        qweight=torch.from_numpy(np.ascontiguousarray(packed.T).view(np.int32)),
        scales=torch.from_numpy(np.ascontiguousarray(d.T)),
        offsets=torch.from_numpy(np.ascontiguousarray(offsets.T)),
        group_size=INT4_GROUP_SIZE,
    )
