"""How the driver ends its process when the parallel group breaks, naming the cause.

A broken group shows first as a symptom (a collective or a ping that fails because a peer's
connection closed, a heartbeat that stopped), and its cause (a rank that died, in this pod or
in another) usually arrives a moment later by another path: the supervisor's next poll, a
worker pod's report in the group's store. The termination message should name the cause, so
a symptom waits a short grace for one before the process exits; either way it exits, with
:data:`~.launcher.WORKER_EXIT_STATUS`, and tells the other pods why (:meth:`~.liveness.Heartbeat.report`).
"""

from __future__ import annotations

import time
from typing import NoReturn

from .launcher import Workers, exit_group, worker_died_message
from .liveness import Heartbeat

GRACE_SECONDS = 1.0


class GroupFailure:
    """The driver's way out; ``workers`` and ``heartbeat`` are attached as they come up."""

    def __init__(self, *, grace_s: float = GRACE_SECONDS) -> None:
        self.workers: Workers | None = None
        self.heartbeat: Heartbeat | None = None
        self._grace_s = grace_s

    def worker_died(self, rank: int, code: int) -> None:
        """The supervisor's callback: a rank of this pod exited."""
        self._exit(worker_died_message(rank, code))

    def __call__(self, symptom: str) -> NoReturn:
        """The group broke (``symptom``): exit, naming the cause if it shows within the grace."""
        deadline = time.monotonic() + self._grace_s
        while True:
            cause = self._cause()
            if cause is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self._exit(cause or f"the parallel group broke: {symptom}")

    def _cause(self) -> str | None:
        death = self.workers.first_death() if self.workers is not None else None
        if death is not None:
            return worker_died_message(*death)
        reported = self.heartbeat.failure() if self.heartbeat is not None else None
        return f"the group failed: {reported}" if reported is not None else None

    def _exit(self, message: str) -> NoReturn:
        if self.heartbeat is not None:
            self.heartbeat.report(f"leader: {message}")
        exit_group(message)
