"""Lifecycle of one server process: loading -> ready -> draining, and in-flight accounting.

The HTTP listener starts before the model has loaded (so /health answers and /ready says
no), and keeps listening while draining after SIGTERM (so /ready says no at once while
in-flight requests finish). This object is the single place that knows which phase the
process is in; routes ask it for the engine and register each generation request with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from splitserve_runtime.server.engine_client import EngineClient
from splitserve_runtime.server.errors import unavailable


class ServerState:
    def __init__(self, *, served_model_name: str, role: str, prefill_headers: bool = False) -> None:
        self.served_model_name = served_model_name
        self.role = role
        self.prefill_headers = prefill_headers
        """Whether an endpoint picker's prefill headers are honoured (``--prefill-headers``)."""
        self._engine: EngineClient | None = None
        self._draining = False
        self._in_flight: set[str] = set()
        self._num_preparing = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.load_error: str | None = None

    # ------------------------------------------------------------------ phases
    def attach_engine(self, *, engine: EngineClient) -> None:
        """Called once the engine has loaded and started; the server becomes ready."""
        self._engine = engine

    @property
    def engine_or_none(self) -> EngineClient | None:
        return self._engine

    @property
    def is_alive(self) -> bool:
        """Liveness: the process works (still loading counts as alive)."""
        if self.load_error is not None:
            return False
        return self._engine is None or self._engine.is_healthy

    @property
    def is_ready(self) -> bool:
        return self._engine is not None and self._engine.is_healthy and not self._draining

    @property
    def is_draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Stop admitting work; safe to call from a signal handler (sets a flag only)."""
        self._draining = True

    @property
    def num_in_flight(self) -> int:
        """Generation requests, and requests whose prompt is still being read."""
        return len(self._in_flight) + self._num_preparing

    @property
    def in_flight_request_ids(self) -> list[str]:
        return sorted(self._in_flight)

    async def wait_idle(self, *, timeout_seconds: float) -> bool:
        """Wait until no generation request is in flight; False on timeout."""
        try:
            async with asyncio.timeout(timeout_seconds):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ requests
    def admit(self) -> EngineClient:
        """The engine for a new generation request, or a 503 while loading or draining."""
        if self._draining:
            raise unavailable("the server is shutting down; retry on another replica", code="draining")
        if self._engine is None:
            raise unavailable("the model is still loading", retry_after_seconds=5, code="loading")
        return self._engine

    def request_started(self, *, request_id: str) -> None:
        """Count a generation request in flight until `request_finished` (its last byte)."""
        self._in_flight.add(request_id)
        self._idle.clear()

    def request_finished(self, *, request_id: str) -> None:
        self._in_flight.discard(request_id)
        self._update_idle()

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Count a request in flight while its prompt is read (tokenizing a large one takes
        seconds off the loop), before it has an engine request id."""
        self._num_preparing += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_preparing -= 1
            self._update_idle()

    def _update_idle(self) -> None:
        if not self._in_flight and not self._num_preparing:
            self._idle.set()
