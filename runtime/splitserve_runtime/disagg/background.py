"""The handoff's background tasks: releases and unpins that must finish after their caller.

A KV release (tell the prefill pod to unpin, or unpin here) often starts where the caller can
no longer wait for it: a cancelled request, a generator's ``finally``, the engine thread. Such
a task is held here until it ends, and its outcome is always retrieved: a release that meets a
stopped engine (shutdown) is expected and logged at DEBUG, anything else is a WARNING, never
asyncio's "Task exception was never retrieved" at garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from ..engine.errors import EngineDead

log = logging.getLogger(__name__)


class BackgroundTasks:
    """The running background tasks of one handoff engine (event loop thread only)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, EngineDead):
            log.debug("background KV task skipped, the engine is stopped: %s", exc)
        elif exc is not None:
            log.warning("background KV task failed: %r", exc)
