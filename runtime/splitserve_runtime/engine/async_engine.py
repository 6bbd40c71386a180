"""``AsyncEngine``: the server's interface to the engine, for use from an asyncio loop.

:class:`~.llm_engine.LLMEngine` is synchronous and single-threaded. ``AsyncEngine`` gives
it a dedicated thread that loops *commands → step → outputs*: the asyncio side only appends
commands (add, abort, call) to an inbox under a condition variable, and the engine thread
hands each step's outputs back in one ``loop.call_soon_threadsafe`` call, which routes them
to per-request ``asyncio.Queue``\\ s. The event loop therefore never waits for a model step,
and HTTP parsing / tokenisation overlap with the step running on the device.

Request lifecycle (:meth:`AsyncEngine.generate`, an async generator):

- admission checks run on the first ``__anext__``, before anything is yielded, and raise the
  typed errors of :mod:`.errors` (the request never enters the engine);
- each yielded :class:`~.outputs.RequestOutput` is a delta; the last has ``finished=True``;
- if the consumer stops early — its task is cancelled on client disconnect, or it closes
  the generator — the ``finally`` aborts the request and its KV blocks are freed. Use
  ``contextlib.aclosing`` (or cancel the task) so this happens at once rather than at GC.

A fatal error in ``step()`` marks the engine unhealthy, ends every stream with an
``error`` output and makes further ``generate`` calls raise :class:`~.errors.EngineDead`.

So does a step that never returns: a tensor-parallel rank stopped (SIGSTOP) or stuck in a
driver call leaves the other ranks waiting in a collective for gloo's 10-minute timeout, and
an exception that never comes cannot mark anything. A watchdog thread therefore times each
iteration of the engine loop (commands and step) while the engine has work; one running past
``step_timeout_s`` (``--engine-step-timeout-seconds``) is declared wedged: one ERROR line,
``is_healthy`` turns False (``/health`` answers 503, so the kubelet restarts the pod), and
every open stream ends with an ``error`` output. Idle waits are not timed.

A parallel group that breaks (a rank killed) ends the process with ``os._exit``; the engine
fails first (:mod:`.parallel.exit_hooks`), so every open stream gets its ``error`` output
while the server can still send it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from splitserve_contract import ServeArgs, defaults

from .errors import DuplicateRequestId, EngineDead, QueueFull
from .llm_engine import LLMEngine
from .outputs import FINISH_ABORT, FINISH_ERROR, RequestOutput
from .parallel import exit_hooks
from .sampling_params import SamplingParams
from .stats import EngineStats

log = logging.getLogger(__name__)

T = TypeVar("T")

STATS_REFRESH_SECONDS = 0.05
"""The engine thread refreshes the stats snapshot at most this often while busy."""
RETRY_AFTER_WINDOW_SECONDS = 10.0


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time_s: float
    keep_kv: bool = False


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


_Command = _Add | _Abort | _Call


class AsyncEngine:
    """Owns an :class:`LLMEngine` and the thread that steps it."""

    def __init__(
        self,
        *,
        engine: LLMEngine | None = None,
        engine_factory: Callable[[], LLMEngine] | None = None,
        step_timeout_s: float = defaults.ENGINE_STEP_TIMEOUT_SECONDS,
    ) -> None:
        if (engine is None) == (engine_factory is None):
            raise ValueError("pass exactly one of engine or engine_factory")
        if not step_timeout_s >= 0:
            raise ValueError(f"the engine step timeout must be >= 0 seconds (0: none), got {step_timeout_s}")
        self.step_timeout_s = step_timeout_s
        """Longest one loop iteration may run before the engine is declared wedged (0: never)."""
        self._busy_since_s: float | None = None
        """When the iteration now running began (None: idle); read by the watchdog."""
        self._steps_begun = 0
        """Loop iterations begun (the watchdog's message names the stalled one)."""
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._engine = engine
        self._engine_factory = engine_factory
        self._cv = threading.Condition()
        self._inbox: list[_Command] = []
        self._num_pending_adds = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._healthy = False
        self._fatal_error: str | None = None
        self._stats: EngineStats | None = None
        self._stats_time_s = 0.0
        self._finish_times_s: collections.deque[float] = collections.deque(maxlen=4096)
        self._remove_exit_hook: Callable[[], None] | None = None
        self._iteration_hooks: list[Callable[[LLMEngine], None]] = []

    @classmethod
    def from_args(cls, args: ServeArgs) -> AsyncEngine:
        """An engine that loads the model in :meth:`start` (off the event loop)."""
        return cls(engine_factory=lambda: LLMEngine.from_args(args), step_timeout_s=args.engine_step_timeout_seconds)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        if self._engine is None and self._engine_factory is not None:
            self._engine = await asyncio.to_thread(self._engine_factory)
        self._stats = self.engine.stats()
        self._healthy = True
        self._thread = threading.Thread(target=self._run, name="splitserve-engine", daemon=True)
        self._thread.start()
        self._remove_exit_hook = exit_hooks.add(self._fail_before_exit, stage="fail")
        if self.step_timeout_s > 0:
            self._watchdog = threading.Thread(target=self._watch, name="splitserve-engine-watchdog", daemon=True)
            self._watchdog.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; open streams end with an ``abort`` output."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._watch_stop.set()
        if self._remove_exit_hook is not None:
            self._remove_exit_hook()
        if self._thread is not None:
            # a wedged step never returns; its daemon thread is left behind
            await asyncio.to_thread(self._thread.join, None if self._healthy else 1.0)
        if self._watchdog is not None:
            await asyncio.to_thread(self._watchdog.join)
        if self._thread is not None and self._thread.is_alive():
            # still inside the wedged step, holding what close() needs (a tensor-parallel
            # runner's control channel): leave the workers to the exit hooks, which kill them
            log.warning("the engine thread is still inside its wedged step; not closing the engine")
        elif self._engine is not None:
            self._engine.close()
        self._healthy = False
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(self._terminal_output(request_id, reason=FINISH_ABORT, error="the engine shut down"))

    # ------------------------------------------------------------------ properties
    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDead("the engine is not started")
        return self._engine

    @property
    def is_healthy(self) -> bool:
        return self._healthy

    @property
    def fatal_error(self) -> str | None:
        return self._fatal_error

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def stats(self) -> EngineStats:
        """The latest snapshot (at most ~50 ms old while the engine is busy)."""
        if self._stats is None:
            return self.engine.stats()
        return self._stats

    # ------------------------------------------------------------------ requests
    async def generate(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams, keep_kv: bool = False
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request (see the module docstring). ``keep_kv``: pin
        its KV when it finishes, for a decode pod to pull (see :mod:`.handoff`)."""
        if not self._healthy:
            raise EngineDead(self._fatal_error or "the engine is not running")
        if request_id in self._queues:
            raise DuplicateRequestId(f"request id {request_id!r} is already in flight")
        engine = self.engine
        engine.check_request(prompt_token_ids=prompt_token_ids, params=params)
        num_waiting = engine.scheduler.num_waiting + self._num_pending_adds
        if num_waiting >= engine.config.max_queue_len:
            raise QueueFull(
                num_waiting=num_waiting,
                max_queue_len=engine.config.max_queue_len,
                retry_after_seconds=self._retry_after_seconds(num_waiting),
            )
        stream = self.open_stream(request_id)
        try:
            self._submit(_Add(request_id, list(prompt_token_ids), params, time.monotonic(), keep_kv=keep_kv))
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    def open_stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Receive the outputs of ``request_id``, for requests started through :meth:`call`
        (e.g. ``activate_imported_request``): open the stream *before* starting the request,
        and iterate or close it. Stopping early aborts the request, as in :meth:`generate`."""
        if request_id in self._queues:
            raise DuplicateRequestId(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return self._drain(request_id, queue)

    async def _drain(self, request_id: str, queue: asyncio.Queue[RequestOutput]) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its stream ends with ``abort``."""
        self._submit(_Abort(request_id))

    def add_iteration_hook(self, hook: Callable[[LLMEngine], None]) -> None:
        """Run ``hook(engine)`` on the engine thread after every loop iteration (the commands
        applied, the step taken): where room freed by a step, an abort or a KV release can be
        handed to a waiter at once (the decode role's pending KV imports). Add before start."""
        self._iteration_hooks.append(hook)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps (hooks such as KV
        import/export need the engine's state without racing the loop). If the awaiting
        task is cancelled before ``fn`` starts, ``fn`` never runs."""
        future: Future[T] = Future()
        self._submit(_Call(fn, future))
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------ engine thread
    def _submit(self, command: _Command) -> None:
        with self._cv:
            if self._stopping or (self._fatal_error is not None and not isinstance(command, _Abort)):
                if isinstance(command, _Call):
                    command.future.set_exception(EngineDead(self._fatal_error or "engine stopped"))
                    return
                if isinstance(command, _Add):
                    raise EngineDead(self._fatal_error or "the engine is shutting down")
            if isinstance(command, _Add):
                self._num_pending_adds += 1
            self._inbox.append(command)
            self._cv.notify()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    # Idle, or stalled: only a command (add, abort, a KV release) can free
                    # the blocks the waiting requests need, so wait for one, don't spin.
                    while not self._inbox and not self._stopping and (not engine.has_unfinished() or engine.stalled):
                        self._publish_stats(engine, force=True)
                        self._cv.wait()
                    if self._stopping or self._fatal_error is not None:
                        return
                    commands, self._inbox = self._inbox, []
                    self._num_pending_adds = 0
                    self._steps_begun += 1
                    self._busy_since_s = time.monotonic()
                outputs = self._apply(engine, commands)
                if engine.has_unfinished():
                    outputs.extend(engine.step())
                for hook in self._iteration_hooks:
                    hook(engine)
                with self._cv:
                    self._busy_since_s = None
                    if self._fatal_error is not None:  # declared wedged while it ran: too late
                        return
                if outputs:
                    self._deliver(outputs)
                self._publish_stats(engine, force=False)
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine step failed; the engine is now unhealthy")
            self._fatal(f"engine failure: {type(exc).__name__}: {exc}")

    def _watch(self) -> None:
        """The watchdog thread: declare the engine wedged when one iteration outlives the bound."""
        timeout = self.step_timeout_s
        poll = min(max(timeout / 10, 0.05), 1.0)
        # sleeps on its own event: a wait on the engine's condition could swallow the single
        # notify() meant for the engine thread
        while not self._watch_stop.wait(poll):
            with self._cv:
                if self._stopping or self._fatal_error is not None:
                    return
                since = self._busy_since_s
                iteration = self._steps_begun
            now = time.monotonic()
            if since is not None and now - since > timeout:
                break
        else:
            return
        message = (
            f"the engine is wedged: engine loop iteration {iteration} "
            f"({self._describe_work()}) has run for {now - since:.1f} s, over "
            f"--engine-step-timeout-seconds ({timeout:g} s){self._ranks_hint()}; "
            "failing /health so the pod is restarted"
        )
        log.error("%s", message)
        self._fatal(message)

    def _describe_work(self) -> str:
        engine = self._engine
        if engine is None:
            return "no engine"
        sched = engine.scheduler  # lengths only: read without the engine thread's cooperation
        return f"{sched.num_running} requests running, {sched.num_waiting} waiting"

    def _ranks_hint(self) -> str:
        """Which ranks the stalled step waits on: every rank of a tensor/pipeline-parallel
        engine runs each step in lockstep, so one stopped rank stalls them all."""
        engine = self._engine
        group: Any = getattr(getattr(engine, "runner", None), "group", None)
        size = getattr(group, "size", None)
        if isinstance(size, int) and size > 1:
            return (
                f"; ranks 0-{size - 1} run each step in lockstep (tensor {group.tp_size} x "
                f"pipeline {group.num_stages}), so at least one of them is stopped or stuck"
            )
        return ""

    def _apply(self, engine: LLMEngine, commands: list[_Command]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for command in commands:
            if isinstance(command, _Add):
                try:
                    engine.add_request(
                        request_id=command.request_id,
                        prompt_token_ids=command.prompt_token_ids,
                        params=command.params,
                        arrival_time_s=command.arrival_time_s,
                        keep_kv=command.keep_kv,
                    )
                except ValueError as exc:  # e.g. a duplicate id that raced the check
                    outputs.append(self._terminal_output(command.request_id, reason=FINISH_ERROR, error=str(exc)))
            elif isinstance(command, _Abort):
                out = engine.abort_request(command.request_id)
                if out is not None:
                    outputs.append(out)
            elif command.future.set_running_or_notify_cancel():  # the caller may have gone
                try:
                    result = command.fn(engine)
                except Exception as exc:
                    command.future.set_exception(exc)
                else:
                    command.future.set_result(result)
        return outputs

    def _publish_stats(self, engine: LLMEngine, *, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_time_s >= STATS_REFRESH_SECONDS:
            self._stats = engine.stats()
            self._stats_time_s = now

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed after the check
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: route outputs to their request queues."""
        now = time.monotonic()
        for out in outputs:
            if out.finished:
                self._finish_times_s.append(now)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fatal(self, message: str) -> None:
        with self._cv:
            self._fatal_error = message
            self._healthy = False
            pending = self._inbox
            self._inbox = []
        for command in pending:
            if isinstance(command, _Call):
                command.future.set_exception(EngineDead(message))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._fail_all_streams, message)

    def _fail_before_exit(self, reason: str) -> None:
        """:mod:`.parallel.exit_hooks`: a broken group is ending the process (from another
        thread, or this engine's own inside a step): fail now, unless already failed, so every
        open stream ends with an ``error`` output rather than a cut connection."""
        with self._cv:
            if self._fatal_error is not None or self._stopping:
                return
        log.error("the engine fails: %s", reason)
        self._fatal(f"engine failure: {reason}")

    def _fail_all_streams(self, message: str) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(self._terminal_output(request_id, reason=FINISH_ERROR, error=message))

    @staticmethod
    def _terminal_output(request_id: str, *, reason: str, error: str) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            new_logprobs=None,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=0,
            num_output_tokens=0,
            num_cached_tokens=0,
            error=error,
        )

    def _retry_after_seconds(self, num_waiting: int) -> float:
        """Waiting requests / recent completion rate, clamped to [1, 60] seconds."""
        now = time.monotonic()
        recent = sum(1 for t in self._finish_times_s if now - t <= RETRY_AFTER_WINDOW_SECONDS)
        if recent == 0:
            return 1.0
        rate = recent / RETRY_AFTER_WINDOW_SECONDS
        return float(min(max(num_waiting / rate, 1.0), 60.0))
