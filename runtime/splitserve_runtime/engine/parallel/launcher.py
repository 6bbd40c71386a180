"""Starting a pod's worker ranks and taking the pod down when one dies.

The serving process is rank 0; it starts the other ranks of its pod (1..g-1; all of them on a
one-pod replica) as child processes; a worker pod's agent starts all of its pod's ranks
(:mod:`.node`). A child that exits while the pod runs leaves the group waiting in a collective
that can never complete, so a supervisor thread watches the children and ends the process with
a non-zero status within a poll interval (:func:`exit_group`): the kubelet restarts the pod
(the LeaderWorkerSet the whole group) rather than leave it hung and Ready. The other way round,
each worker watches its parent (:func:`~.worker.exit_with_parent`), so a process that dies,
however it dies, takes its workers with it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from splitserve_contract import ServeArgs

from ...termination import write_termination_message
from .rendezvous import Rendezvous
from .worker import worker_argv

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
WORKER_EXIT_STATUS = 70
"""The server's exit status when a worker rank died (EX_SOFTWARE)."""


def free_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://`` rendezvous address on a free local port (rank 0 listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"


class Workers:
    """The worker ranks of one pod and their supervisor."""

    def __init__(
        self,
        processes: list[subprocess.Popen[bytes]],
        *,
        ranks: Sequence[int] | None = None,
        on_death: Callable[[int, int], None] | None = None,
    ) -> None:
        self.processes = processes
        self.ranks = list(ranks) if ranks is not None else list(range(1, len(processes) + 1))
        if len(self.ranks) != len(processes):
            raise ValueError(f"{len(processes)} worker processes for ranks {self.ranks}")
        self._stopping = threading.Event()
        self._on_death = on_death or _exit_server
        self._thread = threading.Thread(target=self._watch, name="tp-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_SECONDS):
            for rank, process in zip(self.ranks, self.processes, strict=True):
                code = process.poll()
                if code is not None and not self._stopping.is_set():
                    self._on_death(rank, code)
                    return

    def first_death(self) -> tuple[int, int] | None:
        """(rank, exit status) of a worker that has exited, if any."""
        for rank, process in zip(self.ranks, self.processes, strict=True):
            code = process.poll()
            if code is not None:
                return rank, code
        return None

    def stop(self, *, timeout_seconds: float = 5.0) -> None:
        """Stop supervising and end the workers (after a Stop message they exit on their own)."""
        self._stopping.set()
        for process in self.processes:
            try:
                process.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def kill(self) -> None:
        """Stop supervising and kill the workers at once (rank 0 failed to start)."""
        self._stopping.set()
        for process in self.processes:
            process.kill()
            process.wait()


def worker_died_message(rank: int, code: int) -> str:
    return (
        f"parallel worker rank {rank} exited with status {code}: the server stops "
        f"(the model cannot run without every rank)"
    )


def _exit_server(rank: int, code: int) -> None:
    exit_group(worker_died_message(rank, code))


_exiting = threading.Lock()


def exit_group(message: str) -> NoReturn:
    """End this process at once with :data:`WORKER_EXIT_STATUS` and ``message`` as the
    termination message (the group cannot go on). Called from any thread; the first caller's
    message is the one written."""
    if not _exiting.acquire(blocking=False):
        threading.Event().wait()  # another thread is ending the process
    log.critical("%s", message)
    write_termination_message(message)
    logging.shutdown()
    os._exit(WORKER_EXIT_STATUS)


def start_workers(
    args: ServeArgs,
    *,
    model_dir: Path,
    init_method: str,
    rendezvous: Rendezvous,
    ranks: Sequence[int] | None = None,
    on_death: Callable[[int, int], None] | None = None,
) -> Workers:
    """Start ``ranks`` (default 1..size-1 of ``args.tensor_parallel_size ×
    args.pipeline_parallel_size``: a one-pod replica); they join at ``init_method`` and get the
    group's key in their environment (:mod:`.rendezvous`)."""
    size = args.tensor_parallel_size * args.pipeline_parallel_size
    ranks = list(range(1, size)) if ranks is None else list(ranks)
    env = {**os.environ, **rendezvous.worker_env()}
    processes = [
        subprocess.Popen(
            worker_argv(args, model_dir=model_dir, rank=rank, init_method=init_method, loopback=rendezvous.loopback),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        for rank in ranks
    ]
    log.info("started parallel worker rank(s) %s: pids %s", ranks, [p.pid for p in processes])
    return Workers(processes, ranks=ranks, on_death=on_death)
