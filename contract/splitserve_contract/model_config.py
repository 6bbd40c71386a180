"""``ModelConfig``: the subset of a Hugging Face ``config.json`` the runtime needs, validated.

Parsing happens once, here, into a frozen dataclass, so the model, the KV-cache sizing and
the server never read raw JSON. Anything we cannot run correctly (another architecture, an
unknown RoPE scaling type, MLP bias) is rejected with a message
naming the field rather than producing silently wrong output. Both the classic
``rope_theta``/``rope_scaling`` keys and the ``rope_parameters`` dict written by
transformers 5 are accepted. It lives in the contract because two sides read the same file
for different jobs: the runtime builds the model from it, the planner sizes fleets from it;
both refuse an architecture the capabilities table does not list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .capabilities import ARCHITECTURE


class ModelLoadError(Exception):
    """A model directory, URI, config, tokenizer or weight file cannot be used.

    The one exception type for every way a model can be unusable: loading fails for
    user-fixable reasons (wrong path, unsupported architecture, a truncated download); one
    type with a message that names the file, field or tensor lets the server print one clear
    line (and its pod's termination message) instead of a traceback."""


SUPPORTED_ARCHITECTURES = tuple(str(a) for a in ARCHITECTURE.supported)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is ``linear`` or ``llama3``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A validated Llama-family model configuration (see module docstring)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    quantization_config: dict[str, Any] | None = field(default=None, hash=False)
    """A pre-quantized checkpoint's ``quantization_config``, as written; the runtime's loader
    decides whether it can serve it (the planner reads its method to size the weights)."""

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_kv_bytes_per_token(self, *, dtype_bytes: int) -> int:
        """Bytes of K and V, all layers, for one token."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    def resolve_max_model_len(self, *, requested_tokens: int = 0) -> int:
        """The context limit: ``requested_tokens`` (0 = the model's own) checked against
        ``max_position_embeddings`` and, for sliding-window models, the window (we run full
        attention, which equals sliding-window attention only up to the window)."""
        limit = self.max_position_embeddings
        reason = f"max_position_embeddings={self.max_position_embeddings}"
        if self.sliding_window is not None and self.sliding_window < limit:
            limit = self.sliding_window
            reason = f"sliding_window={self.sliding_window} (full attention is exact only up to the window)"
        if requested_tokens < 0:
            raise ModelLoadError(f"max_model_len must be >= 0, got {requested_tokens}")
        if requested_tokens == 0:
            return limit
        if requested_tokens > limit:
            raise ModelLoadError(f"max_model_len={requested_tokens} exceeds the model's limit {limit} ({reason})")
        return requested_tokens

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        *,
        generation_config: dict[str, Any] | None = None,
        source: str = CONFIG_FILE,
    ) -> ModelConfig:
        """Parse a ``config.json`` dict (plus optional ``generation_config.json`` for EOS ids)."""
        return _parse(raw, generation_config or {}, source)


def load_model_config(*, model_dir: Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from ``model_dir``."""
    path = model_dir / CONFIG_FILE
    raw = read_json_object(path, required=True)
    generation = read_json_object(model_dir / GENERATION_CONFIG_FILE, required=False)
    return ModelConfig.from_dict(raw, generation_config=generation, source=str(path))


def read_json_object(path: Path, *, required: bool) -> dict[str, Any]:
    """A model directory's JSON file as a dict ({} when absent and not required)."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"missing {path.name} in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _int(raw: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ModelLoadError(f"{source}: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, source: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"{source}: field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ModelLoadError(f"{source}: field {key!r} must hold token ids, got {value!r}")
    return tuple(values)


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        scaling: Any = params
        theta_raw: Any = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = raw.get("rope_scaling")
        theta_raw = raw.get("rope_theta", 10000.0)
    theta = _float({"rope_theta": theta_raw}, "rope_theta", source, 10000.0)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: field 'rope_scaling' must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    factor = _float(scaling, "factor", f"{source} rope_scaling", 1.0)
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    low = _float(scaling, "low_freq_factor", f"{source} rope_scaling", 1.0)
    high = _float(scaling, "high_freq_factor", f"{source} rope_scaling", 4.0)
    if high <= low:
        raise ModelLoadError(f"{source}: rope_scaling high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    original = _int(
        scaling,
        "original_max_position_embeddings",
        f"{source} rope_scaling",
        default=raw.get("max_position_embeddings"),
    )
    return theta, RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def _parse(raw: dict[str, Any], generation: dict[str, Any], source: str) -> ModelConfig:
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ModelLoadError(f"{source}: missing field 'architectures'")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    quantization_config = raw.get("quantization_config")
    if quantization_config is not None and not isinstance(quantization_config, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act {hidden_act!r}; supported: silu")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
    hidden_size = _int(raw, "hidden_size", source)
    num_heads = _int(raw, "num_attention_heads", source)
    num_kv_heads = _int(raw, "num_key_value_heads", source, default=num_heads)
    if num_heads % num_kv_heads != 0:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim_raw = raw.get("head_dim")
    if head_dim_raw is None:
        if hidden_size % num_heads != 0:
            raise ModelLoadError(
                f"{source}: hidden_size ({hidden_size}) is not divisible by "
                f"num_attention_heads ({num_heads}) and head_dim is not given"
            )
        head_dim_raw = hidden_size // num_heads
    head_dim = _int({"head_dim": head_dim_raw}, "head_dim", source)
    if head_dim % 2 != 0:
        raise ModelLoadError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
    rope_theta, rope_scaling = _rope(raw, source)
    if architecture == "Qwen2ForCausalLM":
        attention_bias = True
        window_raw = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    else:
        attention_bias = bool(raw.get("attention_bias", False))
        window_raw = raw.get("sliding_window") if architecture == "MistralForCausalLM" else None
    sliding_window = None if window_raw is None else _int({"sliding_window": window_raw}, "sliding_window", source)
    eos = _token_ids(raw.get("eos_token_id"), "eos_token_id", source)
    generation_eos = _token_ids(generation.get("eos_token_id"), "eos_token_id", GENERATION_CONFIG_FILE)
    eos_token_ids = tuple(dict.fromkeys(eos + generation_eos))
    bos = _token_ids(raw.get("bos_token_id"), "bos_token_id", source)
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    return ModelConfig(
        architecture=architecture,
        vocab_size=_int(raw, "vocab_size", source),
        hidden_size=hidden_size,
        intermediate_size=_int(raw, "intermediate_size", source),
        num_hidden_layers=_int(raw, "num_hidden_layers", source),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(raw, "rms_norm_eps", source, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(raw, "max_position_embeddings", source, default=2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        sliding_window=sliding_window,
        eos_token_ids=eos_token_ids,
        bos_token_id=bos[0] if bos else None,
        torch_dtype=dtype if isinstance(dtype, str) else None,
        quantization_config=quantization_config,
    )
