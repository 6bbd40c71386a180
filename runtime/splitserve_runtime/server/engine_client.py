"""The slice of the engine the HTTP layer uses, as a Protocol.

The server never imports the engine implementation (which pulls in torch) at module level:
it is typed against this Protocol, and `app.main` builds the real
:class:`splitserve_runtime.engine.async_engine.AsyncEngine` lazily. Keeping the surface this
small also documents exactly what the server relies on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.stats import EngineStats


class TokenizerLike(Protocol):
    @property
    def max_chars_per_token(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_bounded(
        self, text: str, *, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> tuple[int, list[int] | None]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str: ...


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_healthy(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
