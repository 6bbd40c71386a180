"""The kubelet node is a real node: images, namespaces, cgroups, CNI, kube-proxy.

The session's cluster runs every pod on its kubelet node (:mod:`splitserve_e2e.kubeletnode`).
Each test checks something the project's pods rely on, with busybox pods (an image made here
from Debian's busybox-static): the restricted Pod Security level enforced by the runtime (capabilities, seccomp, user,
read-only root), pod IPs from the CNI bridge, ClusterIP Services through kube-proxy from the
host and from pods, OOM kills by the memory cgroup, kubelet restarts of a killed container,
GPU pods scheduled through the advertised extended resource, the API server reached from
a pod through the ``kubernetes`` Service with the pod's ServiceAccount token, and cluster DNS
(CoreDNS on the bridge gateway): what it answers, and pods resolving Services by short name
and FQDN and a headless Service's pod by ``<hostname>.<subdomain>.<ns>``, the form of a
LeaderWorkerSet leader address.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s

from splitserve_e2e.build import ensure_node_binaries
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.cni import POD_SUBNET
from splitserve_e2e.coredns import (
    ClusterDns,
    PortInUse,
    check_port_free,
    query,
    reverse_name,
    start_coredns,
)
from splitserve_e2e.kubeletnode import (
    BUSYBOX_IMAGE,
    GPU_RESOURCE,
    NODE_NAME,
    KubeletNode,
    allocatable,
    node_ready,
)
from splitserve_e2e.net import LOOPBACK, free_port

pytestmark = pytest.mark.e2e

NODE_GPUS = 4
HTTP_PORT = 8080


def _node(cluster: LocalCluster) -> KubeletNode:
    assert cluster.kubelet_node is not None
    return cluster.kubelet_node


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace where Pod Security Admission enforces ``restricted``."""
    name = f"kn-{uuid.uuid4().hex[:6]}"
    core = cluster.core()
    body: Any = {
        "metadata": {
            "name": name,
            "labels": {
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest",
            },
        }
    }
    core.create_namespace(body)
    cluster.wait_for(
        lambda: core.read_namespaced_service_account("default", name), timeout_seconds=30, what="default ServiceAccount"
    )
    yield name
    core.delete_namespace(name, grace_period_seconds=0)


RESTRICTED = {
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pod(
    name: str,
    command: list[str],
    *,
    labels: dict[str, str] | None = None,
    resources: dict[str, Any] | None = None,
    readiness_port: int | None = None,
    automount_token: bool = False,
) -> Any:
    container: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": command,
        "securityContext": RESTRICTED,
    }
    if resources:
        container["resources"] = resources
    if readiness_port is not None:
        container["ports"] = [{"containerPort": readiness_port}]
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": readiness_port}, "periodSeconds": 1}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": automount_token,
            "containers": [container],
        },
    }


def _create(cluster: LocalCluster, namespace: str, pod: Any) -> None:
    cluster.core().create_namespaced_pod(namespace, pod)


def _status(cluster: LocalCluster, namespace: str, name: str) -> Any:
    return cluster.core().read_namespaced_pod(name, namespace)


def _ready(cluster: LocalCluster, namespace: str, name: str, timeout: float = 60.0) -> Any:
    def ready() -> Any:
        pod = _status(cluster, namespace, name)
        statuses = pod.status.container_statuses or []
        return pod if statuses and all(s.ready for s in statuses) else None

    return cluster.wait_for(ready, timeout_seconds=timeout, what=f"{namespace}/{name} ready")


def _web(cluster: LocalCluster, namespace: str, name: str = "web") -> Any:
    _create(
        cluster,
        namespace,
        _pod(name, ["httpd", "-f", "-p", str(HTTP_PORT), "-h", "/www"], labels={"app": name}, readiness_port=HTTP_PORT),
    )
    return _ready(cluster, namespace, name)


def _container_pid(cluster: LocalCluster, pod: Any) -> int:
    return _node(cluster).container_pid(pod.status.container_statuses[0].container_id)


def _log_when(cluster: LocalCluster, namespace: str, name: str, needle: str) -> str:
    """The pod's log (API server -> kubelet) once it contains ``needle``."""
    core = cluster.core()

    def log() -> str | None:
        text = str(core.read_namespaced_pod_log(name, namespace))
        return text if needle in text else None

    return cluster.wait_for(log, timeout_seconds=60, what=f"{needle!r} in {name}'s log")


def test_node_is_ready_and_keeps_its_gpus(cluster: LocalCluster) -> None:
    core = cluster.core()
    node: Any = core.read_node(NODE_NAME)
    assert node_ready(node)
    assert node.status.node_info.kubelet_version == "v1.34.4"
    assert node.status.node_info.container_runtime_version.startswith("containerd://1.6")
    assert {a.type: a.address for a in node.status.addresses}["InternalIP"] == "10.213.0.1"
    # the kubelet rewrites its status every 5 s: the patched extended resource must survive
    time.sleep(12)
    node = core.read_node(NODE_NAME)
    assert node.status.capacity[GPU_RESOURCE] == str(NODE_GPUS)
    assert allocatable(node)[GPU_RESOURCE] == str(NODE_GPUS)
    assert _node(cluster).kubelet_healthy()


def test_restricted_pod_serves_http_and_is_confined(cluster: LocalCluster, namespace: str) -> None:
    pod = _web(cluster, namespace)
    assert pod.spec.node_name == NODE_NAME
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(POD_SUBNET)
    response = httpx.get(f"http://{pod.status.pod_ip}:{HTTP_PORT}/", timeout=5.0)
    assert response.text == "splitserve kubelet node\n"
    # what the restricted profile promises, read from the container's process on the host
    pid = _container_pid(cluster, pod)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Uid"].split()[:2] == ["65534", "65534"]
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # filter mode: the runtime's default profile
    root = next(
        line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines() if line.split()[4] == "/"
    )
    assert "ro" in root[5].split(",")
    assert Path(f"/proc/{pid}/ns/net").resolve() != Path("/proc/self/ns/net").resolve()


def test_restricted_namespace_refuses_a_root_pod(cluster: LocalCluster, namespace: str) -> None:
    pod = _pod("root", ["sleep", "3600"])
    pod["spec"]["containers"][0]["securityContext"] = {"runAsUser": 0}
    with pytest.raises(k8s.ApiException) as error:
        _create(cluster, namespace, pod)
    assert error.value.status == 403 and "violates PodSecurity" in str(error.value.body)


def test_cluster_ip_service_from_host_and_from_a_pod(cluster: LocalCluster, namespace: str) -> None:
    _web(cluster, namespace)
    service: Any = {
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": HTTP_PORT}]},
    }
    created: Any = cluster.core().create_namespaced_service(namespace, service)
    cluster_ip = created.spec.cluster_ip
    url = f"http://{cluster_ip}/"
    text = cluster.wait_for(lambda: httpx.get(url, timeout=2.0).text, timeout_seconds=30, what=f"{url} from the host")
    assert text == "splitserve kubelet node\n"
    _create(
        cluster,
        namespace,
        _pod("client", ["sh", "-c", f"while true; do timeout 2 wget -q -O - {url} && echo FETCHED; sleep 1; done"]),
    )
    log = _log_when(cluster, namespace, "client", "FETCHED")
    assert "splitserve kubelet node\nFETCHED" in log


def test_memory_limit_oom_kills(cluster: LocalCluster, namespace: str) -> None:
    _create(
        cluster,
        namespace,
        _pod(
            "hog",
            ["dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1"],
            resources={"limits": {"memory": "16Mi", "cpu": "200m"}},
        ),
    )

    def oom_killed() -> Any:
        statuses = _status(cluster, namespace, "hog").status.container_statuses or []
        last = statuses[0].last_state.terminated if statuses else None
        return last if last is not None and last.reason == "OOMKilled" else None

    terminated = cluster.wait_for(oom_killed, timeout_seconds=60, what="OOMKilled")
    assert terminated.exit_code == 137


def test_killed_container_is_restarted_by_the_kubelet(cluster: LocalCluster, namespace: str) -> None:
    pod = _web(cluster, namespace, "victim")
    first_pid = _container_pid(cluster, pod)
    os.kill(first_pid, signal.SIGKILL)

    def restarted() -> Any:
        current = _ready(cluster, namespace, "victim")
        return current if current.status.container_statuses[0].restart_count >= 1 else None

    current = cluster.wait_for(restarted, timeout_seconds=60, what="restartCount >= 1")
    assert current.status.container_statuses[0].last_state.terminated.exit_code == 137
    assert _container_pid(cluster, current) != first_pid


def test_gpu_pod_schedules_on_the_node(cluster: LocalCluster, namespace: str) -> None:
    one = {"limits": {GPU_RESOURCE: "1"}}
    _create(cluster, namespace, _pod("gpu", ["sleep", "3600"], resources=one))
    pod = _ready(cluster, namespace, "gpu")
    assert pod.spec.node_name == NODE_NAME
    too_many = {"limits": {GPU_RESOURCE: str(NODE_GPUS + 1)}}
    _create(cluster, namespace, _pod("greedy", ["sleep", "3600"], resources=too_many))

    def unschedulable() -> bool:
        conditions = _status(cluster, namespace, "greedy").status.conditions or []
        return any(
            c.type == "PodScheduled" and c.reason == "Unschedulable" and GPU_RESOURCE in (c.message or "")
            for c in conditions
        )

    cluster.wait_for(unschedulable, timeout_seconds=30, what="greedy pod unschedulable")


def test_pod_reaches_the_api_server_through_the_kubernetes_service(cluster: LocalCluster, namespace: str) -> None:
    # apiprobe: $KUBERNETES_SERVICE_HOST:PORT, server cert checked against the mounted CA,
    # the mounted ServiceAccount token, POST SelfSubjectReview (gobin/apiprobe)
    _create(
        cluster, namespace, _pod("whoami", ["sh", "-c", "while true; do apiprobe; sleep 2; done"], automount_token=True)
    )
    log = _log_when(cluster, namespace, "whoami", "SelfSubjectReview")
    answer = json.loads(next(line for line in log.splitlines() if "SelfSubjectReview" in line))
    assert answer["status"]["userInfo"]["username"] == (f"system:serviceaccount:{namespace}:default")
    kubernetes: Any = cluster.core().read_namespaced_service("kubernetes", "default")
    assert kubernetes.spec.cluster_ip == "10.96.0.1"


# --------------------------------------------------------------------------- cluster DNS
def _dns(cluster: LocalCluster) -> ClusterDns:
    dns = _node(cluster).dns
    assert dns is not None
    return dns


def test_cluster_dns_answers_cluster_names_and_nothing_else(cluster: LocalCluster) -> None:
    dns = _dns(cluster)
    assert (dns.address, dns.port) == ("10.213.0.1", 53)
    assert dns.healthy() and dns.ready()
    with pytest.raises(PortInUse):  # UDP and TCP 53 on the gateway are CoreDNS's
        check_port_free(address=dns.address)
    for tcp in (False, True):
        reply = query(server=dns.address, name="kubernetes.default.svc.cluster.local", tcp=tcp)
        assert (reply.rcode, reply.values("A"), reply.authoritative) == ("NOERROR", ["10.96.0.1"], True)
        assert all(0 < record.ttl <= 5 for record in reply.answers)
    srv = query(server=dns.address, name="_https._tcp.kubernetes.default.svc.cluster.local", record_type="SRV")
    assert srv.values("SRV") == ["0 100 443 kubernetes.default.svc.cluster.local."]
    ptr = query(server=dns.address, name=reverse_name("10.96.0.1"), record_type="PTR")
    assert ptr.values("PTR") == ["kubernetes.default.svc.cluster.local."]
    pod_name = query(server=dns.address, name="10-213-0-99.default.pod.cluster.local")
    assert pod_name.values("A") == ["10.213.0.99"]  # `pods insecure`: no pod lookup
    # unknown cluster names, unknown addresses and the rest of the world: a definite NXDOMAIN
    for name, record_type in (
        ("nosuch.default.svc.cluster.local", "A"),
        ("example.com", "A"),
        ("example.com", "AAAA"),
        (reverse_name("192.0.2.1"), "PTR"),
    ):
        reply = query(server=dns.address, name=name, record_type=record_type)
        assert (reply.rcode, reply.answers) == ("NXDOMAIN", ()), name


def _coredns_binary() -> Path:
    return ensure_node_binaries().coredns  # cached: only the build stamps are read


def test_coredns_starts_synced_within_seconds(cluster: LocalCluster) -> None:
    """A second CoreDNS (same binary, Corefile and kubeconfig) on a loopback port: its own
    start-to-ready time, and the same answers. /ready means the kubernetes plugin has synced
    (an unsynced one starts serving only after 5 s, with SERVFAIL for cluster names)."""
    node, kubeconfig, binary = _node(cluster), _dns(cluster).kubeconfig, _coredns_binary()
    assert node.dns_wait_seconds < 5.0  # it starts first and syncs while the kubelet starts
    directory = node.directory / "coredns-second"
    second = start_coredns(
        binary=binary,
        address=LOOPBACK,
        port=free_port(),
        kubeconfig=kubeconfig,
        directory=directory,
        log_dir=directory,
        pid_dir=None,
    )
    try:
        seconds = second.wait_ready(timeout_seconds=30)
        reply = query(server=LOOPBACK, port=second.port, name="kubernetes.default.svc.cluster.local")
        assert reply.values("A") == ["10.96.0.1"]
        with pytest.raises(PortInUse):
            start_coredns(
                binary=binary,
                address=LOOPBACK,
                port=second.port,
                kubeconfig=kubeconfig,
                directory=directory,
                log_dir=directory,
                pid_dir=None,
            )
    finally:
        second.stop()
    print(
        f"\nCoreDNS: start to ready {seconds:.2f}s alone; in the node start ready "
        f"{node.dns_ready_seconds:.2f}s after its start, adding {node.dns_wait_seconds:.2f}s "
        f"after node Ready ({node.ready_seconds:.2f}s)"
    )
    assert seconds < 5.0


_CONNECTING = re.compile(r"^Connecting to \S+ \(([0-9.]+):[0-9]+\)$")


def _name_client(
    names: list[str], *, port: int, automount_token: bool = False, env: dict[str, str] | None = None, extra: str = ""
) -> Any:
    """A busybox pod that fetches ``http://<name>:<port>/`` for each name every second through
    libc's resolver (search list, ndots), logging ``RESOLVED <name> <ip>`` from wget's
    "Connecting to" line and ``FETCHED <name>`` when the page came back; ``extra``: more
    shell run each round."""
    script = (
        f"while true; do for name in {' '.join(names)}; do "
        f'out=$(timeout 3 wget -O - "http://$name:{port}/" 2>&1); '
        f'echo "$out" | sed -n "s/^Connecting to .*/RESOLVED $name &/p"; '
        'case "$out" in *"splitserve kubelet node"*) echo "FETCHED $name";; esac; '
        f"done; {extra} sleep 1; done"
    )
    pod = _pod("client", ["sh", "-c", script], automount_token=automount_token)
    if env:
        pod["spec"]["containers"][0]["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return pod


def _resolved(
    cluster: LocalCluster, namespace: str, names: list[str], needle: str | None = None
) -> tuple[dict[str, set[str]], str]:
    """Once every name was fetched (and ``needle`` is in the log): name -> the addresses
    wget connected to, and the log."""
    core = cluster.core()

    def log() -> str | None:
        text = str(core.read_namespaced_pod_log("client", namespace))
        done = all(f"FETCHED {name}\n" in text for name in names)
        return text if done and (needle is None or needle in text) else None

    text = cluster.wait_for(log, timeout_seconds=60, what=f"{names} fetched by name")
    addresses: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("RESOLVED "):
            _, name, rest = line.split(" ", 2)
            match = _CONNECTING.match(rest)
            assert match is not None, line
            addresses.setdefault(name, set()).add(match.group(1))
    return addresses, text


def _resolv_conf(cluster: LocalCluster, namespace: str, pod: str) -> list[str]:
    """The pod's /etc/resolv.conf, read from the host through its process's root."""
    status = _ready(cluster, namespace, pod)
    pid = _container_pid(cluster, status)
    return Path(f"/proc/{pid}/root/etc/resolv.conf").read_text().splitlines()


def test_pod_resolves_services_by_short_name_and_fqdn(cluster: LocalCluster, namespace: str) -> None:
    _web(cluster, namespace)
    service: Any = {
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": HTTP_PORT}]},
    }
    created: Any = cluster.core().create_namespaced_service(namespace, service)
    cluster_ip = created.spec.cluster_ip
    names = ["web", f"web.{namespace}", f"web.{namespace}.svc", f"web.{namespace}.svc.cluster.local"]
    # apiprobe (Go's resolver) dials the API server by name and verifies its certificate
    # against that name
    _create(
        cluster,
        namespace,
        _name_client(
            names,
            port=80,
            automount_token=True,
            extra="apiprobe;",
            env={"KUBERNETES_SERVICE_HOST": "kubernetes.default.svc"},
        ),
    )
    addresses, log = _resolved(cluster, namespace, names, needle="SelfSubjectReview")
    assert addresses == {name: {cluster_ip} for name in names}
    answer = json.loads(next(line for line in log.splitlines() if "SelfSubjectReview" in line))
    assert answer["status"]["userInfo"]["username"] == (f"system:serviceaccount:{namespace}:default")
    assert _resolv_conf(cluster, namespace, "client") == [
        f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local",
        "nameserver 10.213.0.1",
        "options ndots:5",
    ]


def test_headless_service_resolves_pod_hostname_and_subdomain(cluster: LocalCluster, namespace: str) -> None:
    # what a LeaderWorkerSet sets up: a headless Service named like the set, the leader pod
    # with hostname <set>-<group> and subdomain <set>; LWS_LEADER_ADDRESS is
    # <set>-<group>.<set>.<namespace>
    service: Any = {
        "metadata": {"name": "group"},
        "spec": {"clusterIP": "None", "selector": {"app": "leader"}, "ports": [{"name": "http", "port": HTTP_PORT}]},
    }
    cluster.core().create_namespaced_service(namespace, service)
    leader = _pod(
        "leader",
        ["httpd", "-f", "-p", str(HTTP_PORT), "-h", "/www"],
        labels={"app": "leader"},
        readiness_port=HTTP_PORT,
    )
    leader["spec"].update({"hostname": "group-0", "subdomain": "group"})
    _create(cluster, namespace, leader)
    pod_ip = _ready(cluster, namespace, "leader").status.pod_ip
    fqdn = f"group-0.group.{namespace}.svc.cluster.local"
    dns = _dns(cluster)

    def published() -> list[str]:  # the EndpointSlice carries the hostname once ready
        return query(server=dns.address, name=fqdn).values("A")

    assert cluster.wait_for(published, timeout_seconds=30, what=f"{fqdn} in DNS") == [pod_ip]
    names = ["group-0.group", f"group-0.group.{namespace}", fqdn, "group"]
    _create(cluster, namespace, _name_client(names, port=HTTP_PORT))
    addresses, _ = _resolved(cluster, namespace, names)
    assert addresses == {name: {pod_ip} for name in names}
