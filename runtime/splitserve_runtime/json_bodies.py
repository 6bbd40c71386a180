"""Decoding large JSON request bodies off the event loop, for the runtime's and the router's
HTTP servers (issue 12).

``json.loads`` holds the GIL for as long as it runs, and a thread does not help: while it
decodes, nothing else in the process does. An ordinary 8 MB prompt string decodes in about
20 ms, but a crafted 8 MiB body of millions of tiny arrays took about 1 s (2.4 s on a loaded
machine), and ``/health`` waited as long. So a body over :data:`INLINE_BYTES` is decoded (and
checked) in a separate *process*, and only a bounded result comes back: the decoder refuses a
body of more than :data:`MAX_CONTAINERS` arrays and objects there, before anything is returned,
because unpickling the decoded value on the loop would cost as much as decoding it. No real
request comes near the bound (the server's own shape limits allow 4,096 messages of 4,096
content parts, and a prompt's token ids are one array).

Small bodies are decoded inline: under :data:`INLINE_BYTES` the worst case is about 30 ms, and
a process hop would cost more than the work. The pool is one process, started by ``spawn`` on
the first large body (the server runs threads, so ``fork`` is unsafe), with a bounded number of
bodies waiting for it; past that, callers get :class:`DecoderBusy` (a 429). If the process dies
(killed, out of memory), the pool is replaced and the caller gets :class:`DecoderFailed`.
Like :mod:`.body_limit`, this sits outside the runtime's layers so the server and the router
share it; what a body must decode *to* is the caller's function.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

T = TypeVar("T")

INLINE_BYTES = 256 * 1024
"""Bodies up to this size are decoded on the event loop (at most ~30 ms of tiny arrays)."""
MAX_CONTAINERS = 65_536
"""Arrays and objects a body may hold; more is refused without being returned."""
DEFAULT_MAX_WAITING = 8
"""Large bodies waiting for the decoder process before the next one is refused."""


class DecoderBusy(Exception):
    """Too many large bodies are already waiting to be decoded; retry shortly."""


class DecoderFailed(Exception):
    """The decoder process died while decoding; it has been replaced."""


def exceeds_containers(value: Any, *, limit: int = MAX_CONTAINERS) -> bool:
    """Whether ``value`` (decoded JSON) holds more than ``limit`` arrays and objects.
    Iterative, and it stops as soon as the limit is crossed."""
    count = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        else:
            continue
        count += 1
        if count > limit:
            return True
    return False


class BodyDecoder:
    """``await decoder.run(fn, body)``: ``fn(body)`` inline when the body is small, else in
    the decoder process. ``fn`` must be a picklable module-level callable (or a
    ``functools.partial`` of one) whose result is small and picklable."""

    def __init__(self, *, inline_bytes: int = INLINE_BYTES,
                 max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        if inline_bytes < 0 or max_waiting < 0:
            raise ValueError("inline_bytes and max_waiting must be >= 0")
        self.inline_bytes = inline_bytes
        self.max_waiting = max_waiting
        self._slots = threading.BoundedSemaphore(1 + max_waiting)
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._closed = False

    async def run(self, fn: Callable[[bytes], T], body: bytes) -> T:
        if len(body) <= self.inline_bytes:
            return fn(body)
        if not self._slots.acquire(blocking=False):
            raise DecoderBusy(f"{self.max_waiting} large request bodies are already waiting "
                              "to be decoded; retry shortly")
        try:
            executor, future = self._submit(fn, body)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _done: self._slots.release())
        try:
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            self._replace(executor)
            raise DecoderFailed("the request body decoder stopped while decoding this "
                                "body; retry") from None

    def _submit(self, fn: Callable[[bytes], T], body: bytes,
                ) -> tuple[ProcessPoolExecutor, Future[T]]:
        """Submit to the current process; a process that died while idle is replaced once."""
        for _attempt in range(2):
            executor = self._current_executor()
            try:
                return executor, executor.submit(fn, body)
            except BrokenProcessPool:
                self._replace(executor)
        raise DecoderFailed("the request body decoder cannot start; retry")

    def _current_executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise DecoderFailed("the server is shutting down")
            if self._executor is None:
                self._executor = ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            return self._executor

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken:
                self._executor = None
        broken.shutdown(wait=False, cancel_futures=True)

    @property
    def process_pid(self) -> int | None:
        """The decoder process's pid, once one runs (for tests and diagnostics)."""
        with self._lock:
            executor = self._executor
        processes = getattr(executor, "_processes", None) or {}
        return next(iter(processes), None)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
