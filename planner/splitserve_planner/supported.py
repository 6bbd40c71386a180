"""What the planner may propose: this version's capabilities, from
:mod:`splitserve_contract.capabilities` (the table the CRD and the runtime also enforce).

The roofline can price settings the API knows but this version does not serve (none of the
planner's today: every tensor-parallel size, quantization and KV cache dtype is served); the
planner uses them only for an explicitly requested what-if (``splitserve plan --what-if``) and
never puts them in a manifest. Tensor-parallel sizes, weight quantization and the KV cache dtype
are all checked against the table, so narrowing or widening ``TENSOR_PARALLEL_SIZE``,
``QUANTIZATION`` or ``KV_CACHE_DTYPE`` there changes what the planner proposes with no edit here.
"""

from __future__ import annotations

from splitserve_contract import capabilities as caps

from .gpus import GpuSpec
from .precision import Precision


def supported_tensor_parallel_sizes() -> tuple[int, ...]:
    """The TP sizes a plan may use (``parallelism.tensor`` values this version serves)."""
    return tuple(int(v) for v in caps.TENSOR_PARALLEL_SIZE.supported)


def known_tensor_parallel_sizes() -> tuple[int, ...]:
    """Every TP size the API knows (the roofline can price them as a what-if)."""
    return tuple(int(v) for v in caps.TENSOR_PARALLEL_SIZE.known)


def supported_quantizations() -> tuple[str, ...]:
    """``spec.model.quantization`` values this version serves, ``none`` first."""
    return tuple(str(v) for v in caps.QUANTIZATION.supported)


def unsupported_settings(*, tensor_parallel: int, precision: Precision) -> list[str]:
    """One capability message per setting this version does not serve (empty: servable)."""
    return caps.unsupported(
        [
            (caps.TENSOR_PARALLEL_SIZE, tensor_parallel),
            (caps.DTYPE, precision.dtype),
            (caps.QUANTIZATION, precision.quantization),
            (caps.KV_CACHE_DTYPE, precision.kv_cache_dtype),
        ]
    )


def check_servable(*, tensor_parallel: int, precision: Precision) -> None:
    """Raise :class:`~splitserve_contract.capabilities.UnsupportedError` (a ValueError) with the
    capabilities table's message unless this version serves the setting."""
    messages = unsupported_settings(tensor_parallel=tensor_parallel, precision=precision)
    if messages:
        raise caps.UnsupportedError("; ".join(messages))


# Bytes per linear parameter of each method, smallest last: the ones that shrink a pod further.
_SMALLER = {"none": ("fp8", "int8", "int4"), "fp8": ("int4",), "int8": ("int4",), "int4": ()}


def remedies(
    *, tensor_parallel: int, what_if: bool = False, precision: Precision | None = None, gpu: GpuSpec | None = None
) -> str:
    """How to make a model or an SLO fit, naming only what this version serves (what-if: what
    the API knows). With ``precision``, only quantization and KV settings smaller than it; with
    ``gpu``, no fp8 where it has no FP8 support."""
    sizes = known_tensor_parallel_sizes() if what_if else supported_tensor_parallel_sizes()
    options = []
    if any(size > tensor_parallel for size in sizes):
        options.append("a larger --tp")
    current = precision.quantization if precision is not None else "none"
    allowed = caps.QUANTIZATION.known if what_if else caps.QUANTIZATION.supported
    fp8_ok = gpu is None or gpu.has_fp8
    smaller = [q for q in _SMALLER[current] if q in allowed and (fp8_ok or q != "fp8")]
    if smaller:
        options.append(f"--quantization {'|'.join(smaller)}")
    kv_fp8_allowed = what_if or caps.KV_CACHE_DTYPE.is_supported("fp8")
    if kv_fp8_allowed and fp8_ok and (precision is None or precision.kv_cache_dtype != "fp8"):
        options.append("--kv-cache-dtype fp8")
    options.append("a bigger or faster GPU")
    return ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]
