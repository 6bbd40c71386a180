"""Admission: whether a request can be served by an engine of these sizes, checked before it
is queued; and the warning at start-up when the KV cache cannot hold one full-length sequence.

Why a module of its own: the checks read only fixed sizes (vocabulary, ``max_model_len``, the
KV pool), so the server runs them on its own thread before a request reaches the engine loop
(``LLMEngine.check_request``), and each refusal is an error type the server maps to a 400
(:mod:`.errors`).
"""

from __future__ import annotations

import logging

from .block_manager import BlockManager
from .errors import ContextLengthExceeded, PromptExceedsKVCapacity, RequestExceedsKVCapacity
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


def check_request(
    *,
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    has_tokenizer: bool,
    block_manager: BlockManager,
) -> None:
    """Raise if the request is malformed or can never fit (``has_tokenizer``: stop strings work)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("the prompt must contain at least one token")
    if not all(type(t) is int for t in prompt_token_ids):
        bad = next(t for t in prompt_token_ids if type(t) is not int)
        raise ValueError(f"prompt token ids must be integers, got {bad!r}")
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad_id = low if low < 0 else high
        raise ValueError(f"prompt token id {bad_id} is outside the vocabulary [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer, and this engine has none")
    if num_prompt + params.max_tokens > max_model_len:
        raise ContextLengthExceeded(
            num_prompt_tokens=num_prompt, max_tokens=params.max_tokens, max_model_len=max_model_len
        )
    bm = block_manager
    needed = bm.num_blocks_for(num_prompt)
    if needed > bm.num_blocks:
        raise PromptExceedsKVCapacity(
            num_prompt_tokens=num_prompt,
            num_blocks_needed=needed,
            num_blocks_total=bm.num_blocks,
            block_size=bm.block_size,
        )
    # the whole request must fit too, or it could only be cut short once the cache ran out
    needed = bm.num_blocks_for(num_prompt + params.max_tokens - 1)
    if needed > bm.num_blocks:
        raise RequestExceedsKVCapacity(
            num_prompt_tokens=num_prompt,
            max_tokens=params.max_tokens,
            num_blocks_needed=needed,
            num_blocks_total=bm.num_blocks,
            block_size=bm.block_size,
        )


def warn_if_kv_cache_short(*, num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Log what to change when the KV cache holds less than one ``max_model_len`` sequence."""
    capacity_tokens = num_blocks * block_size
    if capacity_tokens < max_model_len - 1:
        # vLLM refuses to start here; this runtime serves on (requests that do not fit are
        # refused at admission, RequestExceedsKVCapacity) but says what to change
        log.warning(
            "the KV cache holds %d tokens (%d blocks of %d), less than one sequence of "
            "max_model_len %d tokens: requests whose prompt + max_tokens exceed the cache are "
            "refused with a 400; lower --max-model-len to %d or give the cache more room "
            "(--num-kv-blocks, --kv-memory-fraction, a larger device)",
            capacity_tokens,
            num_blocks,
            block_size,
            max_model_len,
            capacity_tokens + 1,
        )
