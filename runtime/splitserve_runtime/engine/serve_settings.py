"""What ``ServeArgs`` resolve to before a model loads: device, dtype, and the engine's
tokenizer-side arguments.

Why a module of its own: rank 0 of a single-process engine (:mod:`.loading`), the parallel
driver (:mod:`.parallel.driver`) and every worker rank (:mod:`.parallel.worker`) resolve them
the same way. With them in :mod:`.loading`, which starts the parallel driver, the driver and
the workers imported their own starter back (an import circle held apart by imports inside
functions).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from splitserve_contract import ENV_MODEL_CACHE, ServeArgs
from splitserve_contract.model_config import ModelConfig

from ..model.tokenizer import IncrementalDetokenizer, Tokenizer
from .speculative import SpeculativeConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"unknown device {name!r}; choose auto, cuda or cpu")
    return torch.device(name)


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, *, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """``auto``: float32 on CPU; on CUDA the checkpoint's 16-bit dtype, else bfloat16."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    if config_dtype in ("bfloat16", "float16"):
        return _DTYPES[config_dtype]
    return torch.bfloat16


def text_settings(args: ServeArgs, *, model_dir: Path, model_config: ModelConfig) -> dict[str, Any]:
    """The engine's tokenizer-side arguments: tokenizer, detokenizer factory, end-of-sequence
    ids, served name and the speculative-decoding settings."""
    tokenizer = Tokenizer.from_dir(model_dir=model_dir)

    def detokenizer(prompt_token_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tokenizer=tokenizer, context_token_ids=prompt_token_ids)

    return {
        "eos_token_ids": set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids),
        "detokenizer_factory": detokenizer,
        "tokenizer": tokenizer,
        "model_name": args.served_model_name or args.model,
        "speculative": SpeculativeConfig(
            method=args.speculative_method,
            num_tokens=args.num_speculative_tokens,
            max_num_seqs=args.speculative_max_num_seqs,
        ),
    }


def model_cache_dir() -> Path | None:
    """The model cache directory of ``ENV_MODEL_CACHE``; None when it is not set."""
    value = os.environ.get(ENV_MODEL_CACHE)
    return Path(value) if value else None
