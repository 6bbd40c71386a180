"""What a pod stores and computes in: three separate choices, each with its own cost.

One "dtype byte count" cannot price a quantized model: the weights, the KV cache, the
activations that cross the TP all-reduce and the tensor cores the GEMMs run on all differ.
:class:`Precision` holds the three settings the runtime takes and turns them into numbers:

* **activation dtype** (``--dtype`` / ``spec.model.dtype``: bfloat16, float16, float32) —
  activations, embeddings and the LM head (every method keeps those dense), the attention
  FLOP rate and the all-reduce bytes;
* **weight quantization** (``--quantization`` / ``spec.model.quantization``) of the decoder
  layers' linear projections, as the runtime serves it (:mod:`splitserve_runtime.quant.formats`):

  =====  ========================================  ===========================  ===============
  name   layout                                    bytes per linear parameter   GEMM rate
  =====  ========================================  ===========================  ===============
  none   dense in the activation dtype             activation bytes             activation dtype
  fp8    W8A8 e4m3, per-channel scales             1                            FP8 tensor cores
  int8   W8A8 symmetric per-channel                1                            INT8 tensor cores
  int4   W4A16, groups of 128 along K, a scale     0.5 + 2·act_bytes/128        activation dtype
         and an offset per group in the act dtype  (0.53125 with bf16)
  =====  ========================================  ===========================  ===============

  Per-channel scales (4 bytes per output row, < 0.1 % of a 4096-wide row) are left out;
  int4's group scales and offsets are not (6 % of its bytes). fp8 needs FP8 tensor cores
  (Ada, Hopper, Blackwell); an A100 has none and is refused, as the runtime would fail there.
* **KV cache dtype** (``--kv-cache-dtype`` / ``spec.kvCache.dtype``: auto = the activation
  dtype, fp8 = 1 byte per element, e4m3 — also an FP8-GPU feature).

``--dtype fp8`` predates quantization in the planner and is kept as an alias for
``--dtype bfloat16 --quantization fp8`` (:meth:`Precision.of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_contract import capabilities as caps

from .gpus import GPUS, GpuSpec

ACTIVATION_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Activation dtypes the planner prices (``spec.model.dtype`` without ``auto``)."""
QUANTIZATIONS = tuple(str(v) for v in caps.QUANTIZATION.known)
KV_CACHE_DTYPES = tuple(str(v) for v in caps.KV_CACHE_DTYPE.known)
INT4_GROUP_SIZE = 128
FP8_ALIAS = "fp8"
"""``--dtype fp8``: the planner's name for fp8 weights before quantization had its own flag."""

_GEMM_OPERAND = {"fp8": "fp8", "int8": "int8"}
"""W8A8 methods quantize activations per token, so their GEMMs run on 8-bit tensor cores;
``none`` and W4A16 ``int4`` multiply in the activation dtype."""


def _fp8_gpus() -> str:
    return ", ".join(name for name, spec in GPUS.items() if spec.has_fp8)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Activation dtype, weight quantization and KV cache dtype of one pod."""

    dtype: str = "bfloat16"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ACTIVATION_BYTES:
            raise ValueError(
                f"activation dtype must be one of {', '.join(ACTIVATION_BYTES)}, got {self.dtype!r}"
                f" (weight quantization is separate: --quantization {'|'.join(QUANTIZATIONS)})"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @classmethod
    def of(cls, *, dtype: str, quantization: str = "none", kv_cache_dtype: str = "auto") -> Precision:
        """From command-line values, reading the legacy ``dtype="fp8"`` as bf16 activations
        with fp8 weights (a conflicting ``quantization`` is refused)."""
        if dtype == FP8_ALIAS:
            if quantization not in ("none", "fp8"):
                raise ValueError(
                    f"--dtype fp8 means --quantization fp8; it conflicts with --quantization {quantization}"
                )
            return cls(dtype="bfloat16", quantization="fp8", kv_cache_dtype=kv_cache_dtype)
        return cls(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)

    # ------------------------------------------------------------------ bytes
    @property
    def activation_bytes(self) -> int:
        """Activations, embeddings, LM head, all-reduce payloads."""
        return ACTIVATION_BYTES[self.dtype]

    @property
    def linear_weight_bytes(self) -> float:
        """Bytes per parameter of a decoder layer's linear projection (exact binary fractions)."""
        if self.quantization in ("fp8", "int8"):
            return 1.0
        if self.quantization == "int4":
            return 0.5 + 2 * self.activation_bytes / INT4_GROUP_SIZE
        return float(self.activation_bytes)

    @property
    def kv_bytes_per_element(self) -> int:
        return 1 if self.kv_cache_dtype == "fp8" else self.activation_bytes

    # ------------------------------------------------------------------ compute
    @property
    def gemm_operand(self) -> str:
        """The tensor-core operand type of the linear layers' GEMMs."""
        return _GEMM_OPERAND.get(self.quantization, self.dtype)

    def check_gpu(self, gpu: GpuSpec) -> None:
        """ValueError unless ``gpu`` runs this precision (fp8 weights or KV need FP8 support)."""
        if gpu.has_fp8:
            return
        if self.quantization == "fp8":
            raise ValueError(
                f"{gpu.name} has no FP8 tensor cores: --quantization fp8 needs one of "
                f"{_fp8_gpus()}; use --quantization int8 or int4 on it"
            )
        if self.kv_cache_dtype == "fp8":
            raise ValueError(
                f"{gpu.name} has no FP8 support: --kv-cache-dtype fp8 needs one of "
                f"{_fp8_gpus()}; use --kv-cache-dtype auto on it"
            )

    def linear_ops_per_second(self, gpu: GpuSpec) -> float:
        """Peak dense rate of the decoder layers' GEMMs."""
        return gpu.flops_per_second(dtype=self.gemm_operand)

    def activation_flops_per_second(self, gpu: GpuSpec) -> float:
        """Peak dense rate of what stays in the activation dtype: attention and the LM head."""
        return gpu.flops_per_second(dtype=self.dtype)

    @property
    def label(self) -> str:
        """``bfloat16``, ``bfloat16, int4 weights (W4A16 g128), fp8 KV cache``, ..."""
        parts = [self.dtype]
        if self.quantization != "none":
            scheme = f"W4A16 g{INT4_GROUP_SIZE}" if self.quantization == "int4" else "W8A8"
            parts.append(f"{self.quantization} weights ({scheme})")
        if self.kv_cache_dtype != "auto":
            parts.append(f"{self.kv_cache_dtype} KV cache")
        return ", ".join(parts)
