"""The runtime's own layouts for quantized linear weights: one per kernel family.

Every checkpoint format (compressed-tensors, AutoFP8 ``fp8``, AWQ, GPTQ, GGUF) and every
load-time quantization (``--quantization fp8|int8|int4``) is converted *once, at load time*
into one of these three layouts, so each kernel (Triton on the GPU, torch reference on the
CPU) reads exactly one layout and the loaders carry all the format knowledge:

- :class:`Fp8Weight` — W8A8 FP8 (e4m3): per-output-channel weight scales (a per-tensor scale
  is broadcast to every channel), activations quantized per token at run time.
- :class:`Int8Weight` — INT8 symmetric per-channel weights; with ``act_quant`` the
  activations are quantized per token to int8 too (W8A8, int32 accumulation), otherwise the
  weight is dequantized in registers (W8A16).
- :class:`Int4Weight` — 4-bit weight-only (W4A16), groups along the input dimension:
  ``w[n, k] = q * scales[g, n] + offsets[g, n]`` with ``g = k // group_size``. The affine form
  covers AWQ and GPTQ zero points (``offset = -zero * scale``), symmetric int4
  (``zero = 8``) and GGUF Q4_0/Q4_1 (``offset = -8 d`` / ``m``) alike.

A linear layer's weight is either a dense ``torch.Tensor`` ``[N, K]`` (``N`` = out features) or
one of these; :data:`LinearWeight` is that union and :func:`dequantize` turns any of them back
into a dense ``[N, K]`` tensor (tests, the reference path, and the fused-projection concat).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar, Final, TypeVar

import torch

FP8_DTYPE: Final = torch.float8_e4m3fn
FP8_MAX: Final = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
INT8_MAX: Final = 127.0
_T = TypeVar("_T")
INT4_PACK: Final = 8
"""4-bit values per int32 word of :attr:`Int4Weight.qweight`."""

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]
"""Turns a tensor-parallel rank's per-token activation amax ``[M, 1]`` (fp32, over its slice
of the input features) into the amax over the whole input row: a max over the ranks."""


@dataclasses.dataclass(frozen=True)
class _PerChannelWeight:
    """8-bit weights ``qweight [N, K]`` of dtype :attr:`STORED` with one float32 scale per
    output channel: ``w = qweight * weight_scale[:, None]``."""

    STORED: ClassVar[torch.dtype]
    qweight: torch.Tensor
    weight_scale: torch.Tensor
    act_amax_reduce: AmaxReduce | None = dataclasses.field(default=None, compare=False, repr=False, kw_only=True)
    """Set on a tensor-parallel rank's share of a row-parallel W8A8 projection (its input
    features split over the ranks): the per-token activation scale is then taken over the whole
    input row, as a single process takes it, not over this rank's slice. None otherwise."""

    def __post_init__(self) -> None:
        kind = type(self).__name__
        _check(
            self.qweight.dtype == self.STORED and self.qweight.dim() == 2,
            f"{kind}.qweight must be {str(self.STORED).removeprefix('torch.')} [N, K], got "
            f"{self.qweight.dtype} {tuple(self.qweight.shape)}",
        )
        _check(
            tuple(self.weight_scale.shape) == (self.qweight.shape[0],) and self.weight_scale.dtype == torch.float32,
            f"{kind}.weight_scale must be float32 [{self.qweight.shape[0]}], got "
            f"{self.weight_scale.dtype} {tuple(self.weight_scale.shape)}",
        )

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    def nbytes(self) -> int:
        return _nbytes(self.qweight, self.weight_scale)


@dataclasses.dataclass(frozen=True)
class Fp8Weight(_PerChannelWeight):
    """W8A8 FP8: ``y = (fp8(x / sx) @ qweight.T) * sx * weight_scale`` with ``sx`` per token;
    ``qweight`` is ``float8_e4m3fn [N, K]``."""

    STORED: ClassVar[torch.dtype] = FP8_DTYPE


@dataclasses.dataclass(frozen=True)
class Int8Weight(_PerChannelWeight):
    """INT8 symmetric per-channel, ``qweight`` ``int8 [N, K]``."""

    STORED: ClassVar[torch.dtype] = torch.int8
    act_quant: bool = True
    """True: W8A8 (activations quantized per token, symmetric int8); False: W8A16."""


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """4-bit weight-only, grouped along K (see the module docstring).

    ``qweight`` is ``int32 [K // 8, N]``: word ``[r, n]`` holds ``k = 8 r + j`` for
    ``j = 0..7`` in bits ``4 j .. 4 j + 3`` (unsigned 0..15), the GPTQ ``qweight`` layout.
    ``scales`` and ``offsets`` are ``[K // group_size, N]`` in the activation dtype."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        _check(
            self.qweight.dtype == torch.int32 and self.qweight.dim() == 2,
            f"Int4Weight.qweight must be int32 [K/8, N], got {self.qweight.dtype} {tuple(self.qweight.shape)}",
        )
        k, n = self.in_features, self.out_features
        _check(
            self.group_size > 0 and self.group_size % INT4_PACK == 0 and k % self.group_size == 0,
            f"Int4Weight.group_size {self.group_size} must be a multiple of 8 dividing K={k}",
        )
        groups = k // self.group_size
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            _check(
                tuple(t.shape) == (groups, n) and t.is_floating_point(),
                f"Int4Weight.{name} must be floating [{groups}, {n}], got {t.dtype} {tuple(t.shape)}",
            )

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[0]) * INT4_PACK

    def nbytes(self) -> int:
        return _nbytes(self.qweight, self.scales, self.offsets)


QuantizedWeight = Fp8Weight | Int8Weight | Int4Weight
LinearWeight = torch.Tensor | Fp8Weight | Int8Weight | Int4Weight


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """``int32 [K // 8, N]`` → ``uint8``-valued ``int32 [K, N]`` (0..15), nibble ``j`` of row ``r`` → ``k = 8 r + j``."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    nibbles = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF  # [K/8, 8, N]
    return nibbles.reshape(-1, qweight.shape[1])


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_int4`: integer ``[K, N]`` in 0..15 → ``int32 [K // 8, N]``."""
    k, n = values.shape
    if k % INT4_PACK:
        raise ValueError(f"pack_int4: K={k} is not a multiple of {INT4_PACK}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError("pack_int4: values must be in 0..15")
    v = values.to(torch.int64).reshape(k // INT4_PACK, INT4_PACK, n)
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int64).view(1, -1, 1)
    words = (v << shifts).sum(dim=1)  # < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize(weight: LinearWeight, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[N, K]`` in ``dtype`` holding the same numbers as ``weight``."""
    if isinstance(weight, torch.Tensor):
        return weight.to(dtype)
    if isinstance(weight, _PerChannelWeight):
        return (weight.qweight.float() * weight.weight_scale[:, None]).to(dtype)
    q = unpack_int4(weight.qweight).float()  # [K, N]
    scales = weight.scales.float().repeat_interleave(weight.group_size, dim=0)
    offsets = weight.offsets.float().repeat_interleave(weight.group_size, dim=0)
    return (q * scales + offsets).t().contiguous().to(dtype)


def concat_out_features(parts: list[LinearWeight]) -> LinearWeight:
    """One weight whose output rows are ``parts``' rows in order (fused QKV, gate/up).

    Parts must share a layout (and, for int4, a group size): a checkpoint that quantized
    q_proj and k_proj differently cannot be fused and is refused by the loader."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([_same(p, torch.Tensor) for p in parts], dim=0)
    if isinstance(first, Fp8Weight):
        fp8 = [_same(p, Fp8Weight) for p in parts]
        return Fp8Weight(
            qweight=torch.cat([p.qweight for p in fp8], dim=0),
            weight_scale=torch.cat([p.weight_scale for p in fp8], dim=0),
        )
    if isinstance(first, Int8Weight):
        int8 = [_same(p, Int8Weight) for p in parts]
        if len({p.act_quant for p in int8}) != 1:
            raise ValueError("cannot fuse W8A8 and W8A16 projections")
        return Int8Weight(
            qweight=torch.cat([p.qweight for p in int8], dim=0),
            weight_scale=torch.cat([p.weight_scale for p in int8], dim=0),
            act_quant=first.act_quant,
        )
    int4 = [_same(p, Int4Weight) for p in parts]
    if len({p.group_size for p in int4}) != 1:
        raise ValueError(f"cannot fuse int4 projections with group sizes {sorted({p.group_size for p in int4})}")
    return Int4Weight(
        qweight=torch.cat([p.qweight for p in int4], dim=1),
        scales=torch.cat([p.scales for p in int4], dim=1),
        offsets=torch.cat([p.offsets for p in int4], dim=1),
        group_size=first.group_size,
    )


def narrow_features(weight: LinearWeight, *, dim: int, start: int, length: int) -> LinearWeight:
    """The slice ``[start, start + length)`` of ``weight``'s output rows (``dim`` 0) or input
    columns (``dim`` 1), in the same layout: a tensor-parallel rank's share of a column- or
    row-parallel projection. Per-channel scales follow their rows; an int4 input slice must
    cut at group boundaries (ValueError otherwise)."""
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 (output rows) or 1 (input columns), got {dim}")
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, length).contiguous()
    if isinstance(weight, _PerChannelWeight):
        scale = weight.weight_scale.narrow(0, start, length) if dim == 0 else weight.weight_scale
        return dataclasses.replace(
            weight, qweight=weight.qweight.narrow(dim, start, length).contiguous(), weight_scale=scale.contiguous()
        )
    if dim == 0:
        return dataclasses.replace(
            weight,
            qweight=weight.qweight.narrow(1, start, length).contiguous(),
            scales=weight.scales.narrow(1, start, length).contiguous(),
            offsets=weight.offsets.narrow(1, start, length).contiguous(),
        )
    group = weight.group_size
    if start % group or length % group:
        raise ValueError(
            f"int4 groups of {group} input features do not align with the slice "
            f"[{start}, {start + length}) of the {weight.in_features} input features"
        )
    return dataclasses.replace(
        weight,
        qweight=weight.qweight.narrow(0, start // INT4_PACK, length // INT4_PACK).contiguous(),
        scales=weight.scales.narrow(0, start // group, length // group).contiguous(),
        offsets=weight.offsets.narrow(0, start // group, length // group).contiguous(),
    )


def weight_nbytes(weight: LinearWeight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return weight.nbytes()


def _same(part: LinearWeight, kind: type[_T]) -> _T:
    if not isinstance(part, kind):
        raise ValueError(f"cannot fuse a {type(part).__name__} with a {kind.__name__}")
    return part


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
