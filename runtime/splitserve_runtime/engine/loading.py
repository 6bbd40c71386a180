"""Building an engine from ``ServeArgs``: model URI, config, tokenizer, weights, device, dtype.

Kept apart from :mod:`.llm_engine` so the engine core never constructs a model itself; only
this module knows how a model directory becomes a :class:`~.step_inputs.CausalLM`. The engine
class is passed in (``LLMEngine.from_args`` passes itself), so this module and the parallel
driver it starts never import the engine core back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from splitserve_contract import ServeArgs, unsupported_serve_settings
from splitserve_contract.capabilities import UnsupportedError
from splitserve_contract.model_config import ModelLoadError, load_model_config

from ..model.llama import LlamaForCausalLM
from ..model.loader import load_model
from ..model.uri import resolve_model_uri
from ..ops import Ops, get_ops
from .config import EngineConfig
from .kv_budget import KVCacheSpec, resolve_kv_cache_dtype
from .parallel.driver import parallel_engine
from .serve_settings import model_cache_dir, resolve_device, resolve_dtype, text_settings

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger(__name__)


def engine_from_args(args: ServeArgs, *, engine_class: Callable[..., LLMEngine]) -> LLMEngine:
    """Resolve the model URI and build model, tokenizer and an ``engine_class`` from ``args``."""
    refused = unsupported_serve_settings(args)
    if refused:
        raise UnsupportedError("; ".join(refused))
    device = resolve_device(args.device)
    model_dir = resolve_model_uri(args.model, cache_dir=model_cache_dir(), revision=args.revision)
    model_config = load_model_config(model_dir=model_dir)
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        return parallel_engine(
            args, model_dir=model_dir, model_config=model_config, device=device, engine_class=engine_class
        )
    dtype = resolve_dtype(args.dtype, device=device, config_dtype=model_config.torch_dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype=dtype, device=device)
    max_model_len = model_config.resolve_max_model_len(requested_tokens=args.max_model_len)
    if not args.chunked_prefill and args.max_num_batched_tokens < max_model_len:
        log.warning(
            "chunked prefill is off: max_model_len lowered from %d to max_num_batched_tokens=%d",
            max_model_len,
            args.max_num_batched_tokens,
        )
        max_model_len = args.max_num_batched_tokens
    ops = get_ops(name=args.attention_backend, device=device)
    model = load_model(
        model_dir=model_dir, ops=ops, dtype=dtype, device=device, config=model_config, quantization=args.quantization
    )
    spec = KVCacheSpec(
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=kv_dtype,
    )
    draft_model, draft_spec = _load_draft(
        args, ops=ops, dtype=dtype, kv_dtype=kv_dtype, device=device, vocab_size=model_config.vocab_size
    )
    return engine_class(
        model=model,
        kv_spec=spec,
        vocab_size=model_config.vocab_size,
        config=EngineConfig.from_serve_args(args, max_model_len=max_model_len),
        device=device,
        **text_settings(args, model_dir=model_dir, model_config=model_config),
        draft_model=draft_model,
        draft_kv_spec=draft_spec,
    )


def _load_draft(
    args: ServeArgs, *, ops: Ops, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, vocab_size: int
) -> tuple[LlamaForCausalLM | None, KVCacheSpec | None]:
    """The draft model of ``--speculative-method draft`` (dense, the target's dtypes), checked
    to share the target's vocabulary; (None, None) otherwise."""
    if args.speculative_method != "draft":
        if args.speculative_draft_model:
            raise ValueError("--speculative-draft-model is only used with --speculative-method draft")
        return None, None
    if not args.speculative_draft_model:
        raise ValueError("--speculative-method draft needs --speculative-draft-model")
    draft_dir = resolve_model_uri(args.speculative_draft_model, cache_dir=model_cache_dir())
    config = load_model_config(model_dir=draft_dir)
    if config.vocab_size != vocab_size:
        raise ModelLoadError(
            f"draft model {args.speculative_draft_model!r} has a vocabulary of "
            f"{config.vocab_size} tokens, the model {vocab_size}: they must share one"
        )
    model = load_model(model_dir=draft_dir, ops=ops, dtype=dtype, device=device, config=config)
    log.info("speculative draft model %s: %d layers", args.speculative_draft_model, config.num_hidden_layers)
    return model, KVCacheSpec(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=kv_dtype,
    )
