"""A bounded worker pool for the CPU-heavy part of reading a prompt, off the event loop.

Tokenizing costs about 1 s per MB of text and a chat template renders in Python. Done on the
event loop, one large prompt stalled every stream and ``/health`` with it (a liveness probe
would have restarted the pod). Here that work runs on a few threads instead: the Rust tokenizer
releases the GIL while it encodes (:meth:`~splitserve_runtime.model.tokenizer.Tokenizer.encode`),
so the loop keeps answering meanwhile. Small inputs run inline: a thread hop would cost more
than the work, and a short request never queues behind a long one.

The pool is bounded twice: a fixed number of threads, and a fixed number of jobs waiting for
one. Past that a request is answered 429 with ``Retry-After`` at once, as the engine does when
its own queue is full, instead of piling up behind prompts nobody will wait for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from splitserve_runtime.server.errors import RATE_LIMIT, APIError

T = TypeVar("T")

DEFAULT_MAX_WORKERS = 2
"""Threads; the engine's own thread needs a core too."""
DEFAULT_MAX_WAITING = 64
"""Jobs queued for a thread before the next one is refused with a 429."""
INLINE_CHARS = 16_384
"""Inputs up to this many characters are handled on the loop (well under a millisecond)."""


class PromptWorkers:
    """``await workers.run(fn, size_chars=n)``: ``fn()`` inline when small, else on a thread."""

    def __init__(
        self,
        *,
        max_workers: int = DEFAULT_MAX_WORKERS,
        max_waiting: int = DEFAULT_MAX_WAITING,
        inline_chars: int = INLINE_CHARS,
    ) -> None:
        if max_workers < 1 or max_waiting < 0 or inline_chars < 0:
            raise ValueError("max_workers must be >= 1, max_waiting and inline_chars >= 0")
        self.max_workers = max_workers
        self.max_waiting = max_waiting
        self.inline_chars = inline_chars
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="splitserve-prompt")
        # released from the worker thread when a job ends, so a thread-safe count
        self._slots = threading.BoundedSemaphore(max_workers + max_waiting)
        self._num_jobs = 0
        self._lock = threading.Lock()

    @property
    def num_jobs(self) -> int:
        """Jobs running or waiting for a thread."""
        with self._lock:
            return self._num_jobs

    async def run(self, fn: Callable[[], T], *, size_chars: int) -> T:
        """The result of ``fn()``; exceptions (an APIError for a bad prompt) propagate.
        Cancelling the caller drops a job that has not started; a running one finishes
        and is still counted until then."""
        if size_chars <= self.inline_chars:
            return fn()
        if not self._slots.acquire(blocking=False):
            raise APIError(
                status_code=429,
                type=RATE_LIMIT,
                code="rate_limit_exceeded",
                message=f"{self.max_waiting} prompts are already waiting to be tokenized; retry shortly",
                headers={"Retry-After": "1"},
            )
        with self._lock:
            self._num_jobs += 1
        try:
            future = self._executor.submit(fn)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def _release(self, _future: Future[Any] | None) -> None:
        with self._lock:
            self._num_jobs -= 1
        self._slots.release()

    def shutdown(self) -> None:
        """Drop queued jobs; running ones finish on their threads (they cannot be stopped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
