"""Building an engine from ``ServeArgs``: model URI, config, tokenizer, weights, device, dtype.

Kept apart from :mod:`.llm_engine` so the engine core never imports the model package; only
this module knows how a model directory becomes a :class:`~.model_runner.CausalLM`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from splitserve_contract import ENV_MODEL_CACHE, ServeArgs, unsupported_serve_settings
from splitserve_contract.capabilities import UnsupportedError
from splitserve_contract.model_config import ModelConfig

from .config import EngineConfig
from .kv_budget import KVCacheSpec, resolve_kv_cache_dtype
from .llm_engine import LLMEngine
from .speculative import SpeculativeConfig

if TYPE_CHECKING:
    from ..model.llama import LlamaForCausalLM
    from ..ops import Ops

log = logging.getLogger(__name__)


def engine_from_args(args: ServeArgs) -> LLMEngine:
    """Resolve the model URI and build model, tokenizer and engine from ``args``."""
    from splitserve_contract.model_config import load_model_config

    from ..model.loader import load_model
    from ..model.uri import resolve_model_uri
    from ..ops import get_ops

    refused = unsupported_serve_settings(args)
    if refused:
        raise UnsupportedError("; ".join(refused))
    device = resolve_device(args.device)
    model_dir = resolve_model_uri(args.model, cache_dir=_model_cache_dir(), revision=args.revision)
    model_config = load_model_config(model_dir=model_dir)
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        from .parallel.driver import parallel_engine

        return parallel_engine(args, model_dir=model_dir, model_config=model_config, device=device)
    dtype = resolve_dtype(args.dtype, device=device, config_dtype=model_config.torch_dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype=dtype, device=device)
    max_model_len = model_config.resolve_max_model_len(requested_tokens=args.max_model_len)
    if not args.chunked_prefill and args.max_num_batched_tokens < max_model_len:
        log.warning("chunked prefill is off: max_model_len lowered from %d to "
                    "max_num_batched_tokens=%d", max_model_len, args.max_num_batched_tokens)
        max_model_len = args.max_num_batched_tokens
    ops = get_ops(name=args.attention_backend, device=device)
    model = load_model(model_dir=model_dir, ops=ops, dtype=dtype, device=device,
                       config=model_config, quantization=args.quantization)
    spec = KVCacheSpec(num_layers=model_config.num_hidden_layers,
                       num_kv_heads=model_config.num_key_value_heads,
                       head_dim=model_config.head_dim, dtype=kv_dtype)
    draft_model, draft_spec = _load_draft(args, ops=ops, dtype=dtype, kv_dtype=kv_dtype, device=device,
                                          vocab_size=model_config.vocab_size)
    return LLMEngine(model=model, kv_spec=spec, vocab_size=model_config.vocab_size,
                     config=EngineConfig.from_serve_args(args, max_model_len=max_model_len),
                     device=device, **text_settings(args, model_dir=model_dir, model_config=model_config),
                     draft_model=draft_model, draft_kv_spec=draft_spec)


def text_settings(args: ServeArgs, *, model_dir: Path, model_config: ModelConfig) -> dict[str, Any]:
    """The engine's tokenizer-side arguments: tokenizer, detokenizer factory, end-of-sequence
    ids, served name and the speculative-decoding settings."""
    from ..model.tokenizer import IncrementalDetokenizer, Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir=model_dir)

    def detokenizer(prompt_token_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tokenizer=tokenizer, context_token_ids=prompt_token_ids)

    return {"eos_token_ids": set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids),
            "detokenizer_factory": detokenizer, "tokenizer": tokenizer,
            "model_name": args.served_model_name or args.model,
            "speculative": SpeculativeConfig(method=args.speculative_method, num_tokens=args.num_speculative_tokens,
                                             max_num_seqs=args.speculative_max_num_seqs)}


def _load_draft(args: ServeArgs, *, ops: Ops, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                vocab_size: int) -> tuple[LlamaForCausalLM | None, KVCacheSpec | None]:
    """The draft model of ``--speculative-method draft`` (dense, the target's dtypes), checked
    to share the target's vocabulary; (None, None) otherwise."""
    from splitserve_contract.model_config import ModelLoadError, load_model_config

    from ..model.loader import load_model
    from ..model.uri import resolve_model_uri

    if args.speculative_method != "draft":
        if args.speculative_draft_model:
            raise ValueError("--speculative-draft-model is only used with --speculative-method draft")
        return None, None
    if not args.speculative_draft_model:
        raise ValueError("--speculative-method draft needs --speculative-draft-model")
    draft_dir = resolve_model_uri(args.speculative_draft_model, cache_dir=_model_cache_dir())
    config = load_model_config(model_dir=draft_dir)
    if config.vocab_size != vocab_size:
        raise ModelLoadError(f"draft model {args.speculative_draft_model!r} has a vocabulary of "
                             f"{config.vocab_size} tokens, the model {vocab_size}: they must share one")
    model = load_model(model_dir=draft_dir, ops=ops, dtype=dtype, device=device, config=config)
    log.info("speculative draft model %s: %d layers", args.speculative_draft_model, config.num_hidden_layers)
    return model, KVCacheSpec(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                              head_dim=config.head_dim, dtype=kv_dtype)


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


def _model_cache_dir() -> Path | None:
    value = os.environ.get(ENV_MODEL_CACHE)
    return Path(value) if value else None
