"""A worker pod of a multi-pod group: its ranks, their supervisor and its heartbeat.

Node ``k > 0`` of a group (:mod:`.placement`) serves nothing itself: it starts its ``g`` ranks
as child processes at once (:mod:`.worker`; each waits for the leader's store, joins the group
there, loads its part and executes rank 0's messages), waits itself until the leader's store
answers (bounded, with a log line now and then: the leader pod may still be starting), starts
beating, and then supervises the ranks: a rank that dies
ends the pod with a non-zero status and a termination message naming it, after writing the
cause into the group's store for the other pods; a leader that stops beating (or whose store
or connections go away) ends it too (:mod:`.liveness`). Only when the leader stops the group
(a Stop message: its server drained and exited) do the ranks exit 0, and the pod with them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import NoReturn

from splitserve_contract import ServeArgs

from . import rendezvous
from .launcher import Workers, exit_group, start_workers
from .liveness import LEADER_WAIT_SECONDS, Heartbeat, wait_for_leader
from .placement import Placement, pin
from .worker import DRIVER_GONE_STATUS

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 2.0
"""How long a lost leader's ranks get to show they were told to stop (exit 0) first."""


@dataclasses.dataclass
class NodeStatus:
    """What the pod's health endpoints report (written here, read by the HTTP threads)."""

    alive: bool = True
    joined: bool = False
    """Every rank of this pod has loaded its part and serves the driver."""
    draining: bool = False
    detail: str = "starting"


def rank_exit_message(placement: Placement, rank: int, code: int) -> str:
    where = placement.describe_node(placement.node_of(rank))
    if code == DRIVER_GONE_STATUS:
        return f"{where}: parallel rank {rank} lost its connection to the leader (rank 0): the group is gone"
    return f"{where}: parallel rank {rank} exited with status {code}: the group cannot run without every rank"


def run_worker_node(
    args: ServeArgs,
    *,
    placement: Placement,
    model_dir: Path,
    status: NodeStatus,
    leader_wait_s: float = LEADER_WAIT_SECONDS,
) -> int:
    """Run this pod's ranks until the leader stops them (returns 0); a failure ends the process
    (:func:`~.launcher.exit_group`)."""
    if placement.is_leader:
        raise ValueError("the leader pod runs the server, not a worker node")
    host, port = placement.leader_address, placement.rendezvous_port
    me = placement.describe_node(placement.node_rank)
    stopped = threading.Event()
    workers: Workers | None = None
    heartbeat: Heartbeat | None = None

    def fail(message: str) -> NoReturn:
        status.alive = False
        if heartbeat is not None:
            heartbeat.report(message)
        if workers is not None:
            workers.kill()
        exit_group(message)

    def on_death(rank: int, code: int) -> None:
        if code == 0:  # rank 0 sent Stop: the group is shutting down
            stopped.set()
            return
        fail(rank_exit_message(placement, rank, code))

    def on_lost(reason: str) -> None:
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while workers is not None and time.monotonic() < deadline:
            death = workers.first_death()
            if death is not None and death[1] == 0:
                stopped.set()
                return
            time.sleep(0.05)
        fail(f"{me}: {reason}")

    meeting = rendezvous.multinode(args, placement)  # refuses a keyless group beyond loopback
    workers = start_workers(
        pin(args, placement),
        model_dir=model_dir,
        init_method=placement.init_method(),
        rendezvous=meeting,
        ranks=placement.local_ranks,
        on_death=on_death,
    )
    status.detail = f"waiting for the group's leader at {host}:{port}"
    log.info("%s of a %d-pod group: %s", me, placement.nnodes, status.detail)
    try:
        wait_for_leader(host, port, timeout_s=leader_wait_s)
        heartbeat = Heartbeat(
            host=host,
            port=port,
            node=placement.node_rank,
            peers=[0],
            describe=placement.describe_node,
            on_lost=on_lost,
            wait_for_first_beat=True,
        ).start()
    except BaseException:
        workers.kill()
        raise
    status.detail = f"ranks {list(placement.local_ranks)} joining the group"
    while not stopped.wait(0.2):
        if not status.joined and _ready(heartbeat, placement):
            status.joined = True
            status.detail = "joined"
            log.info("%s joined the group: every rank loaded", me)
    log.info("%s: the leader stopped the group", me)
    heartbeat.stop()
    workers.stop()
    codes = [process.returncode for process in workers.processes]
    return 0 if all(code == 0 for code in codes) else 1


def _ready(heartbeat: Heartbeat, placement: Placement) -> bool:
    try:
        return heartbeat.ready(placement.local_ranks)
    except RuntimeError:
        return False  # the heartbeat thread deals with a failing store
