"""NetworkPolicies are enforced on the kubelet node, and the operator's policies hold there.

The defect this pins: the local cluster stored NetworkPolicies but nothing enforced them, so a
pod in another namespace reached the prefill pod's HTTP and KV ports and no e2e test could see
a policy regression. The kubelet node now runs kube-router's policy controller
(:mod:`splitserve_e2e.netpol`).

``test_deny_all_policy_is_enforced_on_the_node`` is the enforcement check on its own: a busybox
web pod that a pod in another namespace reaches, then a deny-all ingress policy in its
namespace, after which the same connection must be refused (it fails with "NetworkPolicy is not
enforced on this node" when it still connects). The host still connects (node-local traffic is
admitted, as the kubelet's probes need).

The other tests run the product as ``test_real_node.py`` does (the chart cluster-scoped, the
image built from this tree) with a Disaggregated InferenceService, and check the policies the
operator renders, from pods in two other namespaces: an unlabelled one (``client``) and one
labelled ``splitserve.dev/monitoring=true`` (``monitoring``). Checked: the prefill pod's HTTP
and KV ports and the decode pod's HTTP port refuse the client pod, while the host (node-local)
reaches the same ports, so it is the policy that refuses; the client pod gets a completion
through the router's ClusterIP (open to any namespace), which takes the router -> prefill and
prefill <-> decode paths under the policies (KV bytes counted on both pods); the decode pod
reaches the prefill pod's KV port; the monitoring pod scrapes the prefill and decode pods'
/metrics.

Connections are probed with busybox ``nc -w 3 IP PORT -e true`` run in the client pods
(``kubectl exec``): exit 0 exactly when the TCP connection was accepted.
HTTP from the pods is busybox ``wget`` under busybox ``timeout``: Debian's busybox 1.35 wget
segfaults (exit 139) when given ``-T``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, condition, get_isvc
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.kubeletnode import BUSYBOX_IMAGE, KubeletNode
from splitserve_e2e.net import port_open
from splitserve_e2e.realnode import (
    ISVC_NAME,
    Stack,
    explained,
    isvc_for_node,
    log,
    real_node_stack,
    wait,
)
from splitserve_e2e.stack import SERVED_NAME, ModelHub, create_namespace

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

CONNECT_TIMEOUT_SECONDS = 3
ENFORCED_WITHIN_SECONDS = 30.0
"""How long a new policy may take to be in force (kube-router syncs on the watch event)."""
READY_TIMEOUT_SECONDS = 600.0
WEB_PORT = 8080
RESTRICTED = {
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
NOT_ENFORCED = "NetworkPolicy is not enforced on this node"


# --------------------------------------------------------------------------- helpers
def _busybox_pod(
    name: str, command: list[str], *, labels: dict[str, str] | None = None, readiness_port: int | None = None
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": command,
        "securityContext": RESTRICTED,
    }
    if readiness_port is not None:
        container["ports"] = [{"containerPort": readiness_port}]
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": readiness_port}, "periodSeconds": 1}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"terminationGracePeriodSeconds": 1, "automountServiceAccountToken": False, "containers": [container]},
    }


def _run_ready(cluster: LocalCluster, namespace: str, pod: dict[str, Any]) -> Any:
    core: Any = cluster.core()
    core.create_namespaced_pod(namespace, pod)
    name = pod["metadata"]["name"]

    def ready() -> Any:
        status = core.read_namespaced_pod(name, namespace)
        statuses = status.status.container_statuses or []
        return status if statuses and all(s.ready for s in statuses) else None

    return cluster.wait_for(ready, timeout_seconds=90, what=f"pod {namespace}/{name} ready")


def _connects(
    cluster: LocalCluster, namespace: str, pod: str, ip: str, port: int, container: str | None = None
) -> tuple[bool, str]:
    """Whether ``pod`` opens a TCP connection to ``ip:port`` (busybox nc), and nc's output."""
    target = ["-c", container] if container else []
    result = cluster.kubectl(
        "exec",
        "-n",
        namespace,
        pod,
        *target,
        "--",
        "nc",
        "-w",
        str(CONNECT_TIMEOUT_SECONDS),
        ip,
        str(port),
        "-e",
        "true",
        check=False,
        timeout_seconds=30,
    )
    return result.returncode == 0, (result.stdout + result.stderr).strip()


def _python_connects(cluster: LocalCluster, namespace: str, pod: str, ip: str, port: int) -> tuple[bool, str]:
    """The same from a runtime pod's container (the project's image: Python, no busybox)."""
    code = f"import socket; socket.create_connection(({ip!r}, {port}), {CONNECT_TIMEOUT_SECONDS}).close()"
    result = cluster.kubectl("exec", "-n", namespace, pod, "--", "python3", "-c", code, check=False, timeout_seconds=30)
    return result.returncode == 0, (result.stdout + result.stderr).strip()


def _refused_within(
    cluster: LocalCluster, namespace: str, pod: str, ip: str, port: int, seconds: float = ENFORCED_WITHIN_SECONDS
) -> tuple[bool, str, float]:
    """Probe until the connection fails or ``seconds`` pass: (refused, nc's last output,
    seconds until refused)."""
    started = time.monotonic()
    while True:
        connected, output = _connects(cluster, namespace, pod, ip, port)
        elapsed = time.monotonic() - started
        if not connected:
            return True, output, elapsed
        if elapsed > seconds:
            return False, output, elapsed
        time.sleep(1.0)


def _delete_namespaces(cluster: LocalCluster, names: list[str]) -> None:
    for name in names:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def node(cluster: LocalCluster) -> KubeletNode:
    if cluster.kubelet_node is None:
        pytest.skip("needs the harness's kubelet node (its busybox image and host access)")
    return cluster.kubelet_node


@pytest.fixture(scope="module")
def probes(cluster: LocalCluster, node: KubeletNode) -> Iterator[dict[str, str]]:
    """A sleeping busybox pod ``probe`` in each of two restricted namespaces: ``client``
    (no labels) and ``monitoring`` (``splitserve.dev/monitoring=true``); their names."""
    suffix = uuid.uuid4().hex[:4]
    names = {"client": f"np-client-{suffix}", "monitoring": f"np-monitoring-{suffix}"}
    try:
        for role, name in names.items():
            create_namespace(cluster, name, restricted=True)
            if role == "monitoring":
                cluster.kubectl("label", "namespace", name, "splitserve.dev/monitoring=true")
            _run_ready(cluster, name, _busybox_pod("probe", ["sleep", "86400"]))
        yield names
    finally:
        _delete_namespaces(cluster, list(names.values()))


@pytest.fixture(scope="module")
def stack(
    cluster: LocalCluster, node: KubeletNode, image: str, local_hub: LocalHub, model_hub: ModelHub
) -> Iterator[Stack]:
    """The cluster-scoped operator with one workload namespace, where the Disaggregated
    InferenceService is applied and waited Ready."""
    suffix = uuid.uuid4().hex[:4]
    with real_node_stack(
        cluster=cluster, image=image, hub=local_hub, model_hub=model_hub, workloads=[f"np-pd-{suffix}"]
    ) as result:
        with explained(cluster, result.namespaces):
            manifest = isvc_for_node(result, namespace=result.namespace, mode="Disaggregated", cpu="300m")
            started = time.monotonic()
            apply_object(cluster=cluster, obj=manifest)

            def ready() -> dict[str, Any] | None:
                obj = get_isvc(cluster=cluster, namespace=result.namespace, name=ISVC_NAME)
                return obj if (condition(obj, "Ready") or {}).get("status") == "True" else None

            wait(
                cluster,
                ready,
                timeout=READY_TIMEOUT_SECONDS,
                interval=2.0,
                what=f"InferenceService {result.namespace}/{ISVC_NAME} Ready",
            )
            result.figures["Disaggregated apply -> Ready (policies enforced)"] = f"{time.monotonic() - started:.1f}s"
        yield result


def _pods_by_role(stack: Stack) -> dict[str, Any]:
    core: Any = stack.cluster.core()
    pods = core.list_namespaced_pod(stack.namespace).items
    by_role = {str(p.metadata.labels[contract.LABEL_COMPONENT]): p for p in pods}
    assert sorted(by_role) == ["decode", "prefill", "router"], sorted(by_role)
    return by_role


def _rendered_policies(stack: Stack) -> list[str]:
    listing = stack.cluster.kubectl("get", "networkpolicy", "-n", stack.namespace, "-o", "name")
    return sorted(listing.stdout.split())


# --------------------------------------------------------------------------- tests
def test_deny_all_policy_is_enforced_on_the_node(
    cluster: LocalCluster, node: KubeletNode, probes: dict[str, str]
) -> None:
    """Fails with "NetworkPolicy is not enforced on this node" when a deny-all ingress policy
    leaves a pod reachable from another namespace."""
    target = f"np-target-{uuid.uuid4().hex[:4]}"
    create_namespace(cluster, target, restricted=True)
    try:
        web = _run_ready(
            cluster,
            target,
            _busybox_pod(
                "web",
                ["httpd", "-f", "-p", str(WEB_PORT), "-h", "/www"],
                labels={"app": "web"},
                readiness_port=WEB_PORT,
            ),
        )
        ip = web.status.pod_ip
        client = probes["client"]
        connected, output = _connects(cluster, client, "probe", ip, WEB_PORT)
        assert connected, f"the probe cannot reach {ip}:{WEB_PORT} before any policy: {output}"
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "deny-all", "namespace": target},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        }
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(policy))
        refused, output, seconds = _refused_within(cluster, client, "probe", ip, WEB_PORT)
        if not refused:
            pytest.fail(
                f"{NOT_ENFORCED}: {client}/probe still connects to {target}/web "
                f"({ip}:{WEB_PORT}) {seconds:.0f}s after a deny-all ingress policy"
            )
        log(f"deny-all in force {seconds:.1f}s after apply; nc: {output}")
        # node-local traffic stays admitted (the kubelet's probes, the host): the pod serves
        assert port_open(host=ip, port=WEB_PORT), f"the host no longer reaches {ip}:{WEB_PORT}"
        cluster.kubectl("delete", "networkpolicy", "deny-all", "-n", target)
        reopened = wait(
            cluster,
            lambda: _connects(cluster, client, "probe", ip, WEB_PORT)[0],
            timeout=ENFORCED_WITHIN_SECONDS,
            what=f"{ip}:{WEB_PORT} reachable again once the policy is deleted",
        )
        assert reopened
    finally:
        _delete_namespaces(cluster, [target])


def test_other_namespace_cannot_reach_prefill_or_decode(stack: Stack, probes: dict[str, str]) -> None:
    cluster = stack.cluster
    with explained(cluster, [*stack.namespaces, *probes.values()]):
        policies = _rendered_policies(stack)
        log(f"NetworkPolicies in {stack.namespace}: {policies}")
        by_role = _pods_by_role(stack)
        targets = [
            ("prefill", contract.HTTP_PORT),
            ("prefill", contract.KV_TRANSFER_PORT),
            ("decode", contract.HTTP_PORT),
        ]
        for role, port in targets:
            ip = by_role[role].status.pod_ip
            # the port is open (the host is node-local, which policies admit) ...
            assert port_open(host=ip, port=port), f"{role} {ip}:{port} is not listening"
            # ... and the policy refuses the other namespace's pod
            refused, output, _ = _refused_within(cluster, probes["client"], "probe", ip, port)
            if not refused:
                pytest.fail(
                    f"{NOT_ENFORCED} or the rendered policy admits it: "
                    f"{probes['client']}/probe connects to the {role} pod's port "
                    f"{port} ({ip}); policies {policies}"
                )
            log(f"{probes['client']}/probe -> {role} {ip}:{port}: refused ({output})")


def test_router_serves_through_prefill_and_decode_under_the_policies(stack: Stack, probes: dict[str, str]) -> None:
    cluster = stack.cluster
    with explained(cluster, [*stack.namespaces, *probes.values()]):
        by_role = _pods_by_role(stack)
        core: Any = cluster.core()
        service = core.read_namespaced_service(f"{ISVC_NAME}-router", stack.namespace)
        url = f"http://{service.spec.cluster_ip}:{contract.HTTP_PORT}"
        body = json.dumps({"model": SERVED_NAME, "prompt": "Under a policy", "max_tokens": 4, "temperature": 0})

        # from the host first (node-local, admitted): router -> prefill -> decode under the
        # policies; the router admits upstreams from its health poll, so retry a while
        def from_host() -> dict[str, Any] | None:
            response = httpx.post(
                f"{url}/v1/completions", content=body, timeout=60.0, headers={"Content-Type": "application/json"}
            )
            if response.status_code != 200:
                return None
            answer: dict[str, Any] = response.json()
            return answer

        answer = wait(
            cluster, from_host, timeout=120, interval=2.0, what=f"a completion through the router {url} from the host"
        )
        assert answer["usage"]["completion_tokens"] == 4, answer
        # then from the other namespace's pod: the router's port is open to any namespace
        outputs: list[str] = []

        def from_pod(target: str) -> dict[str, Any] | None:
            result = cluster.kubectl(
                "exec",
                "-n",
                probes["client"],
                "probe",
                "--",
                "timeout",
                "60",
                "wget",
                "-q",
                "-O",
                "-",
                "--header",
                "Content-Type: application/json",
                "--post-data",
                body,
                f"{target}/v1/completions",
                check=False,
                timeout_seconds=90,
            )
            outputs.append(f"{target}: rc {result.returncode} {result.stdout[-300:]} {result.stderr[-300:]}")
            if result.returncode != 0:
                return None
            reply: dict[str, Any] = json.loads(result.stdout)
            return reply

        try:
            answer = wait(
                cluster,
                lambda: from_pod(url),
                timeout=60,
                interval=2.0,
                what=f"a completion through the router {url} from {probes['client']}",
            )
        except TimeoutError:
            router_ip = by_role["router"].status.pod_ip
            direct = from_pod(f"http://{router_ip}:{contract.HTTP_PORT}")
            pytest.fail(
                f"{probes['client']}/probe gets no completion through the router "
                f"(ClusterIP {url}; pod IP {router_ip} directly: "
                f"{'ok' if direct else 'failed'}); last outputs: {outputs[-3:]}"
            )
        assert answer["usage"]["completion_tokens"] == 4, answer
        # the KV went from prefill to decode over the pod network, under the policies
        kv = contract.Metric.KV_TRANSFER_BYTES_TOTAL
        for role in ("prefill", "decode"):
            ip = by_role[role].status.pod_ip
            scraped = cluster.kubectl(
                "exec",
                "-n",
                probes["monitoring"],
                "probe",
                "--",
                "timeout",
                "10",
                "wget",
                "-q",
                "-O",
                "-",
                f"http://{ip}:{contract.HTTP_PORT}{contract.METRICS_PATH}",
                check=False,
                timeout_seconds=30,
            )
            assert scraped.returncode == 0, (
                f"the monitoring namespace cannot scrape the {role} pod's /metrics: {scraped.stderr}"
            )
            total = sum(float(line.rsplit(" ", 1)[1]) for line in scraped.stdout.splitlines() if line.startswith(kv))
            assert total > 0, f"no KV bytes on the {role} pod: {scraped.stdout[:2000]}"
            log(f"{probes['monitoring']}/probe scraped {role} /metrics: {kv} {total:.0f}")
        # the decode pod is the prefill pod's KV peer: admitted on the KV port
        prefill_ip = by_role["prefill"].status.pod_ip
        connected, output = _python_connects(
            cluster, stack.namespace, by_role["decode"].metadata.name, prefill_ip, contract.KV_TRANSFER_PORT
        )
        assert connected, f"decode -> prefill {prefill_ip}:{contract.KV_TRANSFER_PORT}: {output}"
