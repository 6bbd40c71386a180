"""Starting the worker ranks and taking the server down when one dies.

The serving process is rank 0; it starts ranks 1..N-1 as child processes. A child that exits
while the server runs leaves rank 0 waiting in a collective that can never complete, so a
supervisor thread watches the children and ends the server process with a non-zero status
within a poll interval: the kubelet restarts the pod rather than leave it hung and Ready.
The other way round, each worker watches its parent (:func:`~.worker.exit_with_parent`), so a
server that dies, however it dies, takes its workers with it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from splitserve_contract import ServeArgs

from ...termination import write_termination_message
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
    """The worker ranks of one server and their supervisor."""

    def __init__(self, processes: list[subprocess.Popen[bytes]], *,
                 on_death: Callable[[int, int], None] | None = None) -> None:
        self.processes = processes
        self._stopping = threading.Event()
        self._on_death = on_death or _exit_server
        self._thread = threading.Thread(target=self._watch, name="tp-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_SECONDS):
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None and not self._stopping.is_set():
                    self._on_death(rank, code)
                    return

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


def _exit_server(rank: int, code: int) -> None:
    message = (f"parallel worker rank {rank} exited with status {code}: the server stops "
               f"(the model cannot run without every rank)")
    log.critical("%s", message)
    write_termination_message(message)
    logging.shutdown()
    os._exit(WORKER_EXIT_STATUS)


def start_workers(args: ServeArgs, *, model_dir: Path, init_method: str,
                  on_death: Callable[[int, int], None] | None = None) -> Workers:
    """Start ranks 1..size-1 of ``args.tensor_parallel_size × args.pipeline_parallel_size``;
    they join at ``init_method``."""
    size = args.tensor_parallel_size * args.pipeline_parallel_size
    processes = [
        subprocess.Popen(worker_argv(args, model_dir=model_dir, rank=rank, init_method=init_method),
                         stdin=subprocess.DEVNULL)
        for rank in range(1, size)
    ]
    log.info("started %d parallel worker rank(s): pids %s", len(processes), [p.pid for p in processes])
    return Workers(processes, on_death=on_death)
