"""The LeaderWorkerSet controller (``sigs.k8s.io/lws`` v0.7.0, built from its module) in the
local cluster, with its webhooks.

A multi-node splitserve pool is an LWS; its pods find each other through what the LWS controller
and its pod webhook give them (labels, a headless Service, ``LWS_*`` env). These tests pin that
contract on the real controller before the product relies on it: pods go to kwok GPU nodes
(scheduled, then marked Running and Ready by kwok, no containers), so the module is quick; the
containers' side is the integrated multi-node test's.

Each test makes its own LeaderWorkerSet in its own namespace (the order may be shuffled).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s
from prometheus_client.parser import text_string_to_metric_families

from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.kwok import (
    GPU_RESOURCE,
    KWOK_NODE_LABEL,
    KWOK_NODE_LABEL_VALUE,
    kwok_toleration,
)
from splitserve_e2e.lws import (
    API_GROUP,
    API_VERSION,
    GROUP_INDEX_LABEL,
    GROUP_SIZE_ENV,
    LEADER_ADDRESS_ENV,
    PLURAL,
    SET_NAME_LABEL,
    WORKER_INDEX_ENV,
    WORKER_INDEX_LABEL,
    LwsController,
    controller_configuration,
    ensure_lws,
    start_lws,
    webhook_configurations,
)

pytestmark = pytest.mark.e2e

WAIT_SECONDS = 60.0


@pytest.fixture(scope="module")
def lws(cluster: LocalCluster) -> Iterator[LwsController]:
    """The controller for the module; after it stops, its webhook configurations are gone and
    a pod its fail-closed pod webhooks would match is admitted again."""
    controller = start_lws(cluster)
    print(
        f"\nLWS controller up (CRD Established, webhooks answer) in "
        f"{controller.start_seconds:.1f}s at {controller.webhook_url}"
    )
    yield controller
    controller.stop()
    assert not controller.process.running()
    for kind, name in controller.webhook_configurations:
        left = cluster.kubectl("get", kind.lower(), name, "--ignore-not-found", "-o", "name")
        assert left.stdout.strip() == "", f"{kind} {name} left behind after stop"
    admitted = cluster.kubectl(
        "create", "--dry-run=server", "-o", "name", "-f", "-", input_text=json.dumps(lws_labelled_pod())
    )
    assert admitted.stdout.strip() == "pod/lws-labelled"


def lws_labelled_pod() -> dict[str, Any]:
    """A pod that claims to belong to an LWS without the controller's annotations: upstream's
    pod webhook (objectSelector: the LWS name label; failurePolicy Fail) refuses it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "lws-labelled", "namespace": "default", "labels": {SET_NAME_LABEL: "nobody"}},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }


def lws_manifest(*, name: str, namespace: str, replicas: int, size: int) -> dict[str, Any]:
    """An LWS whose groups are ``size`` one-GPU pods on the kwok GPU nodes."""
    pod_spec = {
        "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE},
        "tolerations": [kwok_toleration()],
        "containers": [
            {
                "name": "rank",
                "image": "splitserve-e2e/not-pulled-on-kwok",
                "env": [{"name": "ROLE_HINT", "value": "kept"}],
                "resources": {"limits": {GPU_RESOURCE: "1"}, "requests": {GPU_RESOURCE: "1"}},
            }
        ],
    }
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
            },
        },
    }


def apply(cluster: LocalCluster, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input_text=json.dumps(manifest))


def lws_pods(cluster: LocalCluster, *, namespace: str, name: str) -> list[Any]:
    pods: Any = cluster.core().list_namespaced_pod(namespace, label_selector=f"{SET_NAME_LABEL}={name}")
    return sorted((p for p in pods.items if p.metadata.deletion_timestamp is None), key=lambda p: p.metadata.name)


def wait_for_pods(cluster: LocalCluster, *, namespace: str, name: str, count: int, ready: bool = False) -> list[Any]:
    def found() -> list[Any] | None:
        pods = lws_pods(cluster, namespace=namespace, name=name)
        if len(pods) != count or not all(p.spec.node_name for p in pods):
            return None
        if ready and not all(
            any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or [])) for p in pods
        ):
            return None
        return pods

    pods: list[Any] = cluster.wait_for(
        found,
        timeout_seconds=WAIT_SECONDS,
        interval_seconds=0.5,
        what=f"{count} {'Ready ' if ready else ''}pods of LWS {namespace}/{name}",
    )
    return pods


def env_of(pod: Any) -> dict[str, str]:
    return {e.name: e.value for e in (pod.spec.containers[0].env or [])}


def read_lws(cluster: LocalCluster, *, namespace: str, name: str) -> dict[str, Any]:
    custom: Any = cluster.custom()
    found: dict[str, Any] = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
    return found


def test_webhook_configurations_are_upstreams_pointed_at_the_host() -> None:
    """Upstream's four webhooks, with the objectSelector its kustomize patches give the pod
    webhooks, fail-closed, called at the host URL with the harness's CA; no rotator."""
    configurations = webhook_configurations(ensure_lws(), base_url="https://127.0.0.1:9443", ca_bundle=b"PEM")
    by_name = {(c["kind"], c["metadata"]["name"]): c for c in configurations}
    assert sorted(by_name) == [
        ("MutatingWebhookConfiguration", "lws-mutating-webhook-configuration"),
        ("ValidatingWebhookConfiguration", "lws-validating-webhook-configuration"),
    ]
    webhooks = {w["name"]: w for c in configurations for w in c["webhooks"]}
    assert webhooks["mpod.kb.io"]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate--v1-pod",
        "caBundle": "UEVN",
    }
    assert (
        webhooks["vleaderworkerset.kb.io"]["clientConfig"]["url"]
        == "https://127.0.0.1:9443/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset"
    )
    for pod_webhook in ("mpod.kb.io", "vpod.kb.io"):
        assert webhooks[pod_webhook]["objectSelector"] == {
            "matchExpressions": [{"key": SET_NAME_LABEL, "operator": "Exists"}]
        }
    assert {w["failurePolicy"] for w in webhooks.values()} == {"Fail"}
    config = controller_configuration(
        webhook_host="127.0.0.1",
        webhook_port=1,
        cert_dir=Path("/c"),
        metrics_address="127.0.0.1:2",
        health_address="127.0.0.1:3",
    )
    assert config["internalCertManagement"] == {"enable": False}
    assert config["leaderElection"] == {"leaderElect": False}


def test_groups_get_leader_workers_labels_env_and_headless_service(
    cluster: LocalCluster, lws: LwsController, namespace: str
) -> None:
    name = "ranks"
    started = time.monotonic()
    apply(cluster, lws_manifest(name=name, namespace=namespace, replicas=2, size=2))
    pods = wait_for_pods(cluster, namespace=namespace, name=name, count=4)
    print(f"\nLWS replicas 2 size 2 -> 4 pods bound in {time.monotonic() - started:.1f}s")
    by_name = {p.metadata.name: p for p in pods}
    assert sorted(by_name) == [f"{name}-0", f"{name}-0-1", f"{name}-1", f"{name}-1-1"]
    for group in (0, 1):
        for worker, pod_name in ((0, f"{name}-{group}"), (1, f"{name}-{group}-1")):
            pod = by_name[pod_name]
            labels = pod.metadata.labels
            assert labels[SET_NAME_LABEL] == name
            assert labels[GROUP_INDEX_LABEL] == str(group)
            assert labels[WORKER_INDEX_LABEL] == str(worker)
            assert labels["app"] == name
            env = env_of(pod)
            assert env[LEADER_ADDRESS_ENV] == f"{name}-{group}.{name}.{namespace}", pod_name
            assert env[GROUP_SIZE_ENV] == "2"
            assert env[WORKER_INDEX_ENV] == str(worker)
            assert env["ROLE_HINT"] == "kept"  # the template's own env stays
            assert pod.spec.subdomain == name  # the leader address resolves via the Service
            node: Any = cluster.core().read_node(pod.spec.node_name)
            assert node.metadata.labels[KWOK_NODE_LABEL] == KWOK_NODE_LABEL_VALUE
    service: Any = cluster.core().read_namespaced_service(name, namespace)
    assert service.spec.cluster_ip == "None"  # headless: one DNS record per pod
    assert service.spec.selector == {SET_NAME_LABEL: name}
    assert service.spec.publish_not_ready_addresses is True
    # the validating webhook holds LWS names to DNS-1035 (the Service is named after it)
    refused = cluster.kubectl(
        "apply",
        "--server-side",
        "-f",
        "-",
        check=False,
        input_text=json.dumps(lws_manifest(name="9ranks", namespace=namespace, replicas=1, size=2)),
    )
    assert refused.returncode != 0
    assert "vleaderworkerset.kb.io" in refused.stderr, refused.stderr
    assert "a DNS-1035 label must consist of" in refused.stderr, refused.stderr
    # the pod webhook runs for every pod with the LWS name label, fail-closed
    refused = cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", check=False, input_text=json.dumps(lws_labelled_pod())
    )
    assert refused.returncode != 0
    assert "mpod.kb.io" in refused.stderr, refused.stderr
    assert "size annotation is unexpectedly missing" in refused.stderr, refused.stderr


def test_scale_subresource_adds_and_removes_groups(cluster: LocalCluster, lws: LwsController, namespace: str) -> None:
    name = "scaled"
    apply(cluster, lws_manifest(name=name, namespace=namespace, replicas=1, size=2))
    wait_for_pods(cluster, namespace=namespace, name=name, count=2)
    started = time.monotonic()
    cluster.kubectl("scale", "-n", namespace, f"lws/{name}", "--replicas=3")
    pods = wait_for_pods(cluster, namespace=namespace, name=name, count=6)
    print(f"\nscale 1 -> 3 groups: 6 pods bound in {time.monotonic() - started:.1f}s")
    groups = sorted({p.metadata.labels[GROUP_INDEX_LABEL] for p in pods})
    assert groups == ["0", "1", "2"]
    assert read_lws(cluster, namespace=namespace, name=name)["spec"]["replicas"] == 3
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3
    cluster.wait_for(
        lambda: read_lws(cluster, namespace=namespace, name=name).get("status", {}).get("hpaPodSelector"),
        timeout_seconds=WAIT_SECONDS,
        interval_seconds=0.5,
        what="status.hpaPodSelector",
    )
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}/scale"
        ).stdout
    )
    # what an autoscaler selects by: the leaders of this LWS
    assert f"{SET_NAME_LABEL}={name}" in scale["status"]["selector"]
    assert f"{WORKER_INDEX_LABEL}=0" in scale["status"]["selector"]
    cluster.kubectl("scale", "-n", namespace, f"lws/{name}", "--replicas=1")
    pods = wait_for_pods(cluster, namespace=namespace, name=name, count=2)
    assert {p.metadata.labels[GROUP_INDEX_LABEL] for p in pods} == {"0"}


def test_status_counts_ready_groups(cluster: LocalCluster, lws: LwsController, namespace: str) -> None:
    name = "readiness"
    started = time.monotonic()
    apply(cluster, lws_manifest(name=name, namespace=namespace, replicas=2, size=3))
    wait_for_pods(cluster, namespace=namespace, name=name, count=6, ready=True)

    def ready_status() -> dict[str, Any] | None:
        status: dict[str, Any] = read_lws(cluster, namespace=namespace, name=name).get("status", {})
        available = any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", []))
        return status if status.get("readyReplicas") == 2 and available else None

    status: dict[str, Any] = cluster.wait_for(
        ready_status, timeout_seconds=WAIT_SECONDS, interval_seconds=0.5, what=f"LWS {name} readyReplicas 2, Available"
    )
    print(f"\nLWS replicas 2 size 3 -> readyReplicas 2 in {time.monotonic() - started:.1f}s")
    assert status["replicas"] == 2
    assert status["updatedReplicas"] == 2
    printed = cluster.kubectl("get", "-n", namespace, f"lws/{name}", "-o", "wide").stdout
    print(printed)


def test_metrics_on_their_port_behind_token_review(cluster: LocalCluster, lws: LwsController, namespace: str) -> None:
    """Upstream's metrics endpoint, on the harness's free port: 401 without a token; with a
    ServiceAccount token that RBAC lets read /metrics (``system:monitoring``), the controller's
    reconcile counters."""
    # verify=False: controller-runtime serves metrics with a self-signed certificate it makes
    assert httpx.get(lws.metrics_url, verify=False, timeout=5.0).status_code == 401
    binding = f"lws-metrics-{namespace}"
    rbac: Any = k8s.RbacAuthorizationV1Api(cluster.api_client())
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:monitoring"},
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        }
    )
    try:
        core: Any = cluster.core()
        token = core.create_namespaced_service_account_token(
            "default", namespace, {"spec": {"expirationSeconds": 600}}
        ).status.token
        apply(cluster, lws_manifest(name="counted", namespace=namespace, replicas=1, size=2))
        wait_for_pods(cluster, namespace=namespace, name="counted", count=2)

        def reconciles() -> float | None:
            text = (
                httpx.get(lws.metrics_url, verify=False, timeout=5.0, headers={"Authorization": f"Bearer {token}"})
                .raise_for_status()
                .text
            )
            total = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "controller_runtime_reconcile_total"
                and sample.labels.get("controller") == "leaderworkerset"
                and sample.labels.get("result") == "success"
            )
            return total or None

        total = cluster.wait_for(
            reconciles, timeout_seconds=30, interval_seconds=1.0, what="LWS reconcile counters on the metrics endpoint"
        )
        assert total >= 1
    finally:
        rbac.delete_cluster_role_binding(binding)
