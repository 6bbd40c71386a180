"""What the planner may propose: this version's capabilities, from
:mod:`splitserve_contract.capabilities` (the table the CRD and the runtime also enforce).

The roofline can price settings this version does not serve (tensor parallelism, fp8); the
planner uses them only for an explicitly requested what-if (``splitserve plan --what-if``)
and never puts them in a manifest.
"""

from __future__ import annotations

from splitserve_contract import capabilities as caps

QUANTIZED_DTYPES = tuple(str(v) for v in caps.QUANTIZATION.known if v != "none")
"""``--dtype`` values that are a weight quantization (``spec.model.quantization``), not a dtype."""


def supported_tensor_parallel_sizes() -> tuple[int, ...]:
    """The TP sizes a plan may use (``parallelism.tensor`` values this version serves)."""
    return tuple(int(v) for v in caps.TENSOR_PARALLEL_SIZE.supported)


def known_tensor_parallel_sizes() -> tuple[int, ...]:
    """Every TP size the API knows (the roofline can price them as a what-if)."""
    return tuple(int(v) for v in caps.TENSOR_PARALLEL_SIZE.known)


def quantization_of(dtype: str) -> str:
    """The ``spec.model.quantization`` a planner dtype stands for (``fp8`` -> ``fp8``, else ``none``)."""
    return dtype if dtype in QUANTIZED_DTYPES else "none"


def unsupported_settings(*, tensor_parallel: int, dtype: str) -> list[str]:
    """One capability message per setting this version does not serve (empty: servable)."""
    pairs: list[tuple[caps.Capability, str | int]] = [(caps.TENSOR_PARALLEL_SIZE, tensor_parallel)]
    quantization = quantization_of(dtype)
    if quantization != "none":
        pairs.append((caps.QUANTIZATION, quantization))
    elif dtype in caps.DTYPE.known:
        pairs.append((caps.DTYPE, dtype))
    return caps.unsupported(pairs)


def check_servable(*, tensor_parallel: int, dtype: str) -> None:
    """Raise :class:`~splitserve_contract.capabilities.UnsupportedError` (a ValueError) with the
    capabilities table's message unless this version serves the setting."""
    messages = unsupported_settings(tensor_parallel=tensor_parallel, dtype=dtype)
    if messages:
        raise caps.UnsupportedError("; ".join(messages))


def remedies(*, tensor_parallel: int, what_if: bool = False) -> str:
    """How to make a model or an SLO fit, naming only what this version serves (what-if: what
    the API knows)."""
    sizes = known_tensor_parallel_sizes() if what_if else supported_tensor_parallel_sizes()
    options = []
    if any(size > tensor_parallel for size in sizes):
        options.append("a larger --tp")
    if what_if or caps.QUANTIZATION.is_supported("fp8"):
        options.append("fp8")
    options.append("a bigger or faster GPU")
    return ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]
