"""Pre-quantized Hugging Face checkpoints made from a dense one, in the formats real tools write.

Why: the runtime loads pre-quantized checkpoints (compressed-tensors, AutoFP8 ``fp8``, AWQ,
GPTQ), and tests and the quantization bench need such checkpoints of *our* models (the tiny
test model, SmolLM2-135M) without a GPU, a calibration data set or the internet. Every maker
writes a complete directory: ``config.json`` (the source's, plus the ``quantization_config``
the tool writes), one ``model.safetensors`` with the tool's tensor names, dtypes and shapes,
and every other file of the source (tokenizer, generation config) copied.

- **compressed-tensors** (what llm-compressor saves): written by the ``compressed-tensors``
  library itself, in process: its preset scheme is applied to the transformers model, the
  weight scales are computed with the library's ``calculate_qparams`` from per-channel
  min/max (what llm-compressor's min-max observer feeds it for these data-free schemes), and
  ``ModelCompressor`` compresses the modules and writes the ``quantization_config``.
  ``FP8_DYNAMIC`` (fp8 e4m3 weights, per-channel scales, dynamic per-token activations,
  ``float-quantized``), ``W8A8`` (int8 symmetric per-channel weights, dynamic per-token int8
  activations, ``int-quantized``) and ``W8A16`` (int8 symmetric per-channel weights only,
  ``pack-quantized``, four int8 values per int32: compressed-tensors' ``W8A16`` preset groups
  by 128; the per-channel variant is the one the runtime's int8 layout can hold).
- **AutoFP8** (``quant_method: fp8``, as vLLM reads it): fp8 weights with one float32
  ``weight_scale`` per tensor, ``activation_scheme: dynamic``. AutoFP8 is not on PyPI; the
  quantizer follows ``per_tensor_quantize`` and ``save_quantized_model`` in
  neuralmagic/AutoFP8 ``auto_fp8/quantize.py``.
- **AWQ** (AutoAWQ ``version: gemm``) and **GPTQ** (``checkpoint_format: gptq``, i.e. v1
  zero points). Neither tool is a dependency: GPTQModel needs torch>=2.14 (this project pins
  2.11) and AutoAWQ is archived, its quantizer built around GPU calibration. The packers are
  written from the tools' code, and were checked bit-identical with AutoAWQ 0.2.9's
  ``WQLinear_GEMM.from_linear`` and AutoGPTQ 0.7.1's ``QuantLinear.pack`` on the same integers:
  AutoAWQ 0.2.9 ``awq/modules/linear/gemm.py`` (``WQLinear_GEMM.from_linear``: ``qweight``
  ``[K, N/8]`` and ``qzeros`` ``[K/G, N/8]`` packed along N in the order
  ``0, 2, 4, 6, 1, 3, 5, 7``, ``scales`` fp16 ``[K/G, N]``) and ``awq/models/_config.py``
  (``to_transformers_dict``); AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py``
  (``QuantLinear.pack``: ``qweight`` ``[K/8, N]`` packed along K, ``qzeros`` ``[K/G, N/8]``
  holding ``zero - 1`` packed along N, ``scales`` fp16 ``[K/G, N]``, ``g_idx`` ``[K]``).
  The weights are quantized by **round-to-nearest** min-max per group (:func:`rtn_int4`),
  *not* by the AWQ or GPTQ calibration algorithms: the files are exactly what the tools
  write, the accuracy is a lower bound of what AWQ/GPTQ would reach. Like the tools, these
  makers cast every other tensor to float16.

Embeddings and ``lm_head`` stay unquantized everywhere (the tools' default,
``ignore: ["lm_head"]``); the quantized linears are the 2-D ``*.weight`` tensors under
``model.layers``. Outputs are published atomically (written to a sibling, then renamed).

Command line: ``python -m splitserve_e2e.quant_checkpoints METHOD DENSE_DIR OUT_DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX: Final = float(torch.finfo(torch.float8_e4m3fn).max)
INT4_MAX: Final = 15
NIBBLES_PER_WORD: Final = 8
AWQ_PACK_ORDER: Final = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ ``gemm``: nibble ``i`` (bits ``4 i .. 4 i + 3``) of word ``c`` holds column
``8 c + AWQ_PACK_ORDER[i]``."""
CT_SCHEMES: Final = ("FP8_DYNAMIC", "W8A8", "W8A16")
UNQUANTIZED_MODULES: Final = ("lm_head",)
WEIGHTS_FILE: Final = "model.safetensors"
_WEIGHT_FILES: Final = ("model.safetensors", "model.safetensors.index.json")
_MIN_SCALE: Final = 1e-5  # AutoAWQ's clamp: an all-zero group keeps a finite, non-zero scale


# ---------------------------------------------------------------- round-to-nearest int4


@dataclasses.dataclass(frozen=True)
class Int4Groups:
    """A weight ``[N, K]`` quantized to 4 bits in groups of ``group_size`` along K:
    ``w[n, k] ≈ (values[n, k] - zeros[n, g]) * scales[n, g]`` with ``g = k // group_size``."""

    values: torch.Tensor
    """``int32 [N, K]`` in 0..15."""
    zeros: torch.Tensor
    """``int32 [N, K / group_size]`` in 0..15."""
    scales: torch.Tensor
    """``float16 [N, K / group_size]``."""
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these numbers stand for (what a correct reader recovers)."""
        zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)
        return (self.values - zeros).float() * scales


def rtn_int4(weight: torch.Tensor, *, group_size: int, symmetric: bool, min_zero: int = 0) -> Int4Groups:
    """Round-to-nearest 4-bit quantization of ``weight [N, K]`` per group of ``group_size``.

    Asymmetric: the group's range ``[min, max]``, widened to include 0 (as GPTQ's quantizer
    does, so 0 is exact), maps onto 0..15: ``scale = (max - min) / 15``,
    ``zero = round(-min / scale)``. ``min_zero=1`` widens the range just enough that the zero
    point is at least 1, because the GPTQ v1 layout stores ``zero - 1`` in 4 bits and cannot
    hold a zero point of 0. Symmetric (GPTQ ``sym``): ``scale = 2 absmax / 15``, ``zero = 8``.
    Scales are rounded to float16 (the formats store them so) *before* the values are rounded
    against them, so :meth:`Int4Groups.dequantize` is exactly what the checkpoint means.
    """
    if weight.dim() != 2:
        raise ValueError(f"rtn_int4 expects a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension K={k}")
    if min_zero not in (0, 1):
        raise ValueError(f"min_zero must be 0 or 1, got {min_zero}")
    w = weight.float().reshape(n, k // group_size, group_size)
    if symmetric:
        absmax = w.abs().amax(dim=-1)
        scales = (2 * absmax / INT4_MAX).clamp(min=_MIN_SCALE).to(torch.float16)
        zeros = torch.full_like(absmax, (INT4_MAX + 1) // 2)
    else:
        low = w.amin(dim=-1).clamp(max=0)
        high = w.amax(dim=-1).clamp(min=0)
        if min_zero:
            # -low / scale >= 15 / 29 > 1/2, so round() gives at least 1 (fp16 rounding included)
            low = torch.minimum(low, -high / 28)
        scales = ((high - low) / INT4_MAX).clamp(min=_MIN_SCALE).to(torch.float16)
        zeros = torch.round(-low / scales.float()).clamp(min_zero, INT4_MAX)
    values = (torch.round(w / scales.float()[..., None]) + zeros[..., None]).clamp(0, INT4_MAX)
    return Int4Groups(
        values=values.reshape(n, k).to(torch.int32), zeros=zeros.to(torch.int32), scales=scales, group_size=group_size
    )


# ---------------------------------------------------------------- 4-bit packing


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**32)`` → the int32 tensors with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` integers in 0..15 → ``int32 [R, C / 8]`` in AutoAWQ's ``gemm`` order."""
    rows, cols = values.shape
    if cols % NIBBLES_PER_WORD:
        raise ValueError(f"AWQ packs along a dimension of {cols}, not a multiple of 8")
    grouped = values.to(torch.int64).reshape(rows, cols // NIBBLES_PER_WORD, NIBBLES_PER_WORD)
    words = torch.zeros(rows, cols // NIBBLES_PER_WORD, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        words |= grouped[:, :, column] << (4 * nibble)
    return _to_int32_words(words)


def pack_gptq_rows(values: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` in 0..15 → ``int32 [R / 8, C]``: word ``[r, c]`` holds rows ``8 r + j`` in
    bits ``4 j``, GPTQ's ``qweight``."""
    rows, cols = values.shape
    if rows % NIBBLES_PER_WORD:
        raise ValueError(f"GPTQ packs along a dimension of {rows}, not a multiple of 8")
    grouped = values.to(torch.int64).reshape(rows // NIBBLES_PER_WORD, NIBBLES_PER_WORD, cols)
    words = torch.zeros(rows // NIBBLES_PER_WORD, cols, dtype=torch.int64)
    for j in range(NIBBLES_PER_WORD):
        words |= grouped[:, j, :] << (4 * j)
    return _to_int32_words(words)


def pack_gptq_cols(values: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` in 0..15 → ``int32 [R, C / 8]``, columns ``8 c + j`` in bits ``4 j``
    (GPTQ's ``qzeros``)."""
    return pack_gptq_rows(values.t()).t().contiguous()


# ---------------------------------------------------------------- checkpoint I/O


def read_dense(dense_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the dense checkpoint (single file or sharded with an index)."""
    index = dense_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        files = [dense_dir / name for name in names]
    elif (dense_dir / WEIGHTS_FILE).is_file():
        files = [dense_dir / WEIGHTS_FILE]
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or model.safetensors.index.json in {dense_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name] = handle.get_tensor(name)
    return tensors


def quantized_linear_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Modules the tools quantize: every 2-D ``*.weight`` under ``model.layers``."""
    return sorted(
        name.removesuffix(".weight")
        for name, t in tensors.items()
        if name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
    )


def _load_config(dense_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((dense_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("quantization_config") is not None:
        raise ValueError(f"{dense_dir} is already quantized ({config['quantization_config']})")
    return config


def _set_dtype(config: dict[str, Any], dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    keys = [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]
    for key in keys:
        config[key] = name


@contextlib.contextmanager
def _publishing(out_dir: Path) -> Iterator[Path]:
    """A staging directory that becomes ``out_dir`` only if the body succeeds."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        yield staging
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _copy_side_files(dense_dir: Path, out: Path) -> None:
    """Tokenizer, generation config and the like: everything but weights, config and dotfiles."""
    for path in dense_dir.iterdir():
        if (
            path.is_file()
            and not path.name.startswith(".")
            and path.name != "config.json"
            and path.name not in _WEIGHT_FILES
            and path.suffix != ".safetensors"
        ):
            shutil.copy2(path, out / path.name)


def _write_checkpoint(*, out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(
        {name: t.contiguous() for name, t in sorted(tensors.items())},
        str(out / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )


# ---------------------------------------------------------------- AWQ and GPTQ


def _per_linear_checkpoint(
    *,
    dense_dir: Path,
    out_dir: Path,
    quantization_config: dict[str, Any],
    encode: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    dense_dtype: torch.dtype | None = torch.float16,
) -> Path:
    """Every quantizable linear's weight replaced by ``encode(module, weight)``'s tensors; the
    other float tensors cast to ``dense_dtype`` (None: kept) as the tool writes them."""
    config = _load_config(dense_dir)
    dense = read_dense(dense_dir)
    linears = set(quantized_linear_names(dense))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in dense.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in linears:
            try:
                tensors.update(encode(module, tensor))
            except ValueError as exc:
                raise ValueError(f"{dense_dir}: {name} {tuple(tensor.shape)}: {exc}") from exc
        elif dense_dtype is not None and tensor.is_floating_point():
            tensors[name] = tensor.to(dense_dtype)
        else:
            tensors[name] = tensor
    config["quantization_config"] = quantization_config
    if dense_dtype is not None:
        _set_dtype(config, dense_dtype)
    with _publishing(out_dir) as out:
        _copy_side_files(dense_dir, out)
        _write_checkpoint(out=out, config=config, tensors=tensors)
    return out_dir


def make_awq(*, dense_dir: Path, out_dir: Path, group_size: int = 128) -> Path:
    """An AutoAWQ ``gemm`` checkpoint (4 bits, zero points), RTN-quantized."""

    def encode(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        groups = rtn_int4(weight, group_size=group_size, symmetric=False)
        return {
            f"{module}.qweight": pack_awq(groups.values.t()),
            f"{module}.qzeros": pack_awq(groups.zeros.t()),
            f"{module}.scales": groups.scales.t().contiguous(),
        }

    return _per_linear_checkpoint(
        dense_dir=dense_dir,
        out_dir=out_dir,
        encode=encode,
        quantization_config={
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        },
    )


def make_gptq(*, dense_dir: Path, out_dir: Path, group_size: int = 128, sym: bool = True) -> Path:
    """A GPTQ v1 checkpoint (4 bits, ``desc_act: false``), RTN-quantized."""

    def encode(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        groups = rtn_int4(weight, group_size=group_size, symmetric=sym, min_zero=1)
        k = weight.shape[1]
        return {
            f"{module}.qweight": pack_gptq_rows(groups.values.t()),
            f"{module}.qzeros": pack_gptq_cols(groups.zeros.t() - 1),
            f"{module}.scales": groups.scales.t().contiguous(),
            f"{module}.g_idx": torch.arange(k, dtype=torch.int32) // group_size,
        }

    return _per_linear_checkpoint(
        dense_dir=dense_dir,
        out_dir=out_dir,
        encode=encode,
        quantization_config={
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": False,
            "sym": sym,
            "static_groups": False,
            "lm_head": False,
            "checkpoint_format": "gptq",
            "meta": {"quantizer": ["splitserve_e2e.quant_checkpoints round-to-nearest"]},
        },
    )


# ---------------------------------------------------------------- AutoFP8


def fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoFP8's ``per_tensor_quantize``: fp8 weight and its float32 scale (0-dim)."""
    amax = weight.float().abs().amax().clamp(min=1e-12)
    scale = FP8_MAX / amax
    qweight = (weight.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return qweight, scale.reciprocal().float()


def make_autofp8(*, dense_dir: Path, out_dir: Path) -> Path:
    """An AutoFP8 ``quant_method: fp8`` checkpoint with dynamic activations."""

    def encode(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scale = fp8_per_tensor(weight)
        return {f"{module}.weight": qweight, f"{module}.weight_scale": scale}

    return _per_linear_checkpoint(
        dense_dir=dense_dir,
        out_dir=out_dir,
        encode=encode,
        dense_dtype=None,
        quantization_config={
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "ignored_layers": list(UNQUANTIZED_MODULES),
        },
    )


# ---------------------------------------------------------------- compressed-tensors


def _ct_scheme(scheme: str) -> Any:
    """The compressed-tensors ``QuantizationScheme`` for one of :data:`CT_SCHEMES`."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    if scheme not in CT_SCHEMES:
        raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; choose one of {CT_SCHEMES}")
    if scheme == "W8A16":  # the W8A8 preset's per-channel int8 weights, no activation quantization
        return QuantizationScheme(targets=["Linear"], weights=preset_name_to_scheme("W8A8", ["Linear"]).weights)
    return preset_name_to_scheme(scheme, ["Linear"])


def make_compressed_tensors(*, dense_dir: Path, out_dir: Path, scheme: str) -> Path:
    """A compressed-tensors checkpoint of ``scheme`` (see :data:`CT_SCHEMES`), written by the
    ``compressed-tensors`` library."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    quant_scheme = _ct_scheme(scheme)
    config = _load_config(dense_dir)
    source_names = set(read_dense(dense_dir))
    model = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype="auto")
    apply_quantization_config(
        model,
        QuantizationConfig(
            config_groups={"group_0": quant_scheme},
            ignore=list(UNQUANTIZED_MODULES),
            quantization_status=QuantizationStatus.INITIALIZED,
        ),
        show_progress=False,
    )
    quantized: list[str] = []
    with torch.no_grad():
        for module_name, module in model.named_modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            if args.strategy != "channel":
                raise ValueError(f"{scheme}: only per-channel weight scales are supported, got {args.strategy}")
            weight = module.weight
            scale, zero_point = calculate_qparams(
                weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True), args
            )
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
            module.quantization_status = QuantizationStatus.FROZEN
            quantized.append(module_name)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    quantized_set = set(quantized)
    expected_plain = {n for n in source_names if n.removesuffix(".weight") not in quantized_set}
    plain = {n for n in state if n.rsplit(".", 1)[0] not in quantized_set}
    if plain != expected_plain:
        raise RuntimeError(
            f"compressed model's unquantized tensors differ from {dense_dir}'s: {sorted(plain ^ expected_plain)[:5]}"
        )
    tensors = {name: t.detach().clone() for name, t in state.items()}
    with _publishing(out_dir) as out:
        _copy_side_files(dense_dir, out)
        _write_checkpoint(out=out, config=config, tensors=tensors)
        compressor.update_config(str(out))  # adds the library's quantization_config
    return out_dir


# ---------------------------------------------------------------- registry and CLI


MAKERS: Final[dict[str, Callable[[Path, Path], Path]]] = {
    "ct-fp8": lambda d, o: make_compressed_tensors(dense_dir=d, out_dir=o, scheme="FP8_DYNAMIC"),
    "ct-int8": lambda d, o: make_compressed_tensors(dense_dir=d, out_dir=o, scheme="W8A8"),
    "ct-w8a16": lambda d, o: make_compressed_tensors(dense_dir=d, out_dir=o, scheme="W8A16"),
    "autofp8": lambda d, o: make_autofp8(dense_dir=d, out_dir=o),
    "awq-g128": lambda d, o: make_awq(dense_dir=d, out_dir=o, group_size=128),
    "awq-g64": lambda d, o: make_awq(dense_dir=d, out_dir=o, group_size=64),
    "awq-g32": lambda d, o: make_awq(dense_dir=d, out_dir=o, group_size=32),
    "gptq-sym-g128": lambda d, o: make_gptq(dense_dir=d, out_dir=o, group_size=128, sym=True),
    "gptq-asym-g128": lambda d, o: make_gptq(dense_dir=d, out_dir=o, group_size=128, sym=False),
    "gptq-sym-g64": lambda d, o: make_gptq(dense_dir=d, out_dir=o, group_size=64, sym=True),
    "gptq-asym-g64": lambda d, o: make_gptq(dense_dir=d, out_dir=o, group_size=64, sym=False),
}
"""Checkpoint kinds by name (the bench's and the command line's vocabulary)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve_e2e.quant_checkpoints",
        description="Write a pre-quantized HF checkpoint (compressed-tensors, AutoFP8, AWQ, GPTQ) from a dense one.",
    )
    parser.add_argument("method", choices=sorted(MAKERS))
    parser.add_argument("dense_dir", type=Path)
    parser.add_argument("out_dir", type=Path, help="created; must not exist or be empty")
    args = parser.parse_args(argv)
    try:
        print(MAKERS[args.method](args.dense_dir, args.out_dir))
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
