"""Pod networking of the kubelet node: one Linux bridge, a private subnet, nothing routed out.

containerd's CRI plugin creates each pod's network namespace and calls the CNI plugins of
Debian's containernetworking-plugins (``/usr/lib/cni``) with the conflist written here:
``bridge`` (host side ``splitserve0``, the host is the gateway) with ``host-local`` IPAM
(allocations kept in the node's directory) and ``portmap`` for hostPorts; containerd sets up
each pod's ``lo`` itself with the ``loopback`` plugin. There is no masquerading: pods reach the
host and each other and nothing else. Forwarding is on (the bridge plugin turns it on for the
gateway), so a FORWARD rule of our own drops pod traffic that would leave through any other
interface.

The bridge is created before the API server starts, because the API server advertises the
gateway address: that is how pods reach it through the ``kubernetes`` Service.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import subprocess
from pathlib import Path

BRIDGE = "splitserve0"
POD_SUBNET = "10.213.0.0/24"
NETWORK_NAME = "splitserve"
GUARD_CHAIN = "SPLITSERVE-NODE-FWD"
CNI_BIN_DIR = Path("/usr/lib/cni")


@dataclasses.dataclass(frozen=True)
class PodNetwork:
    """The pod subnet and its host-side gateway."""

    subnet: str = POD_SUBNET
    bridge: str = BRIDGE

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.subnet).hosts()))

    @property
    def prefix_length(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
    return result


def write_conflist(*, network: PodNetwork, conf_dir: Path, ipam_dir: Path) -> Path:
    """The CNI network list containerd loads (the only file in ``conf_dir``)."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": network.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ipam_dir),
                    "ranges": [[{"subnet": network.subnet, "gateway": network.gateway}]],
                    # service ClusterIPs are not on the bridge: route them via the host
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    path = conf_dir / "10-splitserve.conflist"
    path.write_text(json.dumps(document, indent=2))
    return path


def ensure_bridge(network: PodNetwork) -> None:
    """Create the bridge with the gateway address (the bridge plugin reuses it) and the
    FORWARD guard; idempotent."""
    if _run("ip", "link", "show", network.bridge, check=False).returncode != 0:
        _run("ip", "link", "add", network.bridge, "type", "bridge")
    address = f"{network.gateway}/{network.prefix_length}"
    if address not in _run("ip", "-o", "addr", "show", "dev", network.bridge).stdout:
        _run("ip", "addr", "add", address, "dev", network.bridge)
    _run("ip", "link", "set", network.bridge, "up")
    if _run("iptables", "-w", "-n", "-L", GUARD_CHAIN, check=False).returncode != 0:
        _run("iptables", "-w", "-N", GUARD_CHAIN)
    _run("iptables", "-w", "-F", GUARD_CHAIN)
    _run(
        "iptables",
        "-w",
        "-A",
        GUARD_CHAIN,
        "-s",
        network.subnet,
        "!",
        "-o",
        network.bridge,
        "-j",
        "DROP",
        "-m",
        "comment",
        "--comment",
        "splitserve pods stay on this machine",
    )
    jump = ("FORWARD", "-j", GUARD_CHAIN)
    if _run("iptables", "-w", "-C", *jump, check=False).returncode != 0:
        _run("iptables", "-w", "-I", *jump)


def remove_bridge(network: PodNetwork) -> None:
    """Delete the bridge and the guard chain (missing pieces are fine)."""
    _run("ip", "link", "del", network.bridge, check=False)
    while _run("iptables", "-w", "-D", "FORWARD", "-j", GUARD_CHAIN, check=False).returncode == 0:
        pass
    _run("iptables", "-w", "-F", GUARD_CHAIN, check=False)
    _run("iptables", "-w", "-X", GUARD_CHAIN, check=False)
