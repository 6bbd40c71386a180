"""The driver's model runner: the single-process runner plus what the other ranks must see.

Before each forward it broadcasts the step's rows (the other ranks run their part of the
forward: the same one for tensor parallelism, the next stages for pipeline parallelism).

The KV handoff moves each rank's own slice (:mod:`.kv_slices`, :mod:`.rank_kv`): an export
(:meth:`ParallelRunner.export_blocks`, on the engine thread) has every rank snapshot its part
for its own KV endpoint, and learns their endpoints; a release queues a drop that reaches the
ranks before the next forward; a pull (:meth:`ParallelRunner.pull`, from the event loop) tells
every rank what to pull, pulls rank 0's part, and collects the other ranks' reports from the
store, never holding the control channel while bytes move. The whole-model path (an export
gathers every rank's part on rank 0, imported whole-model blocks are queued and broadcast
before the next forward) remains for the in-process ``block_reader``/``write_block`` API.

While the engine is idle a keepalive thread pings the other ranks (under the same lock as every
other control message): a worker waits for the next message inside a collective, which would
time out after an idle :data:`~.group.INIT_TIMEOUT`, and a ping to a rank whose connection
closed fails at once, so a dead rank in another pod takes this one down within seconds even
when no request comes. A control message or ping that fails leaves the ranks out of step for
good, so it ends the process (:class:`~.failure.GroupFailure`) with a termination message rather
than only the engine; so does a failed forward when the group spans pods (``exit_on_forward_error``:
in one pod the supervisor names the dead rank, and an in-process engine's bug stays an exception).
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import torch

from ...transfer import KVConnector, KVSlice
from ..kv_budget import KVCacheSpec
from ..model_runner import ModelRunner
from ..step_inputs import CausalLM, StepRows
from . import control, exit_hooks
from .group import ParallelGroup
from .kv_slices import PullOrder, PullReport, pull_part, snapshot
from .launcher import Workers, exit_group
from .rank_kv import report_key
from .worker import RankModel

PING_SECONDS = 2.0
"""The keepalive pings after this long without a control message."""
PULL_REPORT_SECONDS = 30.0
"""How long, beyond its transfers' own timeouts, a rank may take to report a KV pull."""


def _exit_process(symptom: str) -> NoReturn:
    message = f"the parallel group broke: {symptom}"
    exit_hooks.run(message)  # the streams in flight get their error event first
    exit_group(message)


class ParallelRunner(ModelRunner):
    """Rank 0's runner over its own part of the model; see the module docstring."""

    def __init__(
        self,
        *,
        model: CausalLM,
        spec: KVCacheSpec,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        eos_token_ids: frozenset[int] = frozenset(),
        group: ParallelGroup,
        loaded: RankModel,
        workers: Workers,
        on_failure: Callable[[str], NoReturn] = _exit_process,
        exit_on_forward_error: bool = False,
    ) -> None:
        super().__init__(
            model=model,
            spec=spec,
            device=device,
            block_size=block_size,
            num_blocks=num_blocks,
            eos_token_ids=eos_token_ids,
        )
        self.group = group
        self.loaded = loaded
        self.part = loaded.part
        self.workers = workers
        self.wire_spec = KVCacheSpec(
            num_layers=self.part.num_layers,
            num_kv_heads=self.part.layout.config.num_key_value_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
        )
        self._lock = threading.Lock()
        self._pending_writes: dict[int, bytes] = {}
        self._pending_drops: list[str] = []
        self._on_failure = on_failure
        self._exit_on_forward_error = exit_on_forward_error
        self._control = threading.Lock()
        """Held for a control message and the control-group collectives that follow it."""
        self._last_message = time.monotonic()
        self._closed = threading.Event()
        threading.Thread(target=self._keepalive, name="tp-keepalive", daemon=True).start()

    def before_forward(self, rows: StepRows) -> None:
        with self._control:
            self._flush_writes()
            self._send(control.Step(rows=rows))

    def forward_logits(self, rows: StepRows) -> torch.Tensor | None:
        try:
            return self.loaded.forward_logits(self.group, rows=rows, caches=self.kv_caches, block_size=self.block_size)
        except RuntimeError as exc:
            if not self._exit_on_forward_error:
                raise
            self._on_failure(f"a parallel forward failed: {exc}")

    def block_reader(self, block_ids: list[int]) -> Callable[[int], bytes]:
        for block_id in block_ids:
            self._check_block_id(block_id)
        with self._control:
            self._flush_writes()
            self._send(control.ReadBlocks(block_ids=list(block_ids)))
            try:
                blocks = control.gather_blocks(self.group, self.part, self.kv_caches, list(block_ids))
            except RuntimeError as exc:
                self._on_failure(f"gathering KV blocks from the ranks failed: {exc}")
        assert blocks is not None  # the driver receives them
        return blocks.__getitem__

    def _send(self, message: control.Message) -> None:
        """Broadcast ``message`` (the caller holds ``_control``)."""
        try:
            control.send(self.group, message)
        except RuntimeError as exc:
            if self._closed.is_set() and isinstance(message, control.Ping):
                return  # abandoned at exit: the workers are being killed
            self._on_failure(f"sending {type(message).__name__} to the ranks failed: {exc}")
        self._last_message = time.monotonic()

    def _keepalive(self) -> None:
        while not self._closed.wait(PING_SECONDS / 4):
            if time.monotonic() - self._last_message < PING_SECONDS and not self._pending_drops:
                continue
            with self._control:
                if self._closed.is_set():
                    continue
                if self._pending_drops:
                    self._flush_drops()
                elif time.monotonic() - self._last_message >= PING_SECONDS:
                    self._send(control.Ping())

    # ------------------------------------------------------------------ the KV handoff, rank by rank
    def rank_slices(self) -> list[KVSlice]:
        """The global layers and KV heads each rank holds, in rank order."""
        return [
            self.part.slice(stage=rank // self.group.tp_size, tp_rank=rank % self.group.tp_size)
            for rank in range(self.group.size)
        ]

    def export_blocks(
        self, *, request_id: str, block_ids: list[int], num_tokens: int
    ) -> tuple[torch.Tensor, list[str]]:
        """Engine thread: every rank snapshots its part of ``block_ids`` and serves it as
        ``request_id`` on its KV endpoint. Returns rank 0's snapshot (``[block][its slice's
        bytes]``, which rank 0's endpoint serves) and the other ranks' endpoints, in rank
        order. Raises RuntimeError when a rank cannot serve it."""
        for block_id in block_ids:
            self._check_block_id(block_id)
        with self._control:
            self._flush_writes()
            self._send(control.ExportBlocks(request_id=request_id, block_ids=list(block_ids), num_tokens=num_tokens))
            mine = snapshot(self.kv_caches, block_ids)
            try:
                answers: list[tuple[bool, str]] = self.group.all_gather_object((True, ""))
            except RuntimeError as exc:
                self._on_failure(f"exporting KV blocks from the ranks failed: {exc}")
        failed = [f"rank {rank}: {text}" for rank, (ok, text) in enumerate(answers) if not ok]
        if failed:
            self.drop_export(request_id)
            raise RuntimeError(f"the ranks cannot export KV: {'; '.join(failed)}")
        return mine, [text for _, text in answers[1:]]

    def drop_export(self, request_id: str) -> None:
        """Any thread: the ranks free their snapshots of ``request_id`` (before the next forward)."""
        with self._lock:
            self._pending_drops.append(request_id)

    def _flush_drops(self) -> None:
        """Send the queued drops (the caller holds ``_control``)."""
        with self._lock:
            drops, self._pending_drops = self._pending_drops, []
        if drops:
            self._send(control.DropExports(request_ids=drops))

    async def pull(self, order: PullOrder, *, connector: KVConnector) -> list[PullReport]:
        """Event loop: every rank pulls its part of ``order`` into its cache at once; their
        reports, in rank order. Returns when every rank has reported (each rank's transfers are
        bounded by ``order.timeout_seconds`` of silence), so a failed pull leaves no rank
        still writing into blocks the caller is about to free."""
        await asyncio.to_thread(self._start_pull, order)
        try:
            mine = await pull_part(
                order, connector=connector, caches=self.kv_caches, rank=0, mine=self.part.slice(stage=0, tp_rank=0)
            )
        finally:  # even when rank 0's part raised: the caller frees the blocks after this
            others = await asyncio.to_thread(self._collect, order)
        return [mine, *others]

    def _start_pull(self, order: PullOrder) -> None:
        with self._control:
            self._send(control.PullBlocks(order=order))

    def _collect(self, order: PullOrder) -> list[PullReport]:
        store = self.group.store
        reports: list[PullReport] = []
        for rank in range(1, self.group.size):
            key = report_key(order.pull_id, rank)
            try:
                store.wait([key], datetime.timedelta(seconds=PULL_REPORT_SECONDS + 4 * order.timeout_seconds))
                report = PullReport.from_json(store.get(key))
                store.delete_key(key)
            except RuntimeError as exc:  # no report in time: the group is broken
                self._on_failure(f"rank {rank} did not report its KV pull: {exc}")
            reports.append(report)
        return reports

    def read_block(self, block_id: int) -> bytes:
        return self.block_reader([block_id])(0)

    def write_block(self, block_id: int, data: bytes | memoryview) -> None:
        """Queue one whole-model-layout block; every rank gets it before the next forward."""
        self._check_block_id(block_id)
        expected = self.wire_spec.bytes_per_block(block_size=self.block_size)
        if len(data) != expected:
            raise ValueError(f"a KV block has {expected} bytes, got {len(data)}")
        with self._lock:
            self._pending_writes[block_id] = bytes(data)

    def _flush_writes(self) -> None:
        """Send the queued imported blocks (the caller holds ``_control``)."""
        self._flush_drops()
        with self._lock:
            blocks, self._pending_writes = self._pending_writes, {}
        if blocks:
            self._send(control.WriteBlocks(blocks=blocks))
            control.write_blocks(self.group, self.part, self.kv_caches, blocks)

    def close(self) -> None:
        """Tell the other ranks to stop and wait for this pod's to exit."""
        with self._control:
            self._closed.set()
            self._send(control.Stop())
        self.workers.stop()

    def abandon(self) -> None:
        """Stop pinging without telling the ranks (the process exits and kills its workers)."""
        self._closed.set()
