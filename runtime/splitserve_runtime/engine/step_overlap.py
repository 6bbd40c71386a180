"""Asynchronous scheduling: step n+1 is scheduled and its inputs built while step n runs.

Without it a step is strictly *schedule → build inputs → forward + sample → wait → append
tokens*, so the host's bookkeeping and the model's forward add up. With it the engine
(:mod:`.llm_engine`) keeps one step in flight: while step n computes, it schedules step n+1,
builds its inputs and launches it, and only then waits for step n's tokens and processes them
(the text too) while step n+1 computes. A step then takes ``max(forward, bookkeeping)``
instead of their sum.

Step n+1 is scheduled before step n's tokens are known. The scheduler counts each of them as
*pending* (``Sequence.num_pending_tokens``; see :mod:`.scheduler`), so a sequence sampled in
step n is a decode in step n+1, and the decode's input token is copied on the device from step
n's sampled ids (:class:`InFlightStep` ``.sampled``) into step n+1's ``input_ids`` before its
forward — the host never waits for it. On the forward thread that copy runs right after step n
samples, before step n is reported done (:class:`SampledIds`). What this costs: a sequence that
step n ends (eos, a stop token or a stop string; ``max_tokens`` is known ahead and is not
scheduled again) computes one more row in step n+1, which is dropped, as vLLM's async
scheduling does. KV the dropped row writes lands past the sequence's end, in blocks no other
step reads before the row has run: later steps run after it, in order, on the one device stream
or forward thread, and the engine waits for the step in flight before it hands blocks to
anything outside that order (a KV import's reservation, a finished ``keep_kv`` sequence whose
last step is still running).

Where the forward runs:

- **CUDA** — on the engine thread: launching only queues kernels, so the host is free at once.
  The sampled ids (and logprobs) are copied to pinned host memory behind the step's own
  kernels, and :meth:`InFlightStep.resolve` waits for that copy only, not for the step queued
  after it.
- **CPU** — on one forward thread (:class:`ForwardThread`): torch's kernels release the GIL,
  so the engine thread's Python runs meanwhile. Everything that reads or writes the
  sampler's per-request state runs on that thread too, in submission order.

Not with speculative decoding (proposals are made from the tokens of the step before), nor
with a runner that overrides the forward hooks (the parallel driver, whose control messages
to the other ranks must stay in step order on the engine thread).

Off by default (``EngineConfig.async_scheduling=None``); ``True`` turns it on. It is correct
(the whole runtime and disaggregation test suites pass with it on, and
``tests/runtime/engine/test_engine_step_bookkeeping.py`` checks it gives the synchronous tokens), and
it hides the host's work behind a forward that leaves the GIL (``bench/cpu_engine.py`` (c)).
It is not the default yet because: on the CPU the forward thread's Python (the model's glue
between kernels, the sampler) takes turns with the engine thread for the GIL, and when the
host's work is the larger part a step measured slower than synchronous on the shared 2-core
development machine, with tiny-model throughput inconclusive there; the CUDA path (inline
launch, pinned copies behind the step's kernels, an event per step) has not run on a GPU yet.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from .model_runner import ModelRunner
from .sampler import PendingSample, SamplerOutput
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .speculative import SpeculativeConfig
from .step_inputs import StepInputs

T = TypeVar("T")


def resolve_async_scheduling(requested: bool | None, *, speculative: SpeculativeConfig, runner: ModelRunner) -> bool:
    """``requested`` (None: off, see the module docstring) against what an engine with this
    speculation and runner can do; raises if it was asked for and cannot work."""
    why_not = None
    if speculative.enabled:
        why_not = "speculative decoding proposes from the previous step's tokens"
    elif (
        type(runner).forward_logits is not ModelRunner.forward_logits
        or type(runner).before_forward is not ModelRunner.before_forward
    ):
        why_not = "this runner drives other ranks in step order (tensor or pipeline parallelism)"
    if requested and why_not:
        raise ValueError(f"asynchronous scheduling is not available: {why_not}")
    return bool(requested)


class ForwardThread:
    """One thread that runs submitted work in order (the CPU's forwards and sampling)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitserve-forward")
        self.busy_seconds = 0.0
        """Wall time the thread spent running submitted work: the forward side of the steps
        (model, sampler, and its waits for the GIL while the engine thread runs Python).
        Written by the forward thread only; ``bench/cpu_engine.py`` (c) divides it by the
        steps to compare a step with the larger of its two sides."""

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        def timed() -> T:
            started = time.perf_counter()
            try:
                return fn()
            finally:
                self.busy_seconds += time.perf_counter() - started

        return self._pool.submit(timed)

    def flush(self) -> None:
        """Wait until everything submitted so far has run."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


class SampledIds:
    """A step's sampled ids once they exist, and the work waiting for them.

    The next step's decode inputs are copied from these ids. On the forward thread that copy
    runs as soon as the ids are sampled, before the step is reported done: if it ran at the
    start of the next step's work instead, it would wait for the GIL while the engine thread,
    woken by the finished step, processes its outputs, and the next forward would start only
    after the host's work rather than beside it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._waiting: list[Callable[[torch.Tensor], None]] = []

    def then(self, fn: Callable[[torch.Tensor], None]) -> None:
        """Run ``fn(ids)`` now if the ids exist (on the device they are queued work: ``fn``
        queues behind it), else on the forward thread right after they are sampled; never if
        the step failed (the step that needs ``fn`` calls :meth:`check` before it runs, and the
        engine meets the failure first, when it resolves the failed step)."""
        with self._lock:
            if self._error is not None:
                return
            if self._ids is None:
                self._waiting.append(fn)
                return
            ids = self._ids
        fn(ids)

    def check(self) -> None:
        """Raise the error of the step that was to sample the ids, if it failed."""
        if self._error is not None:
            raise RuntimeError("the step before failed; its sampled ids do not exist") from self._error

    def publish(self, ids: torch.Tensor) -> None:
        with self._lock:
            self._ids, waiting, self._waiting = ids, self._waiting, []
        try:
            for fn in waiting:
                fn(ids)
        except BaseException as error:
            self._error = error  # the step waiting for these ids must not run on unfilled inputs
            raise

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error, self._waiting = error, []


class InFlightStep:
    """A launched step: its schedule, sampled sequences, and tokens still being computed."""

    def __init__(
        self,
        *,
        sched: SchedulerOutput,
        sample_seqs: list[Sequence],
        future: Future[PendingSample],
        sampled: SampledIds,
        host: PendingSample | None = None,
        copied: torch.cuda.Event | None = None,
    ) -> None:
        self.sched = sched
        self.sampled = sampled
        """The sampled ids on the device, for work ordered after this step's (the next step's
        decode inputs): :meth:`SampledIds.then` does not wait for them."""
        self.sample_seqs = sample_seqs
        self._future = future
        self._host = host
        self._copied = copied
        self._rows: dict[int, int] | None = None

    def row_of(self, seq: Sequence) -> int:
        """The sampled row of ``seq`` in this step."""
        if self._rows is None:
            self._rows = {id(s): i for i, s in enumerate(self.sample_seqs)}
        return self._rows[id(seq)]

    def wait(self) -> None:
        """Until the step's forward and sampling have run (its KV writes are done)."""
        self._future.result()
        if self._copied is not None:
            self._copied.synchronize()

    def resolve(self) -> SamplerOutput:
        """Wait for the sampled tokens and return them (host lists)."""
        self.wait()
        return (self._host or self._future.result()).resolve()


def launch(
    runner: ModelRunner, sched: SchedulerOutput, *, after: InFlightStep | None, thread: ForwardThread | None
) -> InFlightStep:
    """Build ``sched``'s inputs here and run its forward and sampling after ``after``'s (on
    ``thread``, or queued on the device when there is none). Decodes whose input token is
    pending are read from ``after``'s sampled ids."""
    rows, sample_seqs = runner.step_rows(sched)
    inputs = rows.build(block_size=runner.block_size, device=runner.device)
    offset = inputs.md.num_prefill_tokens
    dst: list[int] = []
    src: list[int] = []
    for j, seq in enumerate(sched.decodes):
        if seq.num_pending_tokens:
            if after is None:
                raise RuntimeError(f"request {seq.request_id} waits for a token no step computes")
            dst.append(offset + j)
            src.append(after.row_of(seq))
    if dst:
        assert after is not None
        rows_to = torch.tensor(dst, dtype=torch.long).to(runner.device, non_blocking=True)
        rows_from = torch.tensor(src, dtype=torch.long).to(runner.device, non_blocking=True)

        def fill_inputs(ids: torch.Tensor) -> None:
            with torch.inference_mode():
                inputs.input_ids[rows_to] = ids[rows_from]

        after.sampled.then(fill_inputs)
    request_ids, params, banned = runner.sample_args(sample_seqs)
    sampled = SampledIds()

    def run() -> PendingSample:
        try:
            if after is not None:
                after.sampled.check()
            with torch.inference_mode():
                logits = _logits(runner, inputs)
                if logits is None or not sample_seqs:
                    pending = PendingSample(token_ids=torch.empty(0, dtype=torch.long, device=runner.device), params=[])
                else:
                    pending = runner.sampler.launch(
                        logits=logits, request_ids=request_ids, params=params, banned_token_ids=banned
                    )
        except BaseException as error:
            sampled.fail(error)
            raise
        sampled.publish(pending.token_ids)
        return pending

    if thread is not None:
        return InFlightStep(sched=sched, sample_seqs=sample_seqs, future=thread.submit(run), sampled=sampled)
    pending = run()
    host, copied = _copy_to_host(pending)
    return InFlightStep(
        sched=sched, sample_seqs=sample_seqs, future=_done(pending), sampled=sampled, host=host, copied=copied
    )


def _logits(runner: ModelRunner, inputs: StepInputs) -> torch.Tensor | None:
    hidden = runner.model.forward(
        input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=runner.kv_caches, md=inputs.md
    )
    if not inputs.logits_indices.numel():
        return None
    return runner.model.compute_logits(hidden[inputs.logits_indices])


def _copy_to_host(pending: PendingSample) -> tuple[PendingSample | None, torch.cuda.Event | None]:
    """Queue copies of ``pending``'s device tensors into pinned host memory behind the step's
    kernels, and an event that marks them done (None, None off CUDA)."""
    copies: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(pending):
        value = getattr(pending, f.name)
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            copies[f.name] = host
    if not copies:
        return None, None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return dataclasses.replace(pending, **copies), event  # type: ignore[arg-type]
