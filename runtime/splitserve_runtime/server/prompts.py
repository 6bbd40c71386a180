"""Client input -> prompt token ids, failing fast and off the event loop (a large prompt must
not stall ``/health`` and the other streams).

Both endpoints read their prompt here, in the same order:
1. a prompt that cannot fit the context by its length alone is refused before any work
   (:func:`.prompt_length.check_length_can_fit`);
2. the text is checked (a lone surrogate is a 400), the chat template rendered and the text
   tokenized on :class:`.prompt_workers.PromptWorkers` when it is large, so ``/health``,
   ``/metrics`` and every running stream keep being served meanwhile;
3. the token count is checked against the context (:func:`.prompt_length.check_tokens_fit`),
   so an oversized prompt never reaches the engine (nor becomes a list of millions of ints).
Every refusal is an APIError (400, or 429 when the pool is full); the admission refusals (the
context checks and a full pool) count as outcome "rejected", as the engine's own do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from splitserve_runtime.server.engine_client import EngineClient
from splitserve_runtime.server.errors import APIError, bad_request, check_text
from splitserve_runtime.server.metrics import ServerMetrics
from splitserve_runtime.server.prompt_length import (
    check_length_can_fit,
    check_tokens_fit,
    context_exceeded,
    max_prompt_tokens,
)
from splitserve_runtime.server.prompt_workers import PromptWorkers

T = TypeVar("T")

ADMISSION_CODES = frozenset({"context_length_exceeded", "rate_limit_exceeded"})
"""Refusals counted as outcome "rejected" (a malformed text is not)."""


class PromptReader:
    def __init__(self, *, workers: PromptWorkers, metrics: ServerMetrics) -> None:
        self._workers = workers
        self._metrics = metrics

    def token_ids(
        self, *, engine: EngineClient, token_ids: list[int], requested_max_tokens: int | None, param: str
    ) -> list[int]:
        """A prompt the client sent as token ids: only the context check."""
        with self._counting_refusals():
            check_tokens_fit(
                num_prompt_tokens=len(token_ids),
                requested_max_tokens=requested_max_tokens,
                max_model_len=engine.max_model_len,
                param=param,
            )
        return token_ids

    async def text(self, *, engine: EngineClient, text: str, requested_max_tokens: int | None, param: str) -> list[int]:
        """A text prompt, with the tokenizer's special tokens (BOS) added."""

        def encode() -> list[int]:
            check_text(text, param=param)
            return _encode(
                engine=engine,
                text=text,
                add_special_tokens=True,
                requested_max_tokens=requested_max_tokens,
                param=param,
            )

        async def read() -> list[int]:
            check_length_can_fit(
                num_chars=len(text),
                max_chars_per_token=engine.tokenizer.max_chars_per_token,
                requested_max_tokens=requested_max_tokens,
                max_model_len=engine.max_model_len,
                param=param,
            )
            return await self._workers.run(encode, size_chars=len(text))

        return await self._counted(read)

    async def chat(
        self,
        *,
        engine: EngineClient,
        messages: Sequence[Mapping[str, Any]],
        requested_max_tokens: int | None,
        param: str,
    ) -> list[int]:
        """Messages (``{"role", "content": str}``) rendered by the model's chat template."""
        contents = [str(message.get("content") or "") for message in messages]

        def render_and_encode() -> list[int]:
            for content in contents:
                check_text(content, param=param)
            tokenizer = engine.tokenizer
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except (ValueError, TypeError, KeyError) as exc:  # the template's raise_exception()
                raise bad_request(str(exc), param=param) from None
            # a template may drop messages, so only the rendered text bounds the tokens
            check_length_can_fit(
                num_chars=len(text),
                max_chars_per_token=tokenizer.max_chars_per_token,
                requested_max_tokens=requested_max_tokens,
                max_model_len=engine.max_model_len,
                param=param,
            )
            # the rendered template already holds the special tokens (BOS), so add none
            return _encode(
                engine=engine,
                text=text,
                add_special_tokens=False,
                requested_max_tokens=requested_max_tokens,
                param=param,
            )

        size_chars = sum(len(content) for content in contents)
        return await self._counted(lambda: self._workers.run(render_and_encode, size_chars=size_chars))

    async def _counted(self, read: Callable[[], Awaitable[T]]) -> T:
        with self._counting_refusals():
            return await read()

    @contextlib.contextmanager
    def _counting_refusals(self) -> Iterator[None]:
        """An admission refusal raised inside counts as outcome "rejected"."""
        try:
            yield
        except APIError as exc:
            if exc.code in ADMISSION_CODES:
                self._metrics.record_outcome(outcome="rejected")
            raise


def _encode(
    *, engine: EngineClient, text: str, add_special_tokens: bool, requested_max_tokens: int | None, param: str
) -> list[int]:
    """The token ids, or the context error without ever listing an oversized prompt's ids."""
    num_tokens, token_ids = engine.tokenizer.encode_bounded(
        text,
        add_special_tokens=add_special_tokens,
        max_tokens=max_prompt_tokens(requested_max_tokens=requested_max_tokens, max_model_len=engine.max_model_len),
    )
    if token_ids is None:
        raise context_exceeded(
            num_prompt_tokens=num_tokens,
            requested_max_tokens=requested_max_tokens,
            max_model_len=engine.max_model_len,
            param=param,
        )
    return token_ids
