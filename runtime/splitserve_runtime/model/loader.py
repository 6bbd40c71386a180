"""Load a Hugging Face safetensors checkpoint into :class:`LlamaForCausalLM`.

The checkpoint's tensor names are mapped onto our fused parameters (``q/k/v_proj`` rows
into ``qkv_proj``, ``gate/up_proj`` into ``gate_up_proj``); every expected piece must be
found exactly once with exactly the expected shape, and every tensor in the files must be
expected. Any deviation is a :class:`ModelLoadError` naming the tensor, its file and both
shapes: a truncated download or the wrong config never turns into garbage output. Shards
are read one at a time through ``safetensors.safe_open``, so peak host memory stays at one
tensor, not one checkpoint.

Quantized models (a checkpoint with a ``quantization_config``, or ``quantization`` fp8/int8/int4
asked of a dense one) take another path for the decoder layers' linear projections: each
module's stored tensors are gathered until its fused group (q/k/v, gate/up) is complete,
decoded (:mod:`.checkpoint_quant`) or quantized (:mod:`..quant.quantize`), concatenated and
moved to the device as one quantized weight; the dense projection parameters are never
allocated (they live on the ``meta`` device until replaced).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from splitserve_contract.model_config import ModelConfig, load_model_config

from ..ops.interface import Ops
from ..quant.formats import LinearWeight
from .errors import ModelLoadError, parser_message
from .gguf import gguf_source, lazy_gguf_tensors
from .llama import LlamaForCausalLM
from .pipeline import PipelineStage
from .quantized_linears import LinearAssembler, load_time_method, resolve_scheme
from .tensor_parallel import Collectives, TensorParallelLayout

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Present in some older checkpoints; recomputed by us, so accepted and ignored.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,200}\.safetensors")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: rows ``[row_offset, row_offset + shape[0])`` of
    parameter ``param_name``."""

    param_name: str
    row_offset: int
    shape: tuple[int, ...]


def _targets(config: ModelConfig) -> dict[str, _Target]:
    hidden = config.hidden_size
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    out: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target("embed_tokens", 0, (config.vocab_size, hidden)),
        "model.norm.weight": _Target("norm", 0, (hidden,)),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = _Target("lm_head", 0, (config.vocab_size, hidden))
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        ours = f"layers.{i}."
        out[hf + "input_layernorm.weight"] = _Target(ours + "input_layernorm", 0, (hidden,))
        out[hf + "post_attention_layernorm.weight"] = _Target(
            ours + "post_attention_layernorm",
            0,
            (hidden,),
        )
        for name, offset, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
            out[hf + f"self_attn.{name}.weight"] = _Target(ours + "qkv_proj", offset, (rows, hidden))
            if config.attention_bias:
                out[hf + f"self_attn.{name}.bias"] = _Target(ours + "qkv_bias", offset, (rows,))
        out[hf + "self_attn.o_proj.weight"] = _Target(ours + "o_proj", 0, (hidden, q))
        out[hf + "mlp.gate_proj.weight"] = _Target(ours + "gate_up_proj", 0, (inter, hidden))
        out[hf + "mlp.up_proj.weight"] = _Target(ours + "gate_up_proj", inter, (inter, hidden))
        out[hf + "mlp.down_proj.weight"] = _Target(ours + "down_proj", 0, (hidden, inter))
    return out


def weight_files(*, model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, or ``model.safetensors``."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({type(exc).__name__})") from exc
        if not all(isinstance(name, str) and _SHARD_NAME.fullmatch(name) for name in names):
            # a shard is a file beside the index: never a path elsewhere (nor quoted: the index
            # is a file's content)
            raise ModelLoadError(
                f"{index_path}: its weight_map names a shard that is not a plain "
                "*.safetensors file name in the model directory"
            )
        files = [model_dir / name for name in names]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"{index_path} lists shard {path.name}, which is missing")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def load_model(
    *,
    model_dir: Path,
    ops: Ops,
    dtype: torch.dtype,
    device: torch.device,
    config: ModelConfig | None = None,
    quantization: str = "none",
    parallel: tuple[TensorParallelLayout, Collectives] | None = None,
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """Build the model for ``model_dir``'s config and fill it from its safetensors files (or,
    for a GGUF sidecar directory, from its ``.gguf`` file: :mod:`.gguf`).

    ``quantization`` is ``spec.model.quantization``: ``none`` serves the checkpoint as
    stored (dense, or pre-quantized per its ``quantization_config``); ``fp8``/``int8``/``int4``
    quantizes a dense checkpoint at load time and must match a pre-quantized one's method.

    ``parallel``: load one tensor-parallel rank's shard (:mod:`.tensor_parallel`): dense
    tensors are narrowed as they stream in, quantized projections once decoded (see
    :class:`.quantized_linears.LinearAssembler`); its layout is built on the stage's config
    when there is a ``stage``. ``stage``: load one pipeline stage
    (:mod:`.pipeline`): its layers renamed to local indices, the rest skipped."""
    config = config if config is not None else load_model_config(model_dir=model_dir)
    gguf_file = gguf_source(model_dir)
    layout = parallel[0] if parallel is not None else None
    if gguf_file is not None and quantization != "none":
        raise ModelLoadError(
            f"{gguf_file}: a GGUF file is served as stored (its Q4_0/Q4_1 tensors as int4); "
            f"quantization {quantization} cannot be applied to it: set quantization to none"
        )
    scheme = resolve_scheme(config=config, quantization=quantization, source=str(model_dir))
    load_time = load_time_method(scheme=scheme, quantization=quantization)
    quantized = scheme is not None or load_time is not None or gguf_file is not None
    staged = stage.local_config() if stage is not None else config
    local = layout.local_config() if layout is not None else staged
    model = LlamaForCausalLM(
        config=local, ops=ops, dtype=dtype, device=device, quantized_linears=quantized, parallel=parallel, stage=stage
    )
    assembler = (
        LinearAssembler(
            model=model, config=staged, scheme=scheme, load_time=load_time, dtype=dtype, device=device, layout=layout
        )
        if quantized
        else None
    )
    filler = _Filler(model=model, config=staged, assembler=assembler, layout=layout, stage=stage)

    def offer(name: str, get: Callable[[], LinearWeight], path: Path) -> None:
        local_name = stage.local_name(name) if stage is not None else name
        if local_name is not None:
            filler.offer(name=local_name, get=get, path=path)

    if gguf_file is not None:
        for name, decode in lazy_gguf_tensors(gguf_file, config).items():
            offer(name, decode, gguf_file)  # decoded when placed: one tensor at a time
    else:
        for path in weight_files(model_dir=model_dir):
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                        offer(name, lambda n=name: handle.get_tensor(n), path)  # type: ignore[misc]
            except SafetensorError as exc:
                raise ModelLoadError(f"cannot read {path}: {parser_message(exc)}") from exc
    filler.finish(model_dir=model_dir)
    return model


class _Filler:
    """Routes each checkpoint tensor to its place: a layer projection (the assembler, when the
    model is quantized), a KV scale, or a dense parameter's rows; tracks what is missing."""

    def __init__(
        self,
        *,
        model: LlamaForCausalLM,
        config: ModelConfig,
        assembler: LinearAssembler | None,
        layout: TensorParallelLayout | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.assembler = assembler
        self.layout = layout
        self.params = dict(model.named_parameters())
        local = _targets(layout.local_config()) if layout is not None else None
        self.targets = {
            name: (t, local[name] if local is not None else t)
            for name, t in _targets(config).items()
            if (assembler is None or not assembler.owns(name)) and _held(name, stage)
        }
        self.loaded: dict[str, Path] = {}

    def offer(self, *, name: str, get: Callable[[], LinearWeight], path: Path) -> None:
        if self.assembler is not None and self.assembler.owns(name):
            self.assembler.add(name=name, tensor=get(), path=path)  # it cuts the rank's share itself
        elif _KV_SCALE.match(name):
            _set_kv_scale(model=self.model, name=name, tensor=_dense(get(), name), path=path)
        else:
            _load_one(
                name=name,
                path=path,
                get=get,
                targets=self.targets,
                params=self.params,
                loaded=self.loaded,
                config=self.config,
                layout=self.layout,
            )

    def finish(self, *, model_dir: Path) -> None:
        missing = [name for name in self.targets if name not in self.loaded]
        if self.assembler is not None:
            missing += self.assembler.missing()
        if missing:
            shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint in {model_dir} is missing tensors: {shown}")


def _held(name: str, stage: PipelineStage | None) -> bool:
    """Whether a pipeline stage holds the non-layer tensor ``name`` (layers are renamed to the
    stage's own before this)."""
    if stage is None or name.startswith("model.layers."):
        return True
    if name == "model.embed_tokens.weight":
        return stage.holds_embedding
    return stage.is_last  # the final norm and the LM head


def _dense(value: LinearWeight, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ModelLoadError(f"tensor {name!r} is quantized, but only layer projections may be")
    return value


_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")
"""Calibrated FP8 KV-cache scales (compressed-tensors ``kv_cache_scheme``; ``kv_scale``: one for both)."""


def _set_kv_scale(*, model: LlamaForCausalLM, name: str, tensor: torch.Tensor, path: Path) -> None:
    """Per-tensor KV scale of one layer (cache = k / k_scale); used when the KV cache is fp8,
    ignored by the kernels otherwise."""
    match = _KV_SCALE.match(name)
    assert match is not None
    layer, which = int(match.group(1)), match.group(2)
    layers = model.decoder_layers()
    if layer >= len(layers) or tensor.numel() != 1:
        raise ModelLoadError(f"unexpected tensor {name!r} in {path.name}: shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"tensor {name!r} in {path.name}: KV scale must be positive and finite, got {value}")
    if which in ("k_scale", "kv_scale"):
        layers[layer].k_scale = value
    if which in ("v_scale", "kv_scale"):
        layers[layer].v_scale = value


def _load_one(
    *,
    name: str,
    path: Path,
    get: Callable[[], LinearWeight],
    targets: dict[str, tuple[_Target, _Target]],
    params: dict[str, torch.nn.Parameter],
    loaded: dict[str, Path],
    config: ModelConfig,
    layout: TensorParallelLayout | None,
) -> None:
    """Check ``name`` against its full-checkpoint target, narrow it to this rank's piece (tensor
    parallel) and copy it to its local target's rows."""
    if name.endswith(_IGNORED_SUFFIXES):
        return
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return  # some tied checkpoints store the (identical) head anyway
    target, local = targets.get(name, (None, None))
    if target is None or local is None:
        raise ModelLoadError(f"unexpected tensor {name!r} in {path.name} for {config.architecture}")
    if name in loaded:
        raise ModelLoadError(f"tensor {name!r} appears in both {loaded[name].name} and {path.name}")
    tensor = _dense(get(), name)
    if tuple(tensor.shape) != target.shape:
        raise ModelLoadError(
            f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, expected {target.shape} from config.json"
        )
    if layout is not None:
        tensor = layout.shard_checkpoint_tensor(name, tensor)
    param = params[local.param_name]
    rows = local.shape[0]
    param.data[local.row_offset : local.row_offset + rows].copy_(tensor)
    loaded[name] = path
