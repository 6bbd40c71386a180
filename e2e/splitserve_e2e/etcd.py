"""etcd for the local API server.

A single member on loopback with a data directory in the cluster's state directory. It is
Debian's etcd-server (3.4); kube-apiserver 1.34 talks to it over the v3 API (it notes that
etcd 3.4.23 lacks RequestWatchProgress and falls back to reading lists from etcd). Health is read
from etcd's own ``/health`` endpoint before the API server starts, so an etcd failure is
reported as such instead of as an API server timeout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx

from splitserve_e2e.net import LOOPBACK, free_port
from splitserve_e2e.process import ManagedProcess, start_process, wait_until


@dataclasses.dataclass
class Etcd:
    process: ManagedProcess
    client_url: str


def _healthy(client_url: str) -> bool:
    response = httpx.get(f"{client_url}/health", timeout=1.0)
    return response.status_code == 200 and response.json().get("health") == "true"


def start_etcd(*, binary: Path, data_dir: Path, log_dir: Path, pid_dir: Path,
               timeout_seconds: float = 60.0) -> Etcd:
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
        # etcd 3.4 lacks the RequestWatchProgress fix kube-apiserver >= 1.31 looks for, so the
        # watch cache only learns that an idle resource is current from periodic progress
        # notifications; the default 10m would stall watches of idle resources.
        "--experimental-watch-progress-notify-interval=2s",
        "--quota-backend-bytes=2147483648",
    ]
    process = start_process(name="etcd", argv=argv, log_path=log_dir / "etcd.log", pid_dir=pid_dir)
    wait_until(lambda: _healthy(client_url), timeout_seconds=timeout_seconds,
               what="etcd /health", alive=process)
    return Etcd(process=process, client_url=client_url)
