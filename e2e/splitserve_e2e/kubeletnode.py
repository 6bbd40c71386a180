"""A real node in the local cluster: kubelet + containerd + CNI bridge + kube-proxy + DNS.

Pods must meet what a real cluster enforces: images, security contexts, memory limits,
Services. This node runs the pinned kubelet and
kube-proxy (v1.34.4, built like the control plane) against a private containerd
(:mod:`splitserve_e2e.containerd`) with a bridge network (:mod:`splitserve_e2e.cni`), so pods
run from OCI images in their own namespaces and cgroups, with the runtime's default seccomp
profile, OOM kills, restarts by the kubelet, ClusterIPs through kube-proxy's iptables rules,
and names through cluster DNS: CoreDNS (:mod:`splitserve_e2e.coredns`) on the bridge gateway,
which the kubelet's ``clusterDNS`` names, so pods resolve Services and headless-Service pod
hostnames (``<hostname>.<subdomain>.<ns>.svc.cluster.local``) as on any cluster.
NetworkPolicies are enforced (:mod:`splitserve_e2e.netpol`: kube-router's policy controller),
so a policy that admits too much or too little shows in the tests as on a real cluster.
The node is ``splitserve-kubelet``; it advertises ``nvidia.com/gpu`` as an extended resource
(patched into its status, as the Kubernetes docs describe) so GPU pods schedule onto it and run
on CPU.

It changes the host (cgroups, mounts, iptables, a bridge, sysctls), so only one may run per
machine: a lock file under the cache root serialises it, and :meth:`KubeletNode.stop` undoes
everything (see :mod:`splitserve_e2e.nodehost`), also what a killed earlier run left behind.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes import client as k8s

from splitserve_e2e import cni, netpol, nodehost, ociimage
from splitserve_e2e.apiserver import SERVICE_CIDR
from splitserve_e2e.build import NodeBinaries, cache_root, ensure_node_binaries
from splitserve_e2e.containerd import Containerd, ContainerdLayout, start_containerd, write_config
from splitserve_e2e.coredns import CLUSTER_DOMAIN, ClusterDns, start_coredns
from splitserve_e2e.kubeconfig import write_cert_kubeconfig
from splitserve_e2e.net import LOOPBACK, free_port, port_open
from splitserve_e2e.pki import CertPair, ClusterPki
from splitserve_e2e.process import ManagedProcess, start_process, wait_until

NODE_NAME = "splitserve-kubelet"
NODE_LABEL = "splitserve.dev/kubelet-node"
GPU_RESOURCE = "nvidia.com/gpu"
PAUSE_IMAGE = "splitserve.local/pause:1"
BUSYBOX_IMAGE = "splitserve.local/busybox:1"
MAX_SOCKET_PATH = 100  # sun_path is 108 bytes; the kubelet's deepest socket adds ~35


def _issue_client_cert(
    *, pki: ClusterPki, directory: Path, stem: str, common_name: str, organization: str | None
) -> CertPair:
    """A client certificate signed by the cluster CA (the node's and kube-proxy's identity)."""
    pair = CertPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    if pair.cert.is_file() and pair.key.is_file():
        return pair
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{pki.ca_key} is not an EC key")
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attributes))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    pair.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pair.key.chmod(0o600)
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def containerd_root_dir() -> Path:
    """Where the kubelet node's containerd keeps images across clusters (under the cache)."""
    return cache_root() / "containerd-root"


def node_ready(node: Any) -> bool:
    """True when the Node's Ready condition is True."""
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def allocatable(node: Any) -> dict[str, str]:
    """The Node's status.allocatable ({} when not reported yet)."""
    return dict(node.status.allocatable or {}) if node.status is not None else {}


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run the kubelet node (empty: nothing)."""
    missing = [tool for tool in ("containerd", "ctr", "runc", "iptables", "ip") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if not Path("/usr/lib/cni/bridge").is_file():
        missing.append("containernetworking-plugins")
    if not nodehost.is_cgroup_v1():
        missing.append("cgroup v1 hierarchies")
    return missing


class KubeletNode:
    """The kubelet node of one cluster: :meth:`prepare` before the API server starts (the
    bridge it advertises), :meth:`start` once the control plane answers, :meth:`stop`."""

    def __init__(
        self,
        *,
        directory: Path,
        pki: ClusterPki,
        api_client_factory: Callable[[], k8s.ApiClient],
        log_dir: Path,
        pid_dir: Path,
        num_gpus: int = 4,
        network: cni.PodNetwork | None = None,
        binaries: NodeBinaries | None = None,
        containerd_root: Path | None = None,
        network_policies: bool = True,
    ) -> None:
        """``containerd_root``: containerd's content store and snapshots (default
        :func:`containerd_root_dir`, shared by every cluster on the machine so that pulled
        images survive; the state, socket and mounts stay under ``directory``).
        ``network_policies``: run the NetworkPolicy enforcer (:mod:`splitserve_e2e.netpol`)."""
        self.directory = directory.resolve()
        self.containerd_root = (containerd_root or containerd_root_dir()).resolve()
        longest = self.directory / "kubelet" / "device-plugins" / "kubelet.sock"
        if len(str(longest)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"{self.directory} is too long for the kubelet's unix sockets "
                f"({len(str(longest))} > {MAX_SOCKET_PATH} characters)"
            )
        self.network = network or cni.PodNetwork()
        self.num_gpus = num_gpus
        self.ready_seconds = 0.0
        self.dns: ClusterDns | None = None
        self.dns_ready_seconds = 0.0
        """CoreDNS start to /ready seen (it starts first and syncs while the node comes up,
        so this is at least the node's own start)."""
        self.dns_wait_seconds = 0.0
        """What waiting for CoreDNS added to the node start (after the node was Ready)."""
        self.network_policies = network_policies
        self.network_policy_agent: netpol.NetworkPolicyAgent | None = None
        """kube-router's policy controller once in force (None: not enforced)."""
        self._pki = pki
        self._api_client_factory = api_client_factory
        self._log_dir = log_dir
        self._pid_dir = pid_dir
        self._binaries = binaries
        self._lock: IO[str] | None = None
        self._containerd: Containerd | None = None
        self._processes: list[ManagedProcess] = []
        self._host_state = cache_root() / "kubelet-node"
        self.healthz_port = 0
        self.kubelet_port = 0
        self.proxy_healthz_port = 0

    @property
    def name(self) -> str:
        return NODE_NAME

    @property
    def containerd(self) -> Containerd:
        if self._containerd is None:
            raise RuntimeError("the kubelet node is not started")
        return self._containerd

    # ------------------------------------------------------------------ lifecycle
    def prepare(self, *, lock_timeout_seconds: float = 900.0) -> None:
        """Take the machine-wide lock (waiting for another session's node to end), clean up
        after a killed run, create the bridge."""
        if not nodehost.is_cgroup_v1():
            raise RuntimeError("the kubelet node is only set up for cgroup v1 hierarchies")
        self._host_state.mkdir(parents=True, exist_ok=True)
        lock = (self._host_state / "lock").open("w")
        deadline = time.monotonic() + lock_timeout_seconds
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    raise RuntimeError(
                        f"another kubelet node still runs on this machine after "
                        f"{lock_timeout_seconds:.0f}s (lock {self._host_state / 'lock'})"
                    ) from None
                time.sleep(1.0)
        self._lock = lock
        if self._binaries is None:
            self._binaries = ensure_node_binaries()
        self._cleanup_host()  # what a SIGKILLed run may have left (its mounts: below)
        active = self._host_state / "active-directory"
        if active.is_file():
            nodehost.unmount_under(Path(active.read_text().strip()))
        active.write_text(str(self.directory))
        nodehost.record_sysctls(self._host_state / "sysctls.json")
        cni.ensure_bridge(self.network)

    def start(self, *, server_url: str) -> None:
        """Start CoreDNS, containerd, kubelet and kube-proxy; wait for Node Ready with the GPUs
        and for CoreDNS to serve from a synced view of the API."""
        if self._lock is None:
            self.prepare()
        started = time.monotonic()
        binaries = self._binaries or ensure_node_binaries()
        self._binaries = binaries
        dns = self._start_dns(binaries, server_url)
        self._start_containerd(binaries)
        kubelet_kubeconfig, proxy_kubeconfig = self._kubeconfigs(server_url)
        kubelet = start_process(
            name="kubelet",
            argv=self._kubelet_argv(binaries.kubelet, kubelet_kubeconfig),
            log_path=self._log_dir / "kubelet.log",
            pid_dir=self._pid_dir,
        )
        self._processes.append(kubelet)
        proxy_config = self._write_proxy_config(proxy_kubeconfig)
        self._processes.append(
            start_process(
                name="kube-proxy",
                argv=[str(binaries.kube_proxy), f"--config={proxy_config}", "--v=1"],
                log_path=self._log_dir / "kube-proxy.log",
                pid_dir=self._pid_dir,
            )
        )
        core = k8s.CoreV1Api(self._api_client_factory())
        wait_until(
            lambda: node_ready(core.read_node(NODE_NAME)),
            timeout_seconds=120,
            what=f"node {NODE_NAME} Ready",
            alive=kubelet,
            interval_seconds=0.5,
        )
        node_ready_at = time.monotonic()
        self.ready_seconds = node_ready_at - started
        self.dns_ready_seconds = dns.wait_ready(timeout_seconds=60)
        self.dns_wait_seconds = time.monotonic() - node_ready_at
        if self.network_policies:  # after Ready: it reads the Node's InternalIP
            self._start_network_policy_agent(binaries, server_url)
        self.advertise_gpus(core)

    def advertise_gpus(self, core: k8s.CoreV1Api) -> None:
        """PATCH ``nvidia.com/gpu`` into the node's status capacity (the kubelet derives the
        allocatable from it on its next status update) and wait until it is allocatable."""
        patch: Any = [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(self.num_gpus)}]
        core.patch_node_status(NODE_NAME, patch)
        wait_until(
            lambda: allocatable(core.read_node(NODE_NAME)).get(GPU_RESOURCE) == str(self.num_gpus),
            timeout_seconds=60,
            what=f"{GPU_RESOURCE} allocatable on {NODE_NAME}",
            interval_seconds=0.5,
        )

    def stop(self) -> None:
        """End the node and undo its host changes (idempotent)."""
        if self._lock is None:
            return
        for process in reversed(self._processes):
            process.stop(grace_seconds=5.0)
        self._processes.clear()
        self.dns = None
        self.network_policy_agent = None
        if self._containerd is not None:
            with contextlib.suppress(Exception):
                self._containerd.remove_all()
            self._containerd.process.stop(grace_seconds=5.0)
            self._containerd = None
        self._cleanup_host()
        nodehost.restore_sysctls(self._host_state / "sysctls.json")
        (self._host_state / "active-directory").unlink(missing_ok=True)
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None

    def _cleanup_host(self) -> None:
        nodehost.kill_cgroup_tree(nodehost.CGROUP_ROOT)
        nodehost.unmount_under(self.directory)
        nodehost.unmount_under(self.containerd_root)  # none expected: rootfs mounts are in state
        binaries = self._binaries
        if binaries is not None and binaries.kube_proxy.is_file():
            # removes the KUBE-* chains (only one kubelet node per machine: the lock)
            subprocess.run(
                [str(binaries.kube_proxy), "--cleanup", "--v=0"], capture_output=True, timeout=60, check=False
            )
        nodehost.remove_iptables_chains("KUBE-")  # kube-router's chains too (KUBE-ROUTER-*)
        netpol.remove_ipsets()  # once no rule uses them
        cni.remove_bridge(self.network)
        ipam = self.directory / "cni-ipam"
        if ipam.is_dir():
            shutil.rmtree(ipam, ignore_errors=True)

    # ------------------------------------------------------------------ pieces
    def _start_dns(self, binaries: NodeBinaries, server_url: str) -> ClusterDns:
        """CoreDNS on the bridge gateway, as the cluster admin (it lists Services,
        EndpointSlices and Namespaces cluster-wide); stopped with the node's processes."""
        admin = self._pki.admin
        kubeconfig = write_cert_kubeconfig(
            path=self.directory / "coredns.kubeconfig",
            server=server_url,
            ca_cert=self._pki.ca_cert,
            client_cert=admin.cert,
            client_key=admin.key,
            user_name="kubernetes-admin",
        )
        dns = self.dns = start_coredns(
            binary=binaries.coredns,
            address=self.network.gateway,
            kubeconfig=kubeconfig,
            directory=self.directory / "coredns",
            log_dir=self._log_dir,
            pid_dir=self._pid_dir,
        )
        self._processes.append(dns.process)
        return dns

    def _start_network_policy_agent(self, binaries: NodeBinaries, server_url: str) -> None:
        """kube-router's NetworkPolicy controller for this node, as the cluster admin (it lists
        pods, namespaces and NetworkPolicies cluster-wide); stopped with the node's processes."""
        admin = self._pki.admin
        kubeconfig = write_cert_kubeconfig(
            path=self.directory / "kube-router.kubeconfig",
            server=server_url,
            ca_cert=self._pki.ca_cert,
            client_cert=admin.cert,
            client_key=admin.key,
            user_name="kubernetes-admin",
        )
        agent = self.network_policy_agent = netpol.start_network_policy_agent(
            binary=binaries.kube_router,
            kubeconfig=kubeconfig,
            node_name=NODE_NAME,
            service_cidr=SERVICE_CIDR,
            log_dir=self._log_dir,
            pid_dir=self._pid_dir,
        )
        self._processes.append(agent.process)

    def _start_containerd(self, binaries: NodeBinaries) -> None:
        layout = ContainerdLayout(self.directory / "containerd", root_directory=self.containerd_root)
        runc = shutil.which("runc")
        if runc is None:
            raise RuntimeError("runc not found (Debian package `runc`)")
        write_config(
            layout=layout,
            sandbox_image=PAUSE_IMAGE,
            cni_bin_dir=cni.CNI_BIN_DIR,
            cni_conf_dir=self.directory / "cni-conf",
            runc=Path(runc),
        )
        cni.write_conflist(
            network=self.network, conf_dir=self.directory / "cni-conf", ipam_dir=self.directory / "cni-ipam"
        )
        runtime = self._containerd = start_containerd(
            layout=layout,
            log_dir=self._log_dir,
            pid_dir=self._pid_dir,
            cgroup_wrapper=nodehost.cgroup_wrapper(f"{nodehost.CGROUP_ROOT}/runtime"),
        )
        images = self.directory / "images"
        for spec in (
            ociimage.pause_image(pause_binary=binaries.pause, reference=PAUSE_IMAGE),
            ociimage.busybox_image(reference=BUSYBOX_IMAGE, extra_binaries=(binaries.apiprobe,)),
        ):
            archive = images / (spec.reference.rsplit("/", 1)[-1].replace(":", "_") + ".tar")
            ociimage.write_oci_archive(spec, path=archive)
            runtime.import_image(archive)
            runtime.pin_image(spec.reference)

    def _kubeconfigs(self, server_url: str) -> tuple[Path, Path]:
        pki_dir = self.directory / "pki"
        node_pair = _issue_client_cert(
            pki=self._pki,
            directory=pki_dir,
            stem="kubelet-client",
            common_name=f"system:node:{NODE_NAME}",
            organization="system:nodes",
        )
        proxy_pair = _issue_client_cert(
            pki=self._pki, directory=pki_dir, stem="kube-proxy", common_name="system:kube-proxy", organization=None
        )
        return (
            write_cert_kubeconfig(
                path=self.directory / "kubelet.kubeconfig",
                server=server_url,
                ca_cert=self._pki.ca_cert,
                client_cert=node_pair.cert,
                client_key=node_pair.key,
                user_name=f"system:node:{NODE_NAME}",
            ),
            write_cert_kubeconfig(
                path=self.directory / "kube-proxy.kubeconfig",
                server=server_url,
                ca_cert=self._pki.ca_cert,
                client_cert=proxy_pair.cert,
                client_key=proxy_pair.key,
                user_name="system:kube-proxy",
            ),
        )

    def _kubelet_argv(self, binary: Path, kubeconfig: Path) -> list[str]:
        nodehost.make_cgroup(nodehost.CGROUP_ROOT)  # cgroupRoot must exist in every hierarchy
        self.healthz_port = free_port()
        self.kubelet_port = free_port(host=self.network.gateway)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # API server -> kubelet (logs, exec) over the bridge address, a port of our own
            "address": self.network.gateway,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": LOOPBACK,
            "healthzPort": self.healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self._pki.ca_cert)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{self.directory / 'containerd' / 'containerd.sock'}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{nodehost.CGROUP_ROOT}",
            "cgroupsPerQOS": True,
            "enforceNodeAllocatable": ["pods"],
            "failSwapOn": False,
            "failCgroupV1": False,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # a busy shared dev machine: evict only when it is really out of room. Absolute
            # sizes, not percentages: 1% of a shared 250 GB disk is 2.5 GB, which a vLLM pod's
            # caches and a second image crossed in CI; the node then evicted every pod and
            # garbage-collected images, the pause image too (see _pin)
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "512Mi",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "512Mi",
                "imagefs.inodesFree": "1%",
            },
            # ClusterFirst pods: "nameserver <gateway>" (CoreDNS), the cluster search list and
            # ndots:5; "" keeps the host's resolv.conf (its search domains, its nameserver)
            # out of pods, so dnsPolicy Default pods get an empty one
            "clusterDNS": [self.network.gateway],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": "",
            "podLogsDir": str(self.directory / "pod-logs"),
            "volumePluginDir": str(self.directory / "volume-plugins"),
            "maxPods": 30,
            "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "protectKernelDefaults": False,
        }
        config_path = self.directory / "kubelet-config.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return [
            str(binary),
            f"--config={config_path}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.directory / 'kubelet'}",
            f"--cert-dir={self.directory / 'kubelet-pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={self.network.gateway}",
            f"--node-labels={NODE_LABEL}=true",
            "--v=1",
        ]

    def _write_proxy_config(self, kubeconfig: Path) -> Path:
        self.proxy_healthz_port = free_port()
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "hostnameOverride": NODE_NAME,
            "bindAddress": LOOPBACK,
            "healthzBindAddress": f"{LOOPBACK}:{self.proxy_healthz_port}",
            "metricsBindAddress": f"{LOOPBACK}:{free_port()}",
            "clusterCIDR": self.network.subnet,
            # NodePorts only on the bridge address, never on the machine's real interfaces
            "nodePortAddresses": [f"{self.network.gateway}/32"],
            "iptables": {
                "masqueradeAll": False,
                "localhostNodePorts": False,
                "syncPeriod": "10s",
                "minSyncPeriod": "0s",
            },
            # 0: leave the machine's conntrack sysctls as they are
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }
        path = self.directory / "kube-proxy-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def kubelet_healthy(self) -> bool:
        """True while the kubelet's /healthz port answers."""
        return port_open(host=LOOPBACK, port=self.healthz_port)

    def container_pid(self, container_id: str) -> int:
        """Host pid of the main process of a container (``containerd://<id>`` or ``<id>``)."""
        return self.containerd.tasks()[container_id.removeprefix("containerd://")]
