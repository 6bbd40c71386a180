"""etcd for the local API server.

A single member on loopback with a data directory in the cluster's state directory. It is
etcd 3.6 built from its Go module (see build.py for why not Debian's 3.4). The data is thrown
away with the cluster, so fsync is off (``--unsafe-no-fsync``): on a shared two-core machine
with a busy disk that keeps API writes fast. An etcd 3.4 binary (Debian's) still works for
callers that pass it: it gets frequent watch progress notifications instead, the closest it
has to what kube-apiserver's watch cache needs. Health is read
from etcd's own ``/health`` endpoint before the API server starts, so an etcd failure is
reported as such instead of as an API server timeout.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
from pathlib import Path

import httpx

from splitserve_e2e.net import LOOPBACK, free_port
from splitserve_e2e.process import ManagedProcess, start_process, wait_until


@dataclasses.dataclass
class Etcd:
    process: ManagedProcess
    client_url: str


@functools.lru_cache(maxsize=8)
def _minor_version(binary: Path) -> tuple[int, int]:
    """(major, minor) from ``etcd --version`` (first line ``etcd Version: 3.6.4``)."""
    output = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    match = re.search(r"etcd Version: (\d+)\.(\d+)", output)
    if match is None:
        raise RuntimeError(f"cannot read the version of {binary}: {output[:200]!r}")
    return int(match.group(1)), int(match.group(2))


def _version_flags(binary: Path) -> list[str]:
    if _minor_version(binary) >= (3, 5):
        return ["--unsafe-no-fsync"]
    return ["--experimental-watch-progress-notify-interval=2s"]


def _healthy(client_url: str) -> bool:
    response = httpx.get(f"{client_url}/health", timeout=1.0)
    return response.status_code == 200 and response.json().get("health") == "true"


def start_etcd(*, binary: Path, data_dir: Path, log_dir: Path, pid_dir: Path, timeout_seconds: float = 60.0) -> Etcd:
    """Start etcd and wait until it reports healthy."""
    client_port, peer_port = free_port(), free_port()
    client_url = f"http://{LOOPBACK}:{client_port}"
    peer_url = f"http://{LOOPBACK}:{peer_port}"
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(binary),
        "--name=splitserve-e2e",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=splitserve-e2e={peer_url}",
        "--initial-cluster-state=new",
        "--logger=zap",
        "--log-level=warn",
        "--snapshot-count=10000",
        *_version_flags(binary),
        "--quota-backend-bytes=2147483648",
    ]
    process = start_process(name="etcd", argv=argv, log_path=log_dir / "etcd.log", pid_dir=pid_dir)
    wait_until(lambda: _healthy(client_url), timeout_seconds=timeout_seconds, what="etcd /health", alive=process)
    return Etcd(process=process, client_url=client_url)
