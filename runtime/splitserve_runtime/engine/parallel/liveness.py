"""Liveness across the pods of one group: heartbeats and failure reports in the group's store.

Inside one pod a dead rank is a dead child process (:class:`~.launcher.Workers` sees it) and a
dead server takes its children with it (:func:`~.worker.exit_with_parent`). Across pods
neither holds: a killed process closes its connections, which the next collective notices (the
driver pings an idle group, :class:`~.runner.ParallelRunner`), but a pod on a lost node or
behind a partition closes nothing, and a collective would wait for its full timeout while the
pod stays Ready. So every pod's supervising process (the leader's server, each worker pod's
agent) beats a counter in the group's ``TCPStore`` (on the leader) once a second and watches
the counters of the pods it depends on: the leader every worker pod, a worker pod the leader.
A counter that stops moving for :data:`PEER_TIMEOUT_SECONDS`, or a store that stops answering,
ends the watching process with a non-zero status; the LeaderWorkerSet then recreates the group.
A pod that sees one of its ranks die writes why into the store first (:meth:`Heartbeat.report`),
so every pod's termination message names the rank that failed, not just the symptom.

Each heartbeat has its own store connection (the ranks' connection stays theirs) with short
timeouts, and joins without counting as a rank.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from torch._C._distributed_c10d import Store, TCPStore

log = logging.getLogger(__name__)

BEAT_SECONDS = 1.0
PEER_TIMEOUT_SECONDS = 10.0
"""A pod whose beat has not moved for this long is gone."""
STORE_TIMEOUT = datetime.timedelta(seconds=5)
LEADER_WAIT_SECONDS = 600.0
"""How long a worker pod waits for its leader's store to accept connections (the leader's
image may still be pulling)."""

KEY_PREFIX = "splitserve/"
FAILURE_KEY = KEY_PREFIX + "failure"


def beat_key(node: int) -> str:
    return f"{KEY_PREFIX}beat/{node}"


def ready_key(rank: int) -> str:
    return f"{KEY_PREFIX}ready/{rank}"


def mark_ready(store: Store, rank: int) -> None:
    """A rank has loaded its part and serves the driver's messages."""
    store.set(ready_key(rank), "1")


def connect(host: str, port: int) -> TCPStore:
    """A store client that is not a rank (does not count towards the group's size)."""
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=STORE_TIMEOUT)


def wait_for_leader(host: str, port: int, *, timeout_s: float = LEADER_WAIT_SECONDS, log_every_s: float = 10.0) -> None:
    """Return once ``host:port`` accepts TCP connections; retry (the name may not resolve yet:
    the leader pod and its DNS record come and go with the group) with a log line every
    ``log_every_s``; raise :class:`TimeoutError` after ``timeout_s``."""
    started = time.monotonic()
    last_log = started
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                log.info("the group's leader %s:%d answers (after %.1f s)", host, port, time.monotonic() - started)
                return
        except OSError as exc:
            error = exc
        now = time.monotonic()
        if now - started >= timeout_s:
            raise TimeoutError(
                f"the group's leader {host}:{port} did not accept connections within "
                f"{timeout_s:.0f} s (last error: {error}); is the leader pod running and "
                f"--rendezvous-port the same on every pod?"
            )
        if now - last_log >= log_every_s:
            last_log = now
            log.info("waiting for the group's leader at %s:%d (%.0f s so far): %s", host, port, now - started, error)
        time.sleep(min(0.5, max(0.0, timeout_s - (now - started))))


class Heartbeat:
    """Beat ``node``'s counter and watch ``peers``' counters in the group's store.

    ``on_lost(reason)`` is called once, from the heartbeat thread, when a peer's counter has
    not moved for ``peer_timeout_s``, when some pod reported a failure, or when the store
    fails. A peer is watched from the start (``wait_for_first_beat`` False: it is known to be
    up) or from its first beat on (True: the leader beats only after every rank has joined,
    which may take as long as the slowest pod takes to start)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        node: int,
        peers: Sequence[int],
        describe: Callable[[int], str],
        on_lost: Callable[[str], None],
        wait_for_first_beat: bool,
        beat_s: float = BEAT_SECONDS,
        peer_timeout_s: float = PEER_TIMEOUT_SECONDS,
    ) -> None:
        self.address = f"{host}:{port}"
        self.node = node
        self.peers = tuple(peers)
        self._describe = describe
        self._on_lost = on_lost
        self._wait_for_first_beat = wait_for_first_beat
        self._beat_s = beat_s
        self._peer_timeout_s = peer_timeout_s
        self._store = connect(host, port)
        self._lock = threading.Lock()  # one store request at a time on this connection
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    # ------------------------------------------------------------------ store requests
    def _beat(self) -> None:
        with self._lock:
            self._store.add(beat_key(self.node), 1)

    def _counters(self) -> list[int]:
        with self._lock:
            return [self._store.add(beat_key(peer), 0) for peer in self.peers]

    def failure(self) -> str | None:
        """The failure some pod of the group reported, if any."""
        try:
            with self._lock:
                if not self._store.check([FAILURE_KEY]):
                    return None
                return self._store.get(FAILURE_KEY).decode("utf-8", "replace")
        except RuntimeError:
            return None

    def report(self, message: str) -> None:
        """Tell the other pods why this one stops (best effort: the store may be gone)."""
        try:
            with self._lock:
                if not self._store.check([FAILURE_KEY]):  # the first report is the cause
                    self._store.set(FAILURE_KEY, message)
        except RuntimeError as exc:
            log.warning("could not report the failure to the group's store: %s", exc)

    def ready(self, ranks: Sequence[int]) -> bool:
        """Whether every one of ``ranks`` has marked itself ready (:func:`mark_ready`)."""
        with self._lock:
            return bool(self._store.check([ready_key(rank) for rank in ranks]))

    # ------------------------------------------------------------------ the watch
    def _run(self) -> None:
        started = time.monotonic()
        last: dict[int, tuple[int, float]] = {peer: (0, started) for peer in self.peers}
        while not self._stopping.wait(self._beat_s):
            try:
                self._beat()
                counters = self._counters()
                reported = self.failure()
            except RuntimeError as exc:
                self._lose(f"the group's store at {self.address} failed ({exc}): the leader is gone")
                return
            if reported is not None:
                self._lose(f"the group failed: {reported}")
                return
            now = time.monotonic()
            for peer, counter in zip(self.peers, counters, strict=True):
                seen, since = last[peer]
                if counter != seen:
                    last[peer] = (counter, now)
                elif (counter or not self._wait_for_first_beat) and now - since > self._peer_timeout_s:
                    self._lose(
                        f"{self._describe(peer)} sent no heartbeat for {now - since:.0f} s "
                        f"(its node or network is down)"
                    )
                    return

    def _lose(self, reason: str) -> None:
        if not self._stopping.is_set():
            self._on_lost(reason)
