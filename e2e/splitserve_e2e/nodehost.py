"""Host state the kubelet node touches, and how to give it back.

A real kubelet changes the machine outside its own files: pods live in cgroups, their volumes,
root filesystems and network namespaces are mounts, and kubelet, kube-proxy and the CNI bridge
plugin set sysctls. Teardown must undo all of it even after a SIGKILLed run, on a machine that
other test sessions share, so everything is scoped:

* one cgroup subtree ``/<CGROUP_ROOT>`` in every cgroup v1 hierarchy holds containerd (and with
  it every shim) and, as the kubelet's ``cgroupRoot``, every pod: killing the pids found there
  ends all of them, whatever session they started;
* every mount lives under the node's directory and is lazily unmounted from the deepest up;
* the sysctls are recorded before the start and written back at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = "splitserve-kubelet"
_CGROUP_FS = Path("/sys/fs/cgroup")
# what kubelet (setupKernelTunables), kube-proxy and the bridge plugin (isGateway) may change
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
)


def cgroup_v1_hierarchies() -> list[Path]:
    """Mount points of the cgroup v1 hierarchies (``cpu``, ``memory``, ``name=systemd``...)."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup":
            out.append(Path(left.split()[4]))
    return sorted(out)


def is_cgroup_v1() -> bool:
    return not (_CGROUP_FS / "cgroup.controllers").is_file() and bool(cgroup_v1_hierarchies())


def make_cgroup(relative: str) -> list[Path]:
    """Create ``/<relative>`` in every v1 hierarchy (cpuset needs its cpus/mems copied)."""
    created = []
    for hierarchy in cgroup_v1_hierarchies():
        path = hierarchy
        for part in Path(relative).parts:
            parent, path = path, path / part
            if not path.is_dir():
                path.mkdir()
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if (parent / name).is_file() and not (path / name).read_text().strip():
                        (path / name).write_text((parent / name).read_text())
        created.append(path)
    return created


def cgroup_wrapper(relative: str) -> list[str]:
    """A command prefix that joins ``/<relative>`` in every hierarchy, then execs the rest."""
    directories = [str(path) for path in make_cgroup(relative)]
    script = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 1; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "cgroup-wrapper", *directories, "--"]


def _pids_in(relative: str) -> set[int]:
    pids: set[int] = set()
    for hierarchy in cgroup_v1_hierarchies():
        root = hierarchy / relative
        if not root.is_dir():
            continue
        for procs in root.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
    pids.discard(os.getpid())
    return pids


def kill_cgroup_tree(relative: str = CGROUP_ROOT, *, timeout_seconds: float = 20.0) -> int:
    """SIGKILL every process under ``/<relative>`` until none is left, then remove the
    cgroups; returns how many processes were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_seconds
    while pids := _pids_in(relative):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} survive SIGKILL in /{relative}")
        time.sleep(0.1)
    for hierarchy in cgroup_v1_hierarchies():
        root = hierarchy / relative
        if not root.is_dir():
            continue
        for directory in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            root.rmdir()
    return len(killed)


def mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below ``directory``, deepest first."""
    prefix = str(directory.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(Path(point))
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def unmount_under(directory: Path) -> list[Path]:
    """Lazily unmount everything at or below ``directory``; returns what was mounted."""
    points = mounts_under(directory)
    for point in points:
        subprocess.run(["umount", "--lazy", str(point)], capture_output=True, check=False, timeout=30)
    return points


def record_sysctls(path: Path) -> None:
    """Write the current values of :data:`SYSCTLS` to ``path`` (kept if already there: the
    first record of a run that was killed holds the machine's own values)."""
    if path.is_file():
        return
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = (Path("/proc/sys") / name).read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values, indent=2))


def restore_sysctls(path: Path) -> None:
    """Write back what :func:`record_sysctls` recorded, then forget the record."""
    if not path.is_file():
        return
    for name, value in json.loads(path.read_text()).items():
        with contextlib.suppress(OSError):
            (Path("/proc/sys") / name).write_text(value)
    path.unlink()


def remove_iptables_chains(prefix: str = "KUBE-") -> None:
    """Delete every rule that jumps to a chain named ``prefix...`` and those chains, in the
    filter, nat and mangle tables of iptables and ip6tables: the kubelet's own chains
    (KUBE-FIREWALL, canaries) that ``kube-proxy --cleanup`` leaves behind."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            listing = subprocess.run(
                [tool, "-w", "-t", table, "-S"], capture_output=True, text=True, timeout=30, check=False
            ).stdout.splitlines()
            chains = [
                line.split()[1] for line in listing if line.startswith("-N ") and line.split()[1].startswith(prefix)
            ]
            for line in listing:
                words = shlex.split(line)
                if (
                    words[:1] == ["-A"]
                    and not words[1].startswith(prefix)
                    and "-j" in words
                    and words[words.index("-j") + 1].startswith(prefix)
                ):
                    subprocess.run(
                        [tool, "-w", "-t", table, "-D", *words[1:]], capture_output=True, timeout=30, check=False
                    )
            for flag in ("-F", "-X"):
                for chain in chains:
                    subprocess.run([tool, "-w", "-t", table, flag, chain], capture_output=True, timeout=30, check=False)
