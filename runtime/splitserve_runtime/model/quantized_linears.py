"""Filling a model's decoder projections with quantized weights while a checkpoint streams in.

:func:`resolve_scheme` settles what ``spec.model.quantization`` and the checkpoint's own
``quantization_config`` together mean (or refuses a contradiction); :class:`LinearAssembler`
collects each linear module's stored tensors (a pre-quantized module has several: ``qweight``,
``scales``...), and as soon as a fused group is complete (q/k/v → ``qkv_proj``, gate/up →
``gate_up_proj``) decodes or quantizes it, fuses it and moves it to the device. Host memory
thus holds at most the groups whose pieces are still arriving, never the whole checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Final

import torch

from splitserve_contract.model_config import ModelConfig

from ..quant.formats import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    LinearWeight,
    concat_out_features,
    dequantize,
    narrow_features,
)
from ..quant.quantize import int4_group_size, quantize_fp8, quantize_int4, quantize_int8
from .checkpoint_quant import CheckpointQuantization, parse_quantization_config
from .errors import ModelLoadError
from .llama import LlamaForCausalLM
from .tensor_parallel import TensorParallelLayout, all_reduce_max

log = logging.getLogger(__name__)

LOAD_TIME_METHODS: Final = ("fp8", "int8", "int4")
_ROW_PARALLEL: Final = ("o_proj", "down_proj")
"""Fused projections whose input features are split over tensor-parallel ranks."""
_MODULE: Final = re.compile(r"^model\.layers\.(\d+)\.((?:self_attn|mlp)\.[a-z_]+_proj)\.([a-z_]+)$")


@dataclasses.dataclass(frozen=True)
class _Part:
    module: str
    """Relative HF module, e.g. ``self_attn.k_proj``."""
    rows: int


def _fused_groups(config: ModelConfig) -> dict[str, tuple[int, list[_Part]]]:
    """Fused projection → (in_features, its HF modules in row order)."""
    q, kv, inter, hidden = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    return {
        "qkv_proj": (
            hidden,
            [_Part("self_attn.q_proj", q), _Part("self_attn.k_proj", kv), _Part("self_attn.v_proj", kv)],
        ),
        "o_proj": (q, [_Part("self_attn.o_proj", hidden)]),
        "gate_up_proj": (hidden, [_Part("mlp.gate_proj", inter), _Part("mlp.up_proj", inter)]),
        "down_proj": (inter, [_Part("mlp.down_proj", hidden)]),
    }


def resolve_scheme(*, config: ModelConfig, quantization: str, source: str) -> CheckpointQuantization | None:
    """The checkpoint's scheme; refuses a ``quantization`` that contradicts it."""
    scheme = parse_quantization_config(config.quantization_config, source=source)
    if quantization not in ("none", *LOAD_TIME_METHODS):
        raise ModelLoadError(f"unknown quantization {quantization!r}; choose none, {', '.join(LOAD_TIME_METHODS)}")
    if scheme is not None and quantization not in ("none", scheme.family):
        raise ModelLoadError(
            f"{source}: the checkpoint is already quantized ({scheme.description}, a {scheme.family} method); "
            f"quantization {quantization} contradicts it: set quantization to none or {scheme.family}"
        )
    if scheme is not None:
        log.info("%s: pre-quantized checkpoint: %s", source, scheme.description)
    elif quantization != "none":
        log.info("%s: quantizing the dense checkpoint to %s at load time", source, quantization)
    return scheme


def load_time_method(*, scheme: CheckpointQuantization | None, quantization: str) -> str | None:
    """The method to apply to dense weights at load time, if any."""
    return quantization if scheme is None and quantization in LOAD_TIME_METHODS else None


class LinearAssembler:
    """Collects, decodes and installs the decoder layers' linear projections (module docstring)."""

    def __init__(
        self,
        *,
        model: LlamaForCausalLM,
        config: ModelConfig,
        scheme: CheckpointQuantization | None,
        load_time: str | None,
        dtype: torch.dtype,
        device: torch.device,
        layout: TensorParallelLayout | None = None,
    ) -> None:
        """``config`` describes the checkpoint's projections (whole, as stored); with a
        tensor-parallel ``layout`` each decoded projection is then cut to this rank's share
        (:meth:`~.tensor_parallel.TensorParallelLayout.projection_slice`) in its quantized
        layout, so a pre-quantized checkpoint serves at any split and a load-time
        quantization gives every rank the very weights a single process would hold (the same
        int4 groups, the same scales). A row-parallel W8A8 share also gets the model's
        collectives to take its per-token activation scale over the whole input row."""
        self._model = model
        self._layout = layout
        self._config = config
        self._scheme = scheme
        self._load_time = load_time
        self._dtype = dtype
        self._device = device
        self._groups = _fused_groups(config)
        self._owner = {part.module: fused for fused, (_, parts) in self._groups.items() for part in parts}
        self._pending: dict[tuple[int, str], dict[str, dict[str, LinearWeight]]] = {}
        self._done: set[tuple[int, str]] = set()
        self._kinds: Counter[str] = Counter()

    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a layer projection (biases excepted:
        they stay dense parameters)."""
        match = _MODULE.match(name)
        return match is not None and match.group(2) in self._owner and match.group(3) != "bias"

    def _expected(self, hf_module: str) -> frozenset[str]:
        if self._scheme is not None and self._scheme.quantizes(hf_module):
            return self._scheme.tensor_suffixes
        return frozenset({"weight"})

    def add(self, *, name: str, tensor: LinearWeight, path: Path) -> None:
        """One stored tensor of a projection module (a GGUF reader hands over whole decoded
        weights as ``weight``)."""
        match = _MODULE.match(name)
        assert match is not None
        layer, module, suffix = int(match.group(1)), match.group(2), match.group(3)
        if layer >= self._config.num_hidden_layers:
            raise ModelLoadError(
                f"unexpected tensor {name!r} in {path.name}: the model has {self._config.num_hidden_layers} layers"
            )
        fused = self._owner[module]
        key = (layer, fused)
        hf_module = f"model.layers.{layer}.{module}"
        if suffix not in self._expected(hf_module):
            raise ModelLoadError(
                f"unexpected tensor {name!r} in {path.name} for "
                f"{self._scheme.description if self._scheme else 'a dense checkpoint'}"
            )
        if key in self._done:
            raise ModelLoadError(f"tensor {name!r} in {path.name} arrives after {hf_module} was loaded")
        stored = self._pending.setdefault(key, {}).setdefault(module, {})
        if suffix in stored:
            raise ModelLoadError(f"tensor {name!r} appears twice (again in {path.name})")
        stored[suffix] = tensor
        if self._complete(key):
            self._install(key)

    def _complete(self, key: tuple[int, str]) -> bool:
        layer, fused = key
        stored = self._pending.get(key, {})
        return all(
            set(stored.get(part.module, {})) >= self._expected(f"model.layers.{layer}.{part.module}")
            for part in self._groups[fused][1]
        )

    def missing(self) -> list[str]:
        """Checkpoint tensors never seen (names), for the loader's missing-tensors error."""
        out: list[str] = []
        for layer in range(self._config.num_hidden_layers):
            for fused, (_, parts) in self._groups.items():
                if (layer, fused) in self._done:
                    continue
                stored = self._pending.get((layer, fused), {})
                for part in parts:
                    hf_module = f"model.layers.{layer}.{part.module}"
                    have = set(stored.get(part.module, {}))
                    out += [f"{hf_module}.{suffix}" for suffix in sorted(self._expected(hf_module) - have)]
        if not out:
            summary = ", ".join(f"{count} {kind}" for kind, count in sorted(self._kinds.items()))
            log.info("decoder projections: %s", summary)
        return out

    def _install(self, key: tuple[int, str]) -> None:
        layer, fused = key
        in_features, parts = self._groups[fused]
        stored = self._pending.pop(key)
        weights = [
            self._decode_share(layer=layer, part=part, tensors=stored[part.module], in_features=in_features)
            for part in parts
        ]
        if len({type(w) for w in weights}) > 1:
            log.warning("layer %d %s: mixed quantized and dense parts; the group is served dense", layer, fused)
            weights = [dequantize(w, dtype=self._dtype) for w in weights]
        weight = self._row_parallel_scales(
            fused, _to_device(concat_out_features(weights), device=self._device, dtype=self._dtype)
        )
        self._model.decoder_layers()[layer].set_linear(fused, weight)
        self._kinds[_kind(weight)] += 1
        self._done.add(key)

    def _decode_share(
        self, *, layer: int, part: _Part, tensors: dict[str, LinearWeight], in_features: int
    ) -> LinearWeight:
        """The projection decoded (or quantized) whole, then this rank's share of it. An int4
        slice that does not cut at group boundaries is refused, stored or quantized at load
        time alike: quantizing the rank's share with groups of its own would make the weights
        depend on the tensor-parallel size, and the replica's answers with them."""
        weight = self._decode(layer=layer, part=part, tensors=tensors, in_features=in_features)
        if self._layout is None:
            return weight
        dim, start, length = self._layout.projection_slice(part.module)
        try:
            return narrow_features(weight, dim=dim, start=start, length=length)
        except ValueError as exc:
            raise ModelLoadError(
                f"model.layers.{layer}.{part.module} ({part.rows} x {in_features}) cannot be "
                f"split for tensor-parallel rank {self._layout.rank} of {self._layout.size}: "
                f"{exc}; serve it at a tensor-parallel size whose input slices are whole "
                "groups"
            ) from None

    def _row_parallel_scales(self, fused: str, weight: LinearWeight) -> LinearWeight:
        """``weight`` with its activation amax reduced over the ranks, for a W8A8 row-parallel
        share (a rank sees only its slice of the input row; the scale must be the row's)."""
        collectives = self._model.collectives
        if (
            fused not in _ROW_PARALLEL
            or self._layout is None
            or self._layout.size == 1
            or collectives is None
            or not isinstance(weight, Fp8Weight | Int8Weight)
            or (isinstance(weight, Int8Weight) and not weight.act_quant)
        ):
            return weight
        reduce = functools.partial(all_reduce_max, collectives, rank=self._layout.rank, size=self._layout.size)
        return dataclasses.replace(weight, act_amax_reduce=reduce)

    def _decode(self, *, layer: int, part: _Part, tensors: dict[str, LinearWeight], in_features: int) -> LinearWeight:
        hf_module = f"model.layers.{layer}.{part.module}"
        if self._scheme is not None and self._scheme.quantizes(hf_module):
            stored = {suffix: t for suffix, t in tensors.items() if isinstance(t, torch.Tensor)}
            return self._scheme.decode(
                module=hf_module, tensors=stored, out_features=part.rows, in_features=in_features, dtype=self._dtype
            )
        dense = tensors["weight"]
        shape = tuple(dense.shape) if isinstance(dense, torch.Tensor) else (dense.out_features, dense.in_features)
        if shape != (part.rows, in_features):
            raise ModelLoadError(
                f"tensor {hf_module}.weight has shape {shape}, expected {(part.rows, in_features)} from config.json"
            )
        if not isinstance(dense, torch.Tensor):
            return dense  # decoded by the GGUF reader
        if self._load_time is None:
            return dense.to(self._dtype)
        on_device = dense.to(self._device)
        if self._load_time == "fp8":
            return quantize_fp8(on_device)
        if self._load_time == "int8":
            return quantize_int8(on_device, act_quant=True)
        return quantize_int4(on_device, group_size=int4_group_size(in_features), scale_dtype=self._dtype)


def _to_device(weight: LinearWeight, *, device: torch.device, dtype: torch.dtype) -> LinearWeight:
    if isinstance(weight, torch.Tensor):
        return weight.to(device=device, dtype=dtype).contiguous()
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(qweight=weight.qweight.to(device), weight_scale=weight.weight_scale.to(device))
    if isinstance(weight, Int8Weight):
        return Int8Weight(
            qweight=weight.qweight.to(device), weight_scale=weight.weight_scale.to(device), act_quant=weight.act_quant
        )
    return Int4Weight(
        qweight=weight.qweight.to(device),
        scales=weight.scales.to(device=device, dtype=dtype),
        offsets=weight.offsets.to(device=device, dtype=dtype),
        group_size=weight.group_size,
    )


def _kind(weight: LinearWeight) -> str:
    if isinstance(weight, torch.Tensor):
        return "dense"
    if isinstance(weight, Fp8Weight):
        return "fp8 W8A8"
    if isinstance(weight, Int8Weight):
        return "int8 W8A8" if weight.act_quant else "int8 W8A16"
    return f"int4 W4A16 g{weight.group_size}"
