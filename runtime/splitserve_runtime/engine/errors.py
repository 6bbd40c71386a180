"""Typed errors the engine raises at admission, so the server can map each to one HTTP status.

Everything here is raised *before* a request enters the scheduler: a request that fails
admission never holds KV blocks. The server maps ``ValueError`` (bad sampling parameters)
and :class:`ContextLengthExceeded` / :class:`PromptExceedsKVCapacity` /
:class:`RequestExceedsKVCapacity` to 400,
:class:`QueueFull` to 429 with ``Retry-After`` and :class:`EngineDead` to 503.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's admission errors."""


class ContextLengthExceeded(EngineError, ValueError):
    """``prompt tokens + max_tokens`` does not fit in the model's context window."""

    def __init__(self, *, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens, but the request "
            f"asks for {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion); shorten the prompt or lower max_tokens"
        )


class PromptExceedsKVCapacity(EngineError, ValueError):
    """The prompt alone needs more KV blocks than the whole cache holds."""

    def __init__(
        self, *, num_prompt_tokens: int, num_blocks_needed: int, num_blocks_total: int, block_size: int
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks_total = num_blocks_total
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens and needs {num_blocks_needed} KV blocks "
            f"of {block_size} tokens, but this server's KV cache has only {num_blocks_total} "
            f"blocks ({num_blocks_total * block_size} tokens)"
        )


class RequestExceedsKVCapacity(EngineError, ValueError):
    """The prompt fits, but ``prompt + max_tokens`` needs more KV blocks than the whole cache
    holds: admitted, it could only be cut short (``length``) once the cache ran out. A request
    of ``n`` tokens keeps ``n - 1`` of them in the cache (the last sampled token is never fed
    back), so that is what is counted."""

    def __init__(
        self, *, num_prompt_tokens: int, max_tokens: int, num_blocks_needed: int, num_blocks_total: int, block_size: int
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks_total = num_blocks_total
        capacity = num_blocks_total * block_size
        super().__init__(
            f"the request's {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion) need {num_blocks_needed} KV blocks of "
            f"{block_size} tokens, which exceeds the KV cache capacity of this server: "
            f"{num_blocks_total} blocks ({capacity} tokens); lower max_tokens to at most "
            f"{max(capacity + 1 - num_prompt_tokens, 0)} or shorten the prompt"
        )


class QueueFull(EngineError):
    """Too many requests are waiting; try again after ``retry_after_seconds``."""

    def __init__(self, *, num_waiting: int, max_queue_len: int, retry_after_seconds: float, reason: str = "") -> None:
        self.num_waiting = num_waiting
        self.max_queue_len = max_queue_len
        self.retry_after_seconds = retry_after_seconds
        why = reason or f"{num_waiting} requests are waiting (limit {max_queue_len})"
        super().__init__(f"the server is overloaded: {why}; retry after {retry_after_seconds:.0f} s")


class EngineDead(EngineError):
    """The engine loop has stopped (fatal error or shutdown) and accepts no requests."""


class DuplicateRequestId(EngineError, ValueError):
    """A request with this id is already in flight."""


class KVTransferFailed(EngineError):
    """Decode role: the KV of a request prefilled elsewhere could not be pulled intact
    (``code`` as :class:`~splitserve_runtime.transfer.TransferError`'s, or
    ``compat_mismatch`` / ``prompt_mismatch``). Its reserved blocks are already freed."""

    def __init__(self, *, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"KV transfer failed ({code}): {message}")


class HandoffRefused(EngineError, ValueError):
    """Decode role: handoff parameters this pod must not act on (unsigned, forged, expired,
    another pool's compat hash, or, without a handoff key, a non-loopback endpoint; see
    :mod:`splitserve_runtime.transfer.auth`). A client mistake: nothing was connected to."""

    def __init__(self, *, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)
