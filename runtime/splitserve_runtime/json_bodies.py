"""Decoding large JSON request bodies off the event loop, for the runtime's and the router's
HTTP servers, so that one crafted body cannot stall ``/health`` and every other request.

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

:func:`decode_body` is the one way both decode a body. ``json.loads`` fails in three ways that
are not :class:`json.JSONDecodeError`: ``UnicodeDecodeError`` (not UTF-8), ``RecursionError``
(arrays nested about a thousand deep: 2 KB of ``[``) and ``ValueError`` (an integer literal of
more than ``sys.get_int_max_str_digits()`` digits, 4,300 by default); the last two escaped as
500s with two tracebacks each, and the pod reset the client's keep-alive connection. Each is
now :class:`InvalidJSON`, a 400 ``invalid_json``. A body that decodes but nests deeper than
:data:`MAX_DEPTH` is refused the same way: code that walks the value recursively later
(``json.dumps``, pydantic, a JSON schema) would meet the same limit with less stack left.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import compress, islice
from typing import Any, TypeVar

T = TypeVar("T")

INLINE_BYTES = 256 * 1024
"""Bodies up to this size are decoded on the event loop (at most ~30 ms of tiny arrays)."""
MAX_CONTAINERS = 65_536
"""Arrays and objects a body may hold; more is refused without being returned."""
DEFAULT_MAX_WAITING = 8
"""Large bodies waiting for the decoder process before the next one is refused."""
MAX_DEPTH = 128
"""Arrays and objects nested in one another that a body may hold (serde_json's default bound):
real requests nest a few levels (a JSON schema a few dozen), and Python's recursion limit
(1,000 frames, some of them the server's own) is far above it."""


class DecoderBusy(Exception):
    """Too many large bodies are already waiting to be decoded; retry shortly."""


class DecoderFailed(Exception):
    """The decoder process died while decoding; it has been replaced."""


class InvalidJSON(ValueError):
    """A body that is not JSON this server decodes; the message says why, for the client."""


class TooComplex(ValueError):
    """A body holding more than :data:`MAX_CONTAINERS` arrays and objects."""


_CONTAINER_TYPES = frozenset({dict, list})
"""What ``json.loads`` builds arrays and objects as (exactly these types)."""


def _container_excess(value: Any, *, max_containers: int, max_depth: int) -> str | None:
    """ "containers" if ``value`` holds more than ``max_containers`` arrays and objects, "depth"
    if they nest deeper than ``max_depth``, else None. Level by level, each level's children
    gathered and sifted by C loops (a prompt of a million token ids is one pass); it stops at
    the first level that crosses a bound."""
    level = [value] if type(value) in _CONTAINER_TYPES else []
    count = depth = 0
    while level:
        count += len(level)
        depth += 1
        if count > max_containers:
            return "containers"
        if depth > max_depth:
            return "depth"
        children: list[Any] = []
        for item in level:
            children.extend(item.values() if type(item) is dict else item)
        # lazily, and only as many as could still fit: the next check fails on one more
        level = list(
            islice(
                compress(children, map(_CONTAINER_TYPES.__contains__, map(type, children))), max_containers - count + 1
            )
        )
    return None


def exceeds_containers(value: Any, *, limit: int = MAX_CONTAINERS) -> bool:
    """Whether ``value`` (decoded JSON) holds more than ``limit`` arrays and objects.
    Iterative, and it stops as soon as the limit is crossed."""
    return _container_excess(value, max_containers=limit, max_depth=sys.maxsize) == "containers"


def decode_body(raw: bytes, *, max_containers: int = MAX_CONTAINERS, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` decoded as JSON; raises :class:`InvalidJSON` for anything that is not JSON this
    server takes (malformed, not UTF-8, nested deeper than ``max_depth``, an integer over the
    interpreter's digit limit) and :class:`TooComplex` for more than ``max_containers`` arrays
    and objects. Nothing else escapes (module docstring)."""
    too_deep = f"arrays and objects nested deeper than {max_depth} levels"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidJSON(exc.msg) from None
    except UnicodeDecodeError:
        raise InvalidJSON("not UTF-8 text") from None
    except RecursionError:
        raise InvalidJSON(too_deep) from None
    except ValueError:  # int("9" * 5000): the interpreter's guard against quadratic parsing
        raise InvalidJSON(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None
    excess = _container_excess(value, max_containers=max_containers, max_depth=max_depth)
    if excess == "depth":
        raise InvalidJSON(too_deep)
    if excess == "containers":
        raise TooComplex(f"holds more than {max_containers} JSON arrays and objects")
    return value


class BodyDecoder:
    """``await decoder.run(fn, body)``: ``fn(body)`` inline when the body is small, else in
    the decoder process. ``fn`` must be a picklable module-level callable (or a
    ``functools.partial`` of one) whose result is small and picklable."""

    def __init__(self, *, inline_bytes: int = INLINE_BYTES, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
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
            raise DecoderBusy(
                f"{self.max_waiting} large request bodies are already waiting to be decoded; retry shortly"
            )
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
            raise DecoderFailed("the request body decoder stopped while decoding this body; retry") from None

    def _submit(
        self,
        fn: Callable[[bytes], T],
        body: bytes,
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
                self._executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
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
