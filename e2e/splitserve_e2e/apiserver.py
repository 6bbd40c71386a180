"""kube-apiserver on loopback with TLS, client-certificate auth, ServiceAccount tokens and RBAC.

The flags mirror a production control plane where it matters to the tests (authorization
``Node,RBAC``, the default admission plugins, bound ServiceAccount tokens with a real issuer)
and are frugal elsewhere: no profiling, no API priority and fairness, no endpoint reconciler for
the ``kubernetes`` Service (its address would be loopback), because this runs on two shared
cores.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx

from splitserve_e2e.net import LOOPBACK, free_port
from splitserve_e2e.pki import ClusterPki, client_ssl_context
from splitserve_e2e.process import ManagedProcess, start_process, wait_until

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclasses.dataclass
class ApiServer:
    process: ManagedProcess
    url: str


def readyz_ok(*, url: str, pki: ClusterPki) -> bool:
    """True when ``/readyz`` of the API server at ``url`` answers ``ok``."""
    context = client_ssl_context(ca_cert=pki.ca_cert, client=pki.admin)
    response = httpx.get(f"{url}/readyz", verify=context, timeout=2.0)
    return response.status_code == 200 and response.text.strip() == "ok"


def start_apiserver(
    *,
    binary: Path,
    etcd_url: str,
    pki: ClusterPki,
    log_dir: Path,
    pid_dir: Path,
    timeout_seconds: float = 120.0,
    pod_reachable_address: str | None = None,
) -> ApiServer:
    """Start kube-apiserver against ``etcd_url`` and wait for ``/readyz``.

    ``pod_reachable_address`` (the kubelet node's bridge gateway) makes pods able to reach it:
    it then listens on all addresses, advertises that one as the ``kubernetes`` Service's
    endpoint (lease reconciler) and presents the admin certificate to kubelets (logs, exec).
    Without it, everything stays on loopback as before.
    """
    port = free_port()
    url = f"https://{LOOPBACK}:{port}"
    argv = [
        str(binary),
        f"--etcd-servers={etcd_url}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca_cert}",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        "--endpoint-reconciler-type=none",
        "--enable-priority-and-fairness=false",
        "--profiling=false",
        "--event-ttl=30m",
        f"--cert-dir={log_dir.parent / 'apiserver-certs'}",
        "--v=1",
    ]
    if pod_reachable_address is not None:
        overrides = {
            "--bind-address": "0.0.0.0",
            "--advertise-address": pod_reachable_address,
            "--endpoint-reconciler-type": "lease",
            "--kubelet-client-certificate": str(pki.admin.cert),
            "--kubelet-client-key": str(pki.admin.key),
            "--kubelet-preferred-address-types": "InternalIP",
        }
        argv = [arg for arg in argv if arg.split("=", 1)[0] not in overrides]
        argv += [f"{flag}={value}" for flag, value in overrides.items()]
    process = start_process(name="kube-apiserver", argv=argv, log_path=log_dir / "kube-apiserver.log", pid_dir=pid_dir)
    wait_until(
        lambda: readyz_ok(url=url, pki=pki),
        timeout_seconds=timeout_seconds,
        what="kube-apiserver /readyz",
        alive=process,
        interval_seconds=0.5,
    )
    return ApiServer(process=process, url=url)
