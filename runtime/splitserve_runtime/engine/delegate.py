"""The engine surface that wrappers pass straight through.

Two wrappers sit in front of an engine: :class:`~.remote.HandoffEngine` (adds the prefill
export and decode import paths around an AsyncEngine) and the server's per-request
``RoutedEngine`` (binds ``generate`` to one request's handoff route). Both forward the same
read-only surface unchanged; it is written once here.
"""

from __future__ import annotations

from typing import Any, Protocol

from .stats import EngineStats


class ForwardedSurface(Protocol):
    """What a wrapper forwards: the tokenizer, the context limit, health, abort and stats."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_healthy(self) -> bool: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...


class DelegatingEngine:
    """Forwards :class:`ForwardedSurface` to ``self._engine``; subclasses add the rest."""

    def __init__(self, *, engine: ForwardedSurface) -> None:
        self._engine = engine

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._engine.is_healthy

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self._engine.stats()
