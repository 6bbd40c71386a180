"""Signal every process of a container, to wedge it (SIGSTOP) and let it go on (SIGCONT).

A container's main process is tini (PID 1 inside it, :meth:`LocalCluster.container_pid`), and
the server is tini's child: SIGSTOP to tini alone stops nothing that serves (a stopped process
passes no signal on, and tini never sees its child as stopped). A pod that accepts connections
and answers nothing, as a process stuck on a lock or a GPU hang does, needs the whole process
tree stopped: the kernel still completes TCP handshakes into the listening socket's backlog,
so clients connect and then wait. Reading the tree from ``/proc`` (each process's parent) needs
no cgroup layout, which differs between cgroup v1 and v2 hosts.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now visible in ``/proc``."""
    out: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we read
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; it ends at the last ")"
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(entry.name)] = int(fields[1])
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, parents before children (empty when ``root`` is gone)."""
    parents = _parents()
    if root not in parents:
        return []
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        tree.append(pid)
        queue.extend(sorted(children.get(pid, [])))
    return tree


def signal_tree(root: int, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to ``root`` and every descendant; for SIGSTOP, again to any process forked
    while the tree was being stopped, until a pass finds none new. The pids signalled."""
    done: set[int] = set()
    while True:
        fresh = [pid for pid in process_tree(root) if pid not in done]
        if not fresh:
            return sorted(done)
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            done.add(pid)
        if sig is not signal.SIGSTOP:
            return sorted(done)


@contextlib.contextmanager
def stopped(root: int) -> Iterator[list[int]]:
    """Every process of the tree under ``root`` stopped (SIGSTOP) inside the block, and
    continued (SIGCONT) when it ends, also on an error (a test that failed must not leave a
    pod wedged for the next one). Yields the pids stopped."""
    pids = signal_tree(root, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
