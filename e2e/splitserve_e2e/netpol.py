"""NetworkPolicy enforcement on the kubelet node: kube-router's network policy controller.

The operator renders NetworkPolicies for every InferenceService (deny ingress to all its pods,
then allow-lists: the router open on the HTTP port, prefill and decode pods reachable only from
their router, each other and monitoring namespaces). The API server stores a NetworkPolicy but
enforces nothing; a network plugin does. Without one, a pod in any namespace reaches the prefill
pod's HTTP and KV ports, and the e2e suite could not tell a right policy from a wrong or missing
one. So the node runs an enforcer, as the other node components, as a host process:

kube-router (:data:`splitserve_e2e.build.KUBE_ROUTER_VERSION`) with only its firewall
(``--run-firewall``; no routing, no service proxy, no CNI: the bridge plugin and kube-proxy stay
in charge). It watches pods, namespaces and NetworkPolicies through the API (the harness's admin
kubeconfig, as CoreDNS) and writes iptables chains and ipsets for the pods whose ``hostIP`` is
the node's address: ``KUBE-ROUTER-FORWARD`` (jumped to from ``FORWARD``) sends traffic to and
from each local pod through its ``KUBE-POD-FW-*`` chain, bridged traffic included (``physdev``;
the node sets ``net.bridge.bridge-nf-call-iptables=1``), where what no policy admits is
rejected. Traffic from the node itself (``addrtype --src-type LOCAL``: the kubelet's probes,
the API server's webhook calls, tests on the host, Prometheus on the gateway) is accepted, as
on any cluster where host-network components reach pods.

Why kube-router: the first choice, SIG Network's ``sigs.k8s.io/kube-network-policies``, hands
packets to user space with nftables' ``queue`` statement, which this machine's kernel lacks
(``CONFIG_NFT_QUEUE`` unset; ``nft add rule inet t c ... queue num 100 bypass`` answers
"Error: No such file or directory"); kube-router needs only iptables (``nf_tables`` backend,
with the xtables matches ``physdev``, ``set``, ``mark``, ``conntrack``, ``addrtype``,
``comment`` and ``NFLOG``/``REJECT``) and ipset, which the kernel has.

:func:`start_network_policy_agent` returns once kube-router has installed its top-level chain and
finished one full sync (its log line ``sync iptables took``). Its chains start with ``KUBE-``
and are removed with kube-proxy's at the node's stop (:func:`splitserve_e2e.nodehost.
remove_iptables_chains`); :func:`remove_ipsets` destroys its sets afterwards.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import time
from pathlib import Path
from typing import Final

from splitserve_e2e.process import ManagedProcess, start_process, wait_until

FORWARD_CHAIN: Final = "KUBE-ROUTER-FORWARD"
"""kube-router's chain for forwarded (pod) traffic; ``FORWARD`` jumps to it."""
IPSET_PREFIXES: Final = ("KUBE-SRC-", "KUBE-DST-")
"""The ipsets kube-router's policy controller creates (per policy: sources, destinations)."""
_SYNCED_LINE: Final = "sync iptables took"


@dataclasses.dataclass
class NetworkPolicyAgent:
    """The running enforcer and how long it took to be in force."""

    process: ManagedProcess
    ready_seconds: float


def missing_prerequisites() -> list[str]:
    """What kube-router's policy controller needs on the host and lacks (empty: nothing)."""
    return [tool for tool in ("iptables", "iptables-save", "iptables-restore", "ipset") if shutil.which(tool) is None]


def forward_chain_installed() -> bool:
    """True when the filter table's ``FORWARD`` chain jumps to :data:`FORWARD_CHAIN`."""
    listing = subprocess.run(
        ["iptables", "-w", "-t", "filter", "-S", "FORWARD"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return any(line.startswith("-A FORWARD") and f"-j {FORWARD_CHAIN}" in line for line in listing.splitlines())


def argv(*, binary: Path, kubeconfig: Path, node_name: str, service_cidr: str) -> list[str]:
    """kube-router with only its network policy controller, for the node ``node_name``."""
    return [
        str(binary),
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--enable-cni=false",
        "--enable-ipv4=true",
        "--enable-ipv6=false",
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        f"--service-cluster-ip-range={service_cidr}",
        # no listeners: health and metrics would bind every address of a shared machine
        "--health-port=0",
        "--metrics-port=0",
        "--v=1",
    ]


def start_network_policy_agent(
    *,
    binary: Path,
    kubeconfig: Path,
    node_name: str,
    service_cidr: str,
    log_dir: Path,
    pid_dir: Path,
    timeout_seconds: float = 60.0,
) -> NetworkPolicyAgent:
    """Start kube-router's policy controller; return once its ``FORWARD`` jump is in place
    and one full sync has finished (the Node ``node_name`` must exist, with an InternalIP)."""
    missing = missing_prerequisites()
    if missing:
        raise RuntimeError(
            f"the NetworkPolicy enforcer (kube-router) needs {missing} (Debian packages iptables, ipset)"
        )
    log_path = log_dir / "kube-router.log"
    offset = log_path.stat().st_size if log_path.is_file() else 0
    started = time.monotonic()
    process = start_process(
        name="kube-router",
        argv=argv(binary=binary, kubeconfig=kubeconfig, node_name=node_name, service_cidr=service_cidr),
        log_path=log_path,
        pid_dir=pid_dir,
    )

    def synced() -> bool:
        with log_path.open("rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
        return _SYNCED_LINE in text and forward_chain_installed()

    try:
        wait_until(
            synced,
            timeout_seconds=timeout_seconds,
            alive=process,
            what="kube-router's NetworkPolicy chains in force",
            interval_seconds=0.25,
        )
    except BaseException:
        process.stop(grace_seconds=5.0)
        raise
    return NetworkPolicyAgent(process=process, ready_seconds=time.monotonic() - started)


def remove_ipsets(prefixes: tuple[str, ...] = IPSET_PREFIXES) -> list[str]:
    """Destroy the ipsets named ``prefix...`` (after the iptables rules that use them are
    gone: a set in use cannot be destroyed); returns the names destroyed."""
    if shutil.which("ipset") is None:
        return []
    names = subprocess.run(
        ["ipset", "list", "-n"], capture_output=True, text=True, timeout=30, check=False
    ).stdout.split()
    destroyed = []
    for name in names:
        if name.startswith(prefixes):
            result = subprocess.run(["ipset", "destroy", name], capture_output=True, timeout=30, check=False)
            if result.returncode == 0:
                destroyed.append(name)
    return destroyed
