"""Does a prompt fit the context window? Asked twice: from its length, then from its tokens.

The first check needs no tokenizing: when a token covers at most ``max_chars_per_token``
characters (a sound bound for byte-level BPE, see
:func:`splitserve_runtime.model.tokenizer.max_chars_per_token`), a text of ``n`` characters is
at least ``ceil(n / max_chars_per_token)`` tokens, and a prompt that long cannot fit, so a
multi-megabyte prompt is refused at once instead of after seconds of tokenizing. The second
is the engine's own rule (prompt tokens + max_tokens <= max_model_len, max_tokens defaulting
to the room left), applied as soon as the tokens are known, so an oversized token list never
travels further. Both answer the same 400 ``context_length_exceeded``.
"""

from __future__ import annotations

from splitserve_runtime.engine.errors import ContextLengthExceeded
from splitserve_runtime.server.errors import APIError, bad_request, from_engine_error


def resolve_max_tokens(*, requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The client's max_tokens, or (when absent) whatever room the context leaves."""
    if requested is not None:
        return requested
    return max(1, max_model_len - num_prompt_tokens)


def min_prompt_tokens(*, num_chars: int, max_chars_per_token: int | None) -> int:
    """The fewest tokens a text of ``num_chars`` characters can be (0 when unknown)."""
    if not max_chars_per_token:
        return 0
    return -(-num_chars // max_chars_per_token)


def check_length_can_fit(
    *, num_chars: int, max_chars_per_token: int | None, requested_max_tokens: int | None, max_model_len: int, param: str
) -> None:
    """Raise the 400 when a text of ``num_chars`` characters cannot fit, whatever its tokens."""
    at_least = min_prompt_tokens(num_chars=num_chars, max_chars_per_token=max_chars_per_token)
    completion = requested_max_tokens if requested_max_tokens is not None else 1
    if at_least + completion > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"alone is at least {at_least} tokens ({num_chars} characters, and one token "
            f"covers at most {max_chars_per_token}), plus {completion} for the completion; "
            "shorten the prompt or lower max_tokens",
            param=param,
            code="context_length_exceeded",
        )


def max_prompt_tokens(*, requested_max_tokens: int | None, max_model_len: int) -> int:
    """The longest prompt that fits: with max_tokens absent, the completion needs one token."""
    return max_model_len - (requested_max_tokens if requested_max_tokens is not None else 1)


def context_exceeded(
    *, num_prompt_tokens: int, requested_max_tokens: int | None, max_model_len: int, param: str
) -> APIError:
    """The engine's 400 for a prompt of ``num_prompt_tokens`` that does not fit."""
    max_tokens = resolve_max_tokens(
        requested=requested_max_tokens, num_prompt_tokens=num_prompt_tokens, max_model_len=max_model_len
    )
    return from_engine_error(
        ContextLengthExceeded(num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, max_model_len=max_model_len),
        prompt_param=param,
    )


def check_tokens_fit(
    *, num_prompt_tokens: int, requested_max_tokens: int | None, max_model_len: int, param: str
) -> None:
    """Raise the engine's 400 when the prompt's tokens and the completion do not fit."""
    if num_prompt_tokens > max_prompt_tokens(requested_max_tokens=requested_max_tokens, max_model_len=max_model_len):
        raise context_exceeded(
            num_prompt_tokens=num_prompt_tokens,
            requested_max_tokens=requested_max_tokens,
            max_model_len=max_model_len,
            param=param,
        )
