"""Proof that the local environment is a real cluster, not a stand-in.

Each test exercises one promise the other e2e tests rely on: pods on the kubelet node are
containers from the project's image (``python`` is in it) on their own bridge IP, with
probe-driven readiness, EndpointSlices from the real controller, restarts, and graceful
deletion through tini (SIGTERM, SIGKILL after the grace period); controllers really run
(garbage collection); the scheduler places GPU pods on kwok nodes; kubectl/helm talk to the API
server; Prometheus discovers and scrapes labelled pods; env sources, volumes and ServiceAccount
tokens reach the container; RBAC is enforced for ServiceAccounts.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import json
import textwrap
import time
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from splitserve_contract import LABEL_INSTANCE, LABEL_SCRAPE
from splitserve_e2e.cluster import LocalCluster, NodeUnavailable
from splitserve_e2e.cni import POD_SUBNET
from splitserve_e2e.kubeletnode import NODE_NAME
from splitserve_e2e.kwok import GPU_PRODUCT_LABEL, GPU_RESOURCE, NODE_LEASE_SECONDS, kwok_toleration
from splitserve_e2e.process import is_alive

pytestmark = pytest.mark.e2e

PLACEHOLDER_IMAGE = "python:3.11-slim"  # pods that never run (0 replicas, unschedulable)


def _pod(
    name: str,
    *,
    image: str,
    args: list[str],
    labels: dict[str, str] | None = None,
    restart_policy: str = "Always",
    **container: Any,
) -> Any:
    """A pod running ``args`` under the image's entrypoint (tini) on the kubelet node (the
    kwok nodes are tainted); ``container`` holds extra container fields (camelCase)."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 5,
        "restartPolicy": restart_policy,
        "containers": [{"name": "main", "image": image, "imagePullPolicy": "IfNotPresent", "args": args, **container}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": spec,
    }


POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _http_server_deployment(name: str, *, image: str, readiness_path: str = "/") -> Any:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "web",
                            "image": image,
                            "imagePullPolicy": "IfNotPresent",
                            "args": ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8000"],
                            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "readinessProbe": {
                                "httpGet": {"path": readiness_path, "port": "http"},
                                "periodSeconds": 1,
                                "failureThreshold": 1,
                            },
                        }
                    ],
                },
            },
        },
    }


def _service(app: str) -> Any:
    return {
        "metadata": {"name": app},
        "spec": {"selector": {"app": app}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _only_pod(core: Any, namespace: str, selector: str) -> Any:
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return pods[0] if len(pods) == 1 else None


def test_deployment_pod_is_a_container_with_probe_readiness(cluster: LocalCluster, namespace: str, image: str) -> None:
    core: Any = cluster.core()
    apps: Any = cluster.apps()
    apps.create_namespaced_deployment(namespace, _http_server_deployment("web", image=image))
    core.create_namespaced_service(namespace, _service("web"))
    started = time.monotonic()
    pod: Any = cluster.wait_for(
        lambda: (p := _only_pod(core, namespace, "app=web")) is not None and _ready(p) and p,
        timeout_seconds=60,
        what="web pod Ready",
    )
    ready_seconds = time.monotonic() - started
    ip = pod.status.pod_ip
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(POD_SUBNET), ip
    assert pod.status.pod_ips[0].ip == ip and pod.spec.node_name == NODE_NAME
    assert httpx.get(f"http://{ip}:8000/", timeout=5).status_code == 200
    pid = cluster.container_pid(namespace=namespace, pod=pod.metadata.name)
    assert pid is not None and is_alive(pid)
    # the Service's EndpointSlice (the controller manager's) lists the ready pod
    endpoints: Any = cluster.wait_for(
        lambda: cluster.endpoints_of(namespace=namespace, service="web"), timeout_seconds=30, what="web endpoints"
    )
    assert endpoints == [f"{ip}:8000"]
    discovery: Any = k8s.DiscoveryV1Api(cluster.api_client())
    slices = discovery.list_namespaced_endpoint_slice(namespace, label_selector="kubernetes.io/service-name=web").items
    assert [s.address_type for s in slices] == ["IPv4"]
    assert slices[0].endpoints[0].target_ref.name == pod.metadata.name
    assert httpx.get(f"http://{endpoints[0]}/", timeout=5).status_code == 200
    assert "GET / HTTP" in cluster.pod_log(namespace=namespace, pod=pod.metadata.name)
    print(f"deployment pod Ready after {ready_seconds:.1f}s")

    apps.delete_namespaced_deployment("web", namespace)
    cluster.wait_for(
        lambda: not core.list_namespaced_pod(namespace, label_selector="app=web").items,
        timeout_seconds=60,
        what="web pod deleted",
    )
    cluster.wait_for(lambda: not is_alive(pid), timeout_seconds=10, what="container process ended")


def test_failing_readiness_probe_keeps_pod_unready(cluster: LocalCluster, namespace: str, image: str) -> None:
    core: Any = cluster.core()
    cluster.apps().create_namespaced_deployment(
        namespace, _http_server_deployment("unready", image=image, readiness_path="/no-such-page")
    )
    core.create_namespaced_service(namespace, _service("unready"))
    pod: Any = cluster.wait_for(
        lambda: (
            (p := _only_pod(core, namespace, "app=unready")) is not None
            and p.status.phase == "Running"
            and p.status.pod_ip
            and p
        ),
        timeout_seconds=60,
        what="unready pod Running",
    )
    # the server answers (404 on the probe path), so the process is up but never Ready
    cluster.wait_for(
        lambda: httpx.get(f"http://{pod.status.pod_ip}:8000/", timeout=2).status_code == 200,
        timeout_seconds=30,
        what="server answering",
    )
    # The probe (every second, failure threshold 1) has run and failed several times once the
    # server has logged that many requests for its path: only then is "still unready" a result.
    cluster.wait_for(
        lambda: cluster.pod_log(namespace=namespace, pod=pod.metadata.name).count("GET /no-such-page") >= 3,
        timeout_seconds=30,
        what="three failed readiness probes",
    )
    pod = core.read_namespaced_pod(pod.metadata.name, namespace)
    assert pod.status.phase == "Running" and not _ready(pod)
    assert cluster.endpoints_of(namespace=namespace, service="unready") == []


def test_crashing_and_unhealthy_containers_are_restarted(cluster: LocalCluster, namespace: str, image: str) -> None:
    core: Any = cluster.core()
    core.create_namespaced_pod(
        namespace,
        _pod(
            "crasher",
            image=image,
            args=["python", "-c", "import sys; print('crashing'); sys.exit(3)"],
            terminationMessagePolicy="FallbackToLogsOnError",
        ),
    )
    core.create_namespaced_pod(
        namespace,
        _pod(
            "unhealthy",
            image=image,
            args=["python", "-m", "http.server", "--bind", "$(POD_IP)", "8000"],
            env=[POD_IP_ENV],
            livenessProbe={
                "httpGet": {"path": "/missing", "port": 8000},
                "periodSeconds": 1,
                "failureThreshold": 2,
                "initialDelaySeconds": 1,
            },
        ),
    )

    def restarted(name: str, times: int) -> Any:
        statuses = core.read_namespaced_pod(name, namespace).status.container_statuses or []
        return statuses[0] if statuses and statuses[0].restart_count >= times else None

    crashed: Any = cluster.wait_for(lambda: restarted("crasher", 2), timeout_seconds=60, what="crasher restarted twice")
    assert crashed.last_state.terminated.exit_code == 3
    # the kubelet's termination message: the log tail of the container that exited (reading
    # the previous log instead races with the kubelet removing it at the next restart)
    assert "crashing" in crashed.last_state.terminated.message
    unhealthy: Any = cluster.wait_for(
        lambda: restarted("unhealthy", 1), timeout_seconds=60, what="unhealthy restarted by liveness"
    )
    assert unhealthy.restart_count >= 1
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=unhealthy")
    assert any(e.reason == "Unhealthy" and "Liveness" in e.message for e in events.items)


IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
)
HANDLES_SIGTERM = textwrap.dedent("""
    import signal, sys, time
    def stop(signum, frame):
        print("got SIGTERM, draining", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("up", flush=True)
    time.sleep(600)
""")


def test_deletion_sends_sigterm_then_sigkill_after_the_grace_period(
    cluster: LocalCluster, namespace: str, image: str
) -> None:
    """tini (the image's PID 1) passes the kubelet's SIGTERM on; the grace period holds."""
    core: Any = cluster.core()
    for name, script in (("stubborn", IGNORES_SIGTERM), ("polite", HANDLES_SIGTERM)):
        pod = _pod(name, image=image, args=["python", "-c", script])
        pod["spec"]["terminationGracePeriodSeconds"] = 4
        core.create_namespaced_pod(namespace, pod)

    def running_pid(name: str) -> int | None:
        if "up" not in cluster.pod_log(namespace=namespace, pod=name):
            return None
        return cluster.container_pid(namespace=namespace, pod=name)

    pids: dict[str, int] = {}
    for name in ("stubborn", "polite"):
        pids[name] = cluster.wait_for(functools.partial(running_pid, name), timeout_seconds=60, what=f"{name} running")
    started = time.monotonic()
    core.delete_namespaced_pod("polite", namespace)
    core.delete_namespaced_pod("stubborn", namespace)

    def gone(name: str) -> bool:
        try:
            core.read_namespaced_pod(name, namespace)
        except ApiException as error:
            return bool(error.status == 404)
        return False

    cluster.wait_for(lambda: gone("polite"), timeout_seconds=30, what="polite pod removed")
    polite_seconds = time.monotonic() - started
    cluster.wait_for(lambda: gone("stubborn"), timeout_seconds=30, what="stubborn pod removed")
    stubborn_seconds = time.monotonic() - started
    # exited on SIGTERM (the kubelet's status round trip adds about a second), SIGKILL only
    # after the 4 s grace
    print(f"polite pod removed after {polite_seconds:.1f}s, stubborn after {stubborn_seconds:.1f}s")
    assert polite_seconds < 3.5, polite_seconds
    assert 4.0 <= stubborn_seconds < 15, stubborn_seconds
    assert not is_alive(pids["stubborn"]) and not is_alive(pids["polite"])


def test_garbage_collector_deletes_owned_configmap(cluster: LocalCluster, namespace: str) -> None:
    core: Any = cluster.core()
    apps: Any = cluster.apps()
    owner = apps.create_namespaced_deployment(
        namespace,
        {
            "metadata": {"name": "owner"},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": "owner"}},
                "template": {
                    "metadata": {"labels": {"app": "owner"}},
                    "spec": {"containers": [{"name": "c", "image": PLACEHOLDER_IMAGE, "command": ["true"]}]},
                },
            },
        },
    )
    core.create_namespaced_config_map(
        namespace,
        {
            "metadata": {
                "name": "owned",
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": "owner",
                        "uid": owner.metadata.uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "data": {"k": "v"},
        },
    )
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "free"}})
    apps.delete_namespaced_deployment("owner", namespace, propagation_policy="Background")

    def owned_gone() -> bool:
        try:
            core.read_namespaced_config_map("owned", namespace)
        except ApiException as error:
            return bool(error.status == 404)
        return False

    cluster.wait_for(owned_gone, timeout_seconds=60, what="owned ConfigMap garbage-collected")
    assert core.read_namespaced_config_map("free", namespace).metadata.name == "free"


def test_gpu_pod_is_scheduled_onto_a_kwok_gpu_node(cluster: LocalCluster, namespace: str) -> None:
    core: Any = cluster.core()
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "gpu"},
            "spec": {
                "nodeSelector": {"type": "kwok"},
                "tolerations": [kwok_toleration()],
                "containers": [
                    {"name": "c", "image": "vllm/vllm-openai:latest", "resources": {"limits": {GPU_RESOURCE: "1"}}}
                ],
            },
        },
    )
    pod: Any = cluster.wait_for(
        lambda: (p := core.read_namespaced_pod("gpu", namespace)).status.phase == "Running" and _ready(p) and p,
        timeout_seconds=60,
        what="GPU pod Running on kwok",
    )
    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels["type"] == "kwok"
    assert node.metadata.labels[GPU_PRODUCT_LABEL] == "NVIDIA-H200"
    assert node.status.allocatable[GPU_RESOURCE] == "8"
    # a pod asking for more GPUs than any node has stays Pending with the scheduler's reason
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "too-big"},
            "spec": {
                "tolerations": [kwok_toleration()],
                "containers": [{"name": "c", "image": PLACEHOLDER_IMAGE, "resources": {"limits": {GPU_RESOURCE: "9"}}}],
            },
        },
    )
    unschedulable: Any = cluster.wait_for(
        lambda: next(
            (
                c
                for c in core.read_namespaced_pod("too-big", namespace).status.conditions or []
                if c.type == "PodScheduled" and c.status == "False"
            ),
            None,
        ),
        timeout_seconds=30,
        what="too-big unschedulable",
    )
    assert GPU_RESOURCE in unschedulable.message


def test_kwok_nodes_renew_their_leases(cluster: LocalCluster) -> None:
    """The node-lifecycle controller judges a node by its Lease: a kwok node whose Lease is not
    renewed flaps NotReady every ~50 s and strands its Running pods NotReady for good (kwok
    never readies a Running pod again). Each kwok node's Lease must be held and renewed well
    within its duration."""
    coordination = k8s.CoordinationV1Api(cluster.api_client())
    nodes = [n.metadata.name for n in cluster.core().list_node(label_selector="type=kwok").items]
    assert nodes

    def renewals() -> dict[str, Any]:
        return {name: coordination.read_namespaced_lease(name, "kube-node-lease").spec for name in nodes}

    first = cluster.wait_for(
        lambda: (leases := renewals()) and all(spec.renew_time for spec in leases.values()) and leases,
        timeout_seconds=NODE_LEASE_SECONDS,
        what="kwok node Leases",
    )
    for name, spec in first.items():
        assert spec.holder_identity, name  # kwok holds it under its own instance id
        assert spec.lease_duration_seconds == NODE_LEASE_SECONDS
    cluster.wait_for(
        lambda: all(spec.renew_time > first[name].renew_time for name, spec in renewals().items()),
        timeout_seconds=NODE_LEASE_SECONDS,
        what="kwok node Leases renewed",
    )
    for name in nodes:
        ready = next(c for c in cluster.core().read_node(name).status.conditions if c.type == "Ready")
        assert ready.status == "True", (name, ready.reason, ready.message)


def test_kubectl_and_helm_talk_to_the_cluster(cluster: LocalCluster, namespace: str) -> None:
    versions = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert versions["serverVersion"]["gitVersion"].startswith("v1.34")
    assert versions["clientVersion"]["gitVersion"].startswith("v1.34")
    helm = cluster.helm("version", "--short").stdout
    assert helm.startswith("v4."), helm
    # helm reaches the API server (an empty release list, not a connection error)
    listing = cluster.helm("list", "--namespace", namespace, "--output", "json").stdout
    assert json.loads(listing) == []
    nodes = cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert f"node/{NODE_NAME}" in nodes


METRICS_SERVER = textwrap.dedent("""
    import http.server, os
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"# TYPE splitserve_e2e_probe_total counter\\nsplitserve_e2e_probe_total 42\\n"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer((os.environ["POD_IP"], 8000), Handler).serve_forever()
""")


def test_prometheus_discovers_and_scrapes_labelled_pod(cluster: LocalCluster, namespace: str, image: str) -> None:
    core: Any = cluster.core()
    labels = {"app": "metrics", LABEL_SCRAPE: "true", LABEL_INSTANCE: "demo"}
    server = ["python", "-c", METRICS_SERVER]
    ports = [{"name": "metrics", "containerPort": 8000}]
    core.create_namespaced_pod(
        namespace, _pod("metrics", image=image, args=server, labels=labels, env=[POD_IP_ENV], ports=ports)
    )
    core.create_namespaced_pod(namespace, _pod("unlabelled", image=image, args=server, env=[POD_IP_ENV], ports=ports))
    started = time.monotonic()
    series: Any = cluster.wait_for(
        lambda: cluster.query(f'splitserve_e2e_probe_total{{namespace="{namespace}"}}'),
        timeout_seconds=60,
        interval_seconds=0.5,
        what="scraped series in Prometheus",
    )
    print(f"first sample in Prometheus after {time.monotonic() - started:.1f}s")
    assert len(series) == 1  # the unlabelled pod is not scraped
    labels_seen = series[0]["metric"]
    assert labels_seen["pod"] == "metrics" and labels_seen["namespace"] == namespace
    assert labels_seen["inferenceservice"] == "demo"
    assert float(series[0]["value"][1]) == 42.0


PRINT_ENV = (
    "import json, os, sys; print('ENV=' + json.dumps(dict(os.environ)) + ' ARGS=' "
    "+ json.dumps(sys.argv[1:]) + ' FILE=' + open('/etc/settings/model').read())"
)


def test_env_sources_and_expansion_reach_the_process(cluster: LocalCluster, namespace: str, image: str) -> None:
    core: Any = cluster.core()
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "settings"}, "data": {"model": "tiny-llama", "BULK": "from-envfrom"}}
    )
    core.create_namespaced_secret(namespace, {"metadata": {"name": "key"}, "stringData": {"api-key": "s3cret"}})
    pod = _pod(
        "env",
        image=image,
        args=[
            "python",
            "-c",
            PRINT_ENV,
            "$(MODEL)",
            "$$(MODEL)",
            "$(NOPE)",
            "/cache/x",
            "--config=/etc/settings/model",
        ],
        restart_policy="Never",
        volumeMounts=[{"name": "cache", "mountPath": "/cache"}, {"name": "settings", "mountPath": "/etc/settings"}],
        envFrom=[{"configMapRef": {"name": "settings"}}],
        env=[
            {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "MODEL", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "model"}}},
            {"name": "SPLITSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "key", "key": "api-key"}}},
            {"name": "COMBINED", "value": "$(MY_NS)/$(MODEL)"},
        ],
    )
    pod["spec"]["volumes"] = [
        {"name": "cache", "emptyDir": {}},
        {"name": "settings", "configMap": {"name": "settings"}},
    ]
    core.create_namespaced_pod(namespace, pod)
    cluster.wait_for(
        lambda: core.read_namespaced_pod("env", namespace).status.phase == "Succeeded",
        timeout_seconds=60,
        what="env pod Succeeded",
    )
    line = next(
        text for text in cluster.pod_log(namespace=namespace, pod="env").splitlines() if text.startswith("ENV=")
    )
    env_json, rest = line[len("ENV=") :].split(" ARGS=")
    args_json, config_file = rest.split(" FILE=")
    env, args = json.loads(env_json), json.loads(args_json)
    assert env["MY_NAME"] == "env" and env["MY_NS"] == namespace
    assert env["MODEL"] == "tiny-llama" and env["BULK"] == "from-envfrom"
    assert env["SPLITSERVE_API_KEY"] == "s3cret"
    assert env["COMBINED"] == f"{namespace}/tiny-llama"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"  # the kubernetes Service's ClusterIP
    assert args == ["tiny-llama", "$(MODEL)", "$(NOPE)", "/cache/x", "--config=/etc/settings/model"]
    assert config_file == "tiny-llama"  # the configMap volume, read inside the container


READ_KEY = "import sys; data = open(sys.argv[1], 'rb').read(); print('KEY=' + data.hex())"


def test_secret_volume_holds_the_secret_bytes(cluster: LocalCluster, namespace: str, image: str) -> None:
    """A secret volume (the operator mounts the KV handoff key this way) holds the Secret's
    bytes as they are, also when they are not text."""
    core: Any = cluster.core()
    key = bytes(range(256))[::-7]  # not valid UTF-8
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "binary"}, "data": {"key": base64.b64encode(key).decode()}}
    )
    pod = _pod(
        "secret-volume",
        image=image,
        args=["python", "-c", READ_KEY, "/var/run/keys/key"],
        restart_policy="Never",
        volumeMounts=[{"name": "keys", "mountPath": "/var/run/keys", "readOnly": True}],
    )
    pod["spec"]["volumes"] = [{"name": "keys", "secret": {"secretName": "binary"}}]
    core.create_namespaced_pod(namespace, pod)
    cluster.wait_for(
        lambda: core.read_namespaced_pod("secret-volume", namespace).status.phase == "Succeeded",
        timeout_seconds=60,
        what="secret-volume pod Succeeded",
    )
    line = next(
        text
        for text in cluster.pod_log(namespace=namespace, pod="secret-volume").splitlines()
        if text.startswith("KEY=")
    )
    assert bytes.fromhex(line[len("KEY=") :]) == key


LIST_PODS = textwrap.dedent("""
    import os
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    config.load_incluster_config()  # the pod's ServiceAccount token
    try:
        client.CoreV1Api().list_namespaced_pod(os.environ["NS"])
        print("RESULT=allowed")
    except ApiException as error:
        print(f"RESULT={error.status}")
""")


def test_service_account_kubeconfig_is_subject_to_rbac(cluster: LocalCluster, namespace: str, image: str) -> None:
    core: Any = cluster.core()
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    kubeconfig = cluster.service_account_kubeconfig(namespace=namespace, service_account="reader")

    def can_list() -> str:
        result = cluster.kubectl("--kubeconfig", str(kubeconfig), "get", "pods", "-n", namespace, check=False)
        return "allowed" if result.returncode == 0 else result.stderr

    assert "forbidden" in can_list().lower()
    # and from inside a pod running as that ServiceAccount (its projected token)
    env = [{"name": "NS", "value": namespace}]
    pod = _pod("denied", image=image, args=["python", "-c", LIST_PODS], restart_policy="Never", env=env)
    pod["spec"]["serviceAccountName"] = "reader"
    core.create_namespaced_pod(namespace, pod)

    rbac: Any = k8s.RbacAuthorizationV1Api(cluster.api_client())
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )

    def pod_result(name: str) -> str:
        line = [
            text for text in cluster.pod_log(namespace=namespace, pod=name).splitlines() if text.startswith("RESULT=")
        ]
        return line[0] if line else ""

    assert cluster.wait_for(lambda: pod_result("denied"), timeout_seconds=60, what="denied pod result") == "RESULT=403"
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    assert cluster.wait_for(lambda: can_list() == "allowed", timeout_seconds=30, what="RBAC grant visible")
    pod = _pod("allowed", image=image, args=["python", "-c", LIST_PODS], restart_policy="Never", env=env)
    pod["spec"]["serviceAccountName"] = "reader"
    core.create_namespaced_pod(namespace, pod)
    assert (
        cluster.wait_for(lambda: pod_result("allowed"), timeout_seconds=60, what="allowed pod result")
        == "RESULT=allowed"
    )
    # the kubeconfig really names the ServiceAccount, not the admin
    result = cluster.kubectl("--kubeconfig", str(kubeconfig), "auth", "whoami", "-o", "json")
    assert json.loads(result.stdout)["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"


def test_existing_cluster_wrapper_reports_missing_node(cluster: LocalCluster) -> None:
    existing = LocalCluster.from_existing(kubeconfig=cluster.kubeconfig)
    assert not existing.managed
    assert NODE_NAME in existing.kubectl("get", "nodes").stdout
    with pytest.raises(NodeUnavailable, match="kubelet node's containerd is not available"):
        existing.container_pid(namespace="default", pod="anything")
    existing.stop()  # a no-op: it must not stop the cluster it does not own
    core: Any = cluster.core()
    assert core.read_node(NODE_NAME).metadata.name == NODE_NAME
