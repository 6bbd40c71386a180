"""Decode role: imports waiting for KV blocks or a batch slot, woken by the engine thread.

A decode request whose prompt KV arrives from a prefill pod first reserves the blocks it will
be pulled into (``LLMEngine.reserve_imported_request``). A full KV cache or batch is usually
momentary (running requests finish), so a reservation that finds no room waits a bounded time
(:data:`IMPORT_WAIT_SECONDS`) rather than answering 429 at once; the prefill pod holds the KV
under a longer lease meanwhile. Why a queue and not polling: room appears only when the engine
thread does something (a step that finishes a request, an abort, a release), so the waiting
reservations are retried right there, on the engine thread after every engine loop iteration
(``AsyncEngine.add_iteration_hook``), and the one that succeeds (or fails) wakes its waiter
through its event loop (``call_soon_threadsafe``). An idle pod retries nothing and a waiter
never asks the engine thread in vain.

A reservation is decided under the entry's lock, so a waiter that gives up (its bound ran out,
or its client left) either withdraws it before the engine thread tries again or takes the
reservation that was just made; none is left behind unseen.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..engine.async_engine import AsyncEngine
from ..engine.llm_engine import LLMEngine

IMPORT_WAIT_SECONDS = 10.0
"""How long an imported prompt waits for KV blocks or a batch slot before 429 (well inside the
prefill pod's KV lease, --kv-ttl-seconds, 30 s by default)."""

R = TypeVar("R")


@dataclass(eq=False)
class _Waiting(Generic[R]):
    """One waiting reservation: ``attempt`` returns None while there is no room."""

    attempt: Callable[[LLMEngine], R]
    loop: asyncio.AbstractEventLoop
    woken: asyncio.Event
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    result: R | None = None
    error: BaseException | None = None

    def try_once(self, core: LLMEngine) -> bool:
        """Engine thread: one attempt; True once the entry is settled (made, failed or withdrawn)."""
        with self.lock:
            if self.done:
                return True
            try:
                self.result = self.attempt(core)
            except Exception as exc:  # the waiter raises it
                self.error = exc
            if self.result is None and self.error is None:
                return False
            self.done = True
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.woken.set)
        return True

    def withdraw(self) -> None:
        """Event loop: stop waiting; a reservation made meanwhile stays in ``result``."""
        with self.lock:
            self.done = True


class PendingImports:
    """The decode engine's queue of reservations waiting for room."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._waiting: list[_Waiting[Any]] = []
        """Engine thread only (entries are added by the first attempt, which runs there)."""
        engine.add_iteration_hook(self._retry)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _retry(self, core: LLMEngine) -> None:
        if self._waiting:
            self._waiting = [entry for entry in self._waiting if not entry.try_once(core)]

    async def reserve(
        self, attempt: Callable[[LLMEngine], R], *, wait_seconds: float = IMPORT_WAIT_SECONDS
    ) -> R | None:
        """``attempt``'s result, from the first engine-thread attempt that has room within
        ``wait_seconds``; None when none had. ``attempt``'s exceptions propagate. A caller
        cancelled meanwhile must abort what the attempt reserves (its request id)."""
        entry: _Waiting[R] = _Waiting(attempt=attempt, loop=asyncio.get_running_loop(), woken=asyncio.Event())

        def first(core: LLMEngine) -> bool:
            if entry.try_once(core):
                return True
            self._waiting.append(entry)
            return False

        try:
            if not await self._engine.call(first):
                async with asyncio.timeout(wait_seconds):
                    await entry.woken.wait()
        except TimeoutError:
            pass
        finally:
            entry.withdraw()
        if entry.error is not None:
            raise entry.error
        return entry.result
