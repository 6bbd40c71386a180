"""Child processes that never outlive the harness.

Every component (etcd, the API server, the kubelet, containerd, ...) starts in its own
session, so one ``killpg`` ends it together with anything it forked. Three layers make sure no
orphan survives a failed or interrupted test run:

* ``setpriv --pdeathsig KILL`` (util-linux) makes the kernel kill the child when the thread that
  started it dies, even on SIGKILL of the harness;
* a pid file per process (pid, start time from ``/proc``) lets ``python -m splitserve_e2e down``
  from another shell, or the next start on the same state directory, end stale processes
  without ever signalling an unrelated process that reused the pid;
* :meth:`ManagedProcess.stop` sends SIGTERM to the group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_SETPRIV = shutil.which("setpriv")


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces; fields after the last ')' are fixed
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@dataclasses.dataclass
class ManagedProcess:
    """One child process group with its log file and pid file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    pid_file: Path | None
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    die_with_parent: bool = True

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, *, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self, *, grace_seconds: float = 5.0) -> int | None:
        """SIGTERM the group, SIGKILL it after ``grace_seconds``; returns the exit code."""
        if self.popen.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_seconds)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        # leftovers of the group (children that ignored SIGTERM) go too
        _signal_group(self.pid, signal.SIGKILL)
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)
        return self.popen.returncode

    def restart(self, *, grace_seconds: float = 5.0) -> ManagedProcess:
        """Stop the group and start the same command again (same log, same pid file): a
        component restart, as chaos tests do to the API server or Prometheus."""
        if not self.argv:
            raise RuntimeError(f"{self.name}: started without its argv, cannot restart")
        self.stop(grace_seconds=grace_seconds)
        return start_process(
            name=self.name,
            argv=self.argv,
            log_path=self.log_path,
            pid_dir=self.pid_file.parent if self.pid_file is not None else None,
            env=self.env,
            cwd=self.cwd,
            die_with_parent=self.die_with_parent,
        )


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def start_process(
    *,
    name: str,
    argv: Sequence[str],
    log_path: Path,
    pid_dir: Path | None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = True,
) -> ManagedProcess:
    """Start ``argv`` in a new session, stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = list(argv)
    if die_with_parent and _SETPRIV is not None:
        command = [_SETPRIV, "--pdeathsig", "KILL", "--", *command]
    with log_path.open("ab") as log_file:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    pid_file = None
    if pid_dir is not None:
        pid_dir.mkdir(parents=True, exist_ok=True)
        pid_file = pid_dir / f"{name}.pid"
        pid_file.write_text(
            json.dumps(
                {
                    "pid": popen.pid,
                    "start_ticks": process_start_ticks(popen.pid),
                    "argv0": argv[0],
                    "name": name,
                }
            )
        )
    return ManagedProcess(
        name=name,
        popen=popen,
        log_path=log_path,
        pid_file=pid_file,
        argv=tuple(argv),
        env=env,
        cwd=cwd,
        die_with_parent=die_with_parent,
    )


def kill_recorded(*, pid_dir: Path, grace_seconds: float = 5.0) -> list[str]:
    """End every process group recorded in ``pid_dir`` whose pid still names the same process.

    Used by ``down`` from another shell and before a start on a state directory that a killed
    run left behind. Returns the names of the groups that were still running.
    """
    if not pid_dir.is_dir():
        return []
    live: list[tuple[str, int]] = []
    for pid_file in sorted(pid_dir.glob("*.pid")):
        try:
            record = json.loads(pid_file.read_text())
            pid, ticks = int(record["pid"]), record.get("start_ticks")
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            pid_file.unlink(missing_ok=True)
            continue
        if is_alive(pid) and process_start_ticks(pid) == ticks:
            live.append((str(record.get("name", pid_file.stem)), pid))
            _signal_group(pid, signal.SIGTERM)
        pid_file.unlink(missing_ok=True)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and any(is_alive(pid) for _, pid in live):
        time.sleep(0.1)
    for _, pid in live:
        _signal_group(pid, signal.SIGKILL)
    return [name for name, _ in live]


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_seconds: float,
    what: str,
    interval_seconds: float = 0.2,
    alive: ManagedProcess | None = None,
) -> None:
    """Poll ``predicate`` until true; raise TimeoutError naming ``what`` (and the log of
    ``alive`` when that process exited or the wait timed out)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - any failure means "not yet"
            pass
        if alive is not None and not alive.running():
            raise RuntimeError(
                f"{alive.name} exited with code {alive.popen.returncode} while "
                f"waiting for {what}; log {alive.log_path}:\n{alive.log_tail()}"
            )
        if time.monotonic() > deadline:
            tail = f"; log {alive.log_path}:\n{alive.log_tail()}" if alive is not None else ""
            raise TimeoutError(f"timed out after {timeout_seconds:.0f}s waiting for {what}{tail}")
        time.sleep(interval_seconds)
