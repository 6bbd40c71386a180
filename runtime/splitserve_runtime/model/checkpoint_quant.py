"""Pre-quantized checkpoints: what a ``quantization_config`` says, and how each linear
module's stored tensors become one of the runtime's layouts (:mod:`..quant.formats`).

Supported, each decoded once at load time (kernels never see a checkpoint format):

- **compressed-tensors** (llm-compressor): ``float-quantized`` FP8 e4m3 weights with
  per-tensor or per-channel scales (W8A8 with dynamic per-token activations);
  ``int-quantized``/``naive-quantized`` INT8 symmetric per-channel (W8A8 when the group has
  ``input_activations``, else W8A16), also ``pack-quantized`` (four per word, W8A16);
  ``pack-quantized`` INT4 (symmetric or with zero points, grouped or per-channel), W4A16.
- **fp8** (AutoFP8, as vLLM reads it): FP8 weights with a per-tensor ``weight_scale``.
- **awq** (AutoAWQ ``gemm`` packing): 4-bit, zero points, any group size dividing K.
- **gptq** (AutoGPTQ / GPTQModel, ``gptq`` and ``gptq_v2`` zero conventions): 4-bit, symmetric
  or not, ``desc_act`` only with a trivial ``g_idx``.

Anything else (other methods, 8-bit GPTQ, block-scaled FP8, act-order GPTQ, static
activation scales we would silently ignore...) is a :class:`ModelLoadError` saying exactly
what is not supported, never a wrong answer. Static per-tensor activation scales
(``input_scale``) are the one deliberate deviation: activations are quantized per token at run
time instead, which is at least as accurate; the log says so.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any, Final

import torch

from ..quant.formats import (
    FP8_DTYPE,
    INT4_PACK,
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    LinearWeight,
    pack_int4,
    unpack_int4,
)
from .errors import ModelLoadError

log = logging.getLogger(__name__)

AWQ_ORDER: Final = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's ``gemm`` packing: nibble ``i`` of a word holds column ``8 c + AWQ_ORDER[i]``."""


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """One checkpoint's scheme: what a quantized linear module stores and how to decode it."""

    family: str
    """``fp8``, ``int8`` or ``int4``: the ``spec.model.quantization`` value it corresponds to."""
    description: str
    tensor_suffixes: frozenset[str]
    """Exactly the tensors every quantized linear module has (``weight``, ``weight_scale``...)."""
    decoder: str
    params: Mapping[str, Any]
    ignore: tuple[str, ...] = ()
    """Module names (or ``re:`` patterns) the tool left unquantized."""

    def quantizes(self, module: str) -> bool:
        """Whether linear ``module`` (HF name, e.g. ``model.layers.0.mlp.down_proj``) is stored quantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern) or pattern == module.rsplit(".", 1)[-1]:
                return False
        return True

    def decode(
        self,
        *,
        module: str,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
    ) -> LinearWeight:
        """The runtime layout of one module's stored tensors (``[out, in]`` as config.json says)."""
        try:
            decoded = _DECODERS[self.decoder](self, tensors, out_features, in_features, dtype)
        except (ValueError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(f"{module}: cannot decode {self.description} tensors: {exc}") from exc
        shape = (
            (decoded.out_features, decoded.in_features)
            if not isinstance(decoded, torch.Tensor)
            else tuple(decoded.shape)
        )
        if shape != (out_features, in_features):
            raise ModelLoadError(
                f"{module}: {self.description} tensors decode to shape {shape}, "
                f"expected {(out_features, in_features)} from config.json"
            )
        return decoded


def parse_quantization_config(raw: Mapping[str, Any] | None, *, source: str) -> CheckpointQuantization | None:
    """The checkpoint's scheme, None for a dense checkpoint; ModelLoadError for anything unsupported."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{source}: quantization_config must be an object")
    method = str(raw.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(raw, source)
    if method == "fp8":
        return _autofp8(raw, source)
    if method == "awq":
        return _awq(raw, source)
    if method == "gptq":
        return _gptq(raw, source)
    raise ModelLoadError(
        f"{source}: quantization_config.quant_method {method or '(missing)'!r} is not supported "
        "(supported: compressed-tensors, fp8, awq, gptq)"
    )


# ---------------------------------------------------------------------------- parsing
def _unsupported(source: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: {what} is not supported")


def _compressed_tensors(raw: Mapping[str, Any], source: str) -> CheckpointQuantization:
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise _unsupported(
            source,
            f"compressed-tensors with {len(groups) if isinstance(groups, Mapping) else 0} "
            "config_groups (exactly one, targeting Linear, is)",
        )
    group = next(iter(groups.values()))
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise _unsupported(source, f"compressed-tensors config group targets {targets} (Linear is)")
    fmt = str(group.get("format") or raw.get("format") or "")
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    bits, kind = int(weights.get("num_bits", 0)), str(weights.get("type", "int"))
    strategy, symmetric = str(weights.get("strategy", "")), bool(weights.get("symmetric", True))
    if weights.get("dynamic"):
        raise _unsupported(source, "compressed-tensors dynamic weight quantization")
    if raw.get("kv_cache_scheme"):
        log.info("%s: calibrated KV-cache scales are used when spec.kvCache.dtype is fp8", source)
    static_acts = bool(acts) and not acts.get("dynamic", False)
    if acts and (int(acts.get("num_bits", 8)) != 8 or (not static_acts and acts.get("strategy") != "token")):
        raise _unsupported(source, f"compressed-tensors input activations {dict(acts)}")
    if static_acts:
        log.warning(
            "%s: static activation scales are not used; activations are quantized per token at run time", source
        )
    ignore = tuple(str(x) for x in raw.get("ignore") or ())
    act_suffix = frozenset({"input_scale"}) if static_acts else frozenset()
    if acts and not static_acts and acts.get("type", "int") != kind:
        raise _unsupported(source, f"compressed-tensors {kind} weights with {acts.get('type')} activations")
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if strategy not in ("tensor", "channel"):
            raise _unsupported(
                source, f"compressed-tensors FP8 with {strategy!r} weight scales (tensor and channel are)"
            )
        if not acts:
            log.warning(
                "%s: FP8 weight-only checkpoint: activations are quantized to FP8 per token at run time", source
            )
        return CheckpointQuantization(
            family="fp8",
            description=f"compressed-tensors FP8 ({strategy} weight scales)",
            tensor_suffixes=frozenset({"weight", "weight_scale"}) | act_suffix,
            decoder="fp8",
            params={},
            ignore=ignore,
        )
    if kind == "int" and bits == 8 and fmt in ("int-quantized", "naive-quantized"):
        if strategy not in ("tensor", "channel") or not symmetric:
            raise _unsupported(
                source,
                f"compressed-tensors INT8 with {strategy!r} "
                f"{'symmetric' if symmetric else 'asymmetric'} weights "
                "(symmetric tensor/channel scales are)",
            )
        mode = "W8A8" if acts else "W8A16"
        return CheckpointQuantization(
            family="int8",
            description=f"compressed-tensors INT8 {mode} ({strategy} weight scales)",
            tensor_suffixes=frozenset({"weight", "weight_scale"}) | act_suffix,
            decoder="int8",
            params={"act_quant": bool(acts)},
            ignore=ignore,
        )
    if kind == "int" and bits == 8 and fmt == "pack-quantized":
        if acts or strategy not in ("tensor", "channel") or not symmetric:
            raise _unsupported(
                source,
                f"compressed-tensors packed INT8 with {strategy!r} "
                f"{'symmetric' if symmetric else 'asymmetric'} weights"
                f"{' and quantized activations' if acts else ''} "
                "(symmetric tensor/channel weight-only is)",
            )
        return CheckpointQuantization(
            family="int8",
            description=f"compressed-tensors INT8 W8A16 (packed, {strategy} weight scales)",
            tensor_suffixes=frozenset({"weight_packed", "weight_scale", "weight_shape"}),
            decoder="ct_int8_packed",
            params={},
            ignore=ignore,
        )
    if kind == "int" and bits == 4 and fmt == "pack-quantized":
        if acts:
            raise _unsupported(source, "compressed-tensors INT4 with quantized activations (W4A8)")
        if strategy not in ("group", "channel"):
            raise _unsupported(
                source, f"compressed-tensors INT4 with {strategy!r} weight scales (group and channel are)"
            )
        if weights.get("actorder"):
            raise _unsupported(source, "compressed-tensors INT4 with activation ordering (actorder)")
        suffixes = {"weight_packed", "weight_scale", "weight_shape"} | (
            {"weight_zero_point"} if not symmetric else set()
        )
        return CheckpointQuantization(
            family="int4",
            description=f"compressed-tensors INT4 W4A16 ({strategy}, {'symmetric' if symmetric else 'zero points'})",
            tensor_suffixes=frozenset(suffixes),
            decoder="ct_int4",
            params={"symmetric": symmetric},
            ignore=ignore,
        )
    raise _unsupported(source, f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights")


def _autofp8(raw: Mapping[str, Any], source: str) -> CheckpointQuantization:
    if raw.get("weight_block_size"):
        raise _unsupported(source, f"block-scaled FP8 (weight_block_size {raw.get('weight_block_size')})")
    scheme = str(raw.get("activation_scheme", "dynamic"))
    if scheme not in ("dynamic", "static"):
        raise _unsupported(source, f"fp8 activation_scheme {scheme!r}")
    if scheme == "static":
        log.warning(
            "%s: static activation scales are not used; activations are quantized per token at run time", source
        )
    return CheckpointQuantization(
        family="fp8",
        description="fp8 (per-tensor weight scales)",
        tensor_suffixes=frozenset({"weight", "weight_scale"} | ({"input_scale"} if scheme == "static" else set())),
        decoder="fp8",
        params={},
        ignore=tuple(str(x) for x in raw.get("ignored_layers") or ()),
    )


def _int4_common(raw: Mapping[str, Any], source: str, method: str) -> int:
    bits = int(raw.get("bits", raw.get("w_bit", 0)))
    if bits != 4:
        raise _unsupported(source, f"{bits}-bit {method}")
    return int(raw.get("group_size", raw.get("q_group_size", 128)))


def _awq(raw: Mapping[str, Any], source: str) -> CheckpointQuantization:
    group_size = _int4_common(raw, source, "awq")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported(source, f"awq version {version!r} (gemm is)")
    if not raw.get("zero_point", True):
        raise _unsupported(source, "awq without zero points")
    return CheckpointQuantization(
        family="int4",
        description=f"awq (gemm, group size {group_size})",
        tensor_suffixes=frozenset({"qweight", "qzeros", "scales"}),
        decoder="awq",
        params={"group_size": group_size},
        ignore=tuple(str(x) for x in raw.get("modules_to_not_convert") or ()),
    )


def _gptq(raw: Mapping[str, Any], source: str) -> CheckpointQuantization:
    group_size = _int4_common(raw, source, "gptq")
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported(source, f"gptq checkpoint_format {fmt!r} (gptq and gptq_v2 are)")
    sym = bool(raw.get("sym", True))
    return CheckpointQuantization(
        family="int4",
        description=f"gptq ({'symmetric' if sym else 'asymmetric'}, group size {group_size})",
        tensor_suffixes=frozenset({"qweight", "qzeros", "scales", "g_idx"}),
        decoder="gptq",
        params={"group_size": group_size, "zero_plus_one": fmt == "gptq", "desc_act": bool(raw.get("desc_act", False))},
        ignore=tuple(str(x) for x in raw.get("modules_to_not_convert") or ()),
    )


# ---------------------------------------------------------------------------- decoding
def _channel_scale(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(out_features).contiguous()
    if s.numel() != out_features:
        raise ValueError(f"weight_scale has {s.numel()} values, expected 1 or {out_features}")
    return s.contiguous()


def _decode_fp8(
    scheme: CheckpointQuantization, t: Mapping[str, torch.Tensor], n: int, k: int, dtype: torch.dtype
) -> LinearWeight:
    weight = t["weight"]
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight has dtype {weight.dtype}, expected float8_e4m3fn")
    return Fp8Weight(qweight=weight.contiguous(), weight_scale=_channel_scale(t["weight_scale"], n))


def _decode_int8(
    scheme: CheckpointQuantization, t: Mapping[str, torch.Tensor], n: int, k: int, dtype: torch.dtype
) -> LinearWeight:
    weight = t["weight"]
    if weight.dtype != torch.int8:
        raise ValueError(f"weight has dtype {weight.dtype}, expected int8")
    return Int8Weight(
        qweight=weight.contiguous(),
        weight_scale=_channel_scale(t["weight_scale"], n),
        act_quant=bool(scheme.params["act_quant"]),
    )


def _unpack_rows(words: torch.Tensor, *, count: int) -> torch.Tensor:
    """``int32 [R, W]`` with 8 sequential nibbles per word along each row → ``[R, count]`` in 0..15."""
    nibbles = unpack_int4(words.t().contiguous()).t()  # [R, 8 W]
    if nibbles.shape[1] < count:
        raise ValueError(f"packed rows hold {nibbles.shape[1]} values, expected {count}")
    return nibbles[:, :count]


def _affine(
    q_unsigned_kn: torch.Tensor, scales_gn: torch.Tensor, zeros_gn: torch.Tensor, group_size: int, dtype: torch.dtype
) -> Int4Weight:
    """``w = (q - zero) * scale`` → the runtime's ``q * scale + offset`` layout."""
    scales = scales_gn.float()
    offsets = -zeros_gn.float() * scales
    return Int4Weight(
        qweight=pack_int4(q_unsigned_kn),
        scales=scales.to(dtype).contiguous(),
        offsets=offsets.to(dtype).contiguous(),
        group_size=group_size,
    )


def _group_size(k: int, configured: int) -> int:
    size = k if configured in (-1, 0) else configured
    if k % size or size % INT4_PACK:
        raise ValueError(f"group size {configured} does not divide in_features {k} into multiples of 8")
    return size


def _decode_ct_int4(
    scheme: CheckpointQuantization, t: Mapping[str, torch.Tensor], n: int, k: int, dtype: torch.dtype
) -> LinearWeight:
    shape = tuple(int(x) for x in t["weight_shape"].reshape(-1).tolist())
    if shape != (n, k):
        raise ValueError(f"weight_shape {shape} differs from {(n, k)}")
    q = _unpack_rows(t["weight_packed"], count=k)  # [N, K] unsigned = signed + 8
    scale = t["weight_scale"]
    if scale.dim() == 1:
        scale = scale.reshape(n, 1)
    groups = int(scale.shape[1])
    group_size = _group_size(k, k // groups if groups else 0)
    # Zero points in the unsigned domain of q (stored nibble = signed value + 8): 8 when symmetric.
    if scheme.params["symmetric"]:
        zeros_gn = torch.full((groups, n), 8.0)
    else:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32:  # packed along the output dimension: [ceil(N/8), G]
            zeros_gn = _unpack_rows(zp.t().contiguous(), count=n).float()
        else:
            zeros_gn = zp.float().reshape(n, groups).t() + 8
    return _affine(q.t().contiguous(), scale.t().contiguous(), zeros_gn.contiguous(), group_size, dtype)


def _decode_ct_int8_packed(
    scheme: CheckpointQuantization, t: Mapping[str, torch.Tensor], n: int, k: int, dtype: torch.dtype
) -> LinearWeight:
    """``weight_packed`` int32 ``[N, K/4]``: four values per word, value ``j`` in bits ``8 j``,
    each the signed int8 plus 128."""
    shape = tuple(int(x) for x in t["weight_shape"].reshape(-1).tolist())
    if shape != (n, k):
        raise ValueError(f"weight_shape {shape} differs from {(n, k)}")
    words = t["weight_packed"].to(torch.int64) & 0xFFFF_FFFF
    shifts = torch.arange(0, 32, 8, dtype=torch.int64)
    unsigned = (words.unsqueeze(-1) >> shifts) & 0xFF  # [N, K/4, 4]
    signed = (unsigned.reshape(n, -1)[:, :k] - 128).to(torch.int8)
    return Int8Weight(qweight=signed.contiguous(), weight_scale=_channel_scale(t["weight_scale"], n), act_quant=False)


def _decode_awq(
    scheme: CheckpointQuantization, t: Mapping[str, torch.Tensor], n: int, k: int, dtype: torch.dtype
) -> LinearWeight:
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # column offset j sits at nibble inverse[j]

    def columns(words: torch.Tensor) -> torch.Tensor:  # int32 [R, N/8] → [R, N]
        nibbles = _unpack_rows(words, count=words.shape[1] * INT4_PACK).reshape(words.shape[0], -1, INT4_PACK)
        return nibbles[:, :, inverse].reshape(words.shape[0], -1)

    q = columns(t["qweight"])  # [K, N]
    zeros = columns(t["qzeros"])  # [G, N]
    scales = t["scales"]
    if tuple(q.shape) != (k, n) or scales.shape[1] != n:
        raise ValueError(f"qweight unpacks to {tuple(q.shape)}, expected {(k, n)}")
    group_size = _group_size(k, int(scheme.params["group_size"]))
    return _affine(q, scales, zeros[:, :n], group_size, dtype)


def _decode_gptq(
    scheme: CheckpointQuantization, t: Mapping[str, torch.Tensor], n: int, k: int, dtype: torch.dtype
) -> LinearWeight:
    group_size = _group_size(k, int(scheme.params["group_size"]))
    g_idx = t["g_idx"].long().reshape(-1)
    trivial = torch.arange(k) // group_size
    if g_idx.numel() != k or not torch.equal(g_idx, trivial):
        what = (
            "act-order (desc_act) with a permuted g_idx"
            if scheme.params["desc_act"]
            else "a g_idx that is not k // group_size"
        )
        raise ValueError(f"gptq {what} is not supported; quantize with desc_act=false")
    q = unpack_int4(t["qweight"])  # [K, N]
    zeros = _unpack_rows(t["qzeros"], count=n).float()
    if scheme.params["zero_plus_one"]:
        zeros = zeros + 1
    if tuple(q.shape) != (k, n):
        raise ValueError(f"qweight unpacks to {tuple(q.shape)}, expected {(k, n)}")
    return _affine(q, t["scales"], zeros, group_size, dtype)


_DECODERS: Final = {
    "fp8": _decode_fp8,
    "int8": _decode_int8,
    "ct_int4": _decode_ct_int4,
    "awq": _decode_awq,
    "ct_int8_packed": _decode_ct_int8_packed,
    "gptq": _decode_gptq,
}
