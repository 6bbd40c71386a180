"""The product as a platform team gets it: the image built from this commit, on a real node.

The session's cluster: its kubelet node, and Prometheus on the node's bridge gateway, where
pods reach it. The image is built and pushed to the loopback registry (:func:`splitserve_e2e.image.ensure_image`); containerd pulls
it by name through the CRI (plain HTTP to ``127.0.0.1:5000``) into its root under the cache,
which outlives the cluster: the first run pulls and unpacks several GB, later runs find it
("already present") or fetch only the changed layers of a rebuild.

The chart is installed with ``image.repository``/``image.tag`` pointing at the pushed
reference, into a namespace where Pod Security Admission enforces ``restricted``; the operator
runs there as a container under its ServiceAccount, reaching the API server through the
``kubernetes`` Service and Prometheus at the gateway. An Aggregated InferenceService in a
second restricted namespace downloads ``hf://splitserve/tiny-llama`` from a
:class:`~splitserve_e2e.hub.LocalHub` on the gateway, with the runtime on ``--device cpu``
(as the demo). Checked: it becomes Ready, every container of every pod runs from the pushed
image's digest (``imageID``) with tini as PID 1, a completion through the router Service's
ClusterIP (kube-proxy) is served from the host, and after the runtime process is SIGKILLed the
kubelet restarts the container and requests through the router succeed again.

The stack (namespaces, the chart cluster-scoped, the operator) is set up by
:func:`splitserve_e2e.realnode.real_node_stack`, shared with ``test_real_node_oom.py``.

Figures printed: image build/push, pull (kubelet event), cluster start, time to Ready, and the
pod list with image digests. On a failure the pods' statuses, events and logs (read through
the API) and the node's log tails are printed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, condition, get_isvc
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.kubeletnode import NODE_NAME
from splitserve_e2e.realnode import (
    ISVC_NAME,
    OPERATOR_NAMESPACE,
    RELEASE,
    Stack,
    explained,
    isvc_for_node,
    log,
    operator_pod,
    real_node_stack,
    wait,
)
from splitserve_e2e.stack import MODEL_NAME, SERVED_NAME, ModelHub

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

READY_TIMEOUT_SECONDS = 600.0
RESTART_TIMEOUT_SECONDS = 300.0


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def stack(cluster: LocalCluster, image: str, local_hub: LocalHub, model_hub: ModelHub) -> Iterator[Stack]:
    """The cluster-scoped operator (:func:`~splitserve_e2e.realnode.real_node_stack`) on the
    session's cluster, with three workload namespaces: Aggregated (``stack.namespace``),
    Disaggregated (``stack.workloads[1]``) and Aggregated at tensor parallelism 2
    (``stack.workloads[2]``)."""
    suffix = uuid.uuid4().hex[:4]
    with real_node_stack(
        cluster=cluster,
        image=image,
        hub=local_hub,
        model_hub=model_hub,
        workloads=[f"inference-{suffix}", f"inference-pd-{suffix}", f"inference-tp-{suffix}"],
    ) as result:
        yield result


def _apply_and_wait(
    stack: Stack, *, namespace: str, mode: str, cpu: str, pool: dict[str, Any] | None = None, memory: str | None = None
) -> float:
    """Apply the tiny InferenceService of ``mode`` (hf:// from the hub, ``--device cpu``,
    ``cpu`` requested per pool: the node has the machine's cores; ``pool`` merged into the
    aggregated pool's spec) and wait for Ready; returns the seconds from apply to Ready."""
    cluster = stack.cluster
    manifest = isvc_for_node(stack, namespace=namespace, mode=mode, cpu=cpu, memory=memory)
    if pool:
        manifest["spec"]["aggregated"].update(pool)
    started = time.monotonic()
    apply_object(cluster=cluster, obj=manifest)

    def ready() -> dict[str, Any] | None:
        obj = get_isvc(cluster=cluster, namespace=namespace, name=ISVC_NAME)
        return obj if (condition(obj, "Ready") or {}).get("status") == "True" else None

    wait(
        cluster,
        ready,
        timeout=READY_TIMEOUT_SECONDS,
        what=f"InferenceService {namespace}/{ISVC_NAME} Ready",
        interval=2.0,
    )
    return time.monotonic() - started


@pytest.fixture(scope="module")
def served(stack: Stack) -> Stack:
    """The Aggregated InferenceService applied (hf:// from the hub) and Ready."""
    with explained(stack.cluster, stack.namespaces):
        seconds = _apply_and_wait(stack, namespace=stack.namespace, mode="Aggregated", cpu="500m")
        stack.figures["Aggregated InferenceService apply -> Ready"] = f"{seconds:.1f}s"
        log(f"{stack.namespace}/{ISVC_NAME} (Aggregated) Ready in {seconds:.1f}s")
    return stack


@pytest.fixture(scope="module")
def served_disaggregated(stack: Stack) -> Stack:
    """The Disaggregated InferenceService (prefill + decode + router) Ready in its own
    namespace; small CPU requests, so that it fits next to the Aggregated one."""
    with explained(stack.cluster, stack.namespaces):
        seconds = _apply_and_wait(stack, namespace=stack.workloads[1], mode="Disaggregated", cpu="300m")
        stack.figures["Disaggregated InferenceService apply -> Ready"] = f"{seconds:.1f}s"
        log(f"{stack.workloads[1]}/{ISVC_NAME} (Disaggregated) Ready in {seconds:.1f}s")
    return stack


@pytest.fixture(scope="module")
def served_tensor_parallel(stack: Stack) -> Stack:
    """An Aggregated InferenceService at ``parallelism.tensor: 2`` (two processes in one pod:
    the server and its worker rank, gloo over the pod's loopback) Ready in its own namespace.
    It asks for 2 of the node's 4 advertised GPUs (the Disaggregated one holds the other 2);
    the runtime still computes on the CPU."""
    with explained(stack.cluster, stack.namespaces):
        seconds = _apply_and_wait(
            stack,
            namespace=stack.workloads[2],
            mode="Aggregated",
            cpu="500m",
            memory="3Gi",
            pool={"parallelism": {"tensor": 2}, "resources": {"gpus": 2, "cpu": "500m", "memory": "3Gi"}},
        )
        stack.figures["Aggregated TP 2 InferenceService apply -> Ready"] = f"{seconds:.1f}s"
        log(f"{stack.workloads[2]}/{ISVC_NAME} (Aggregated, tensor 2) Ready in {seconds:.1f}s")
    return stack


# --------------------------------------------------------------------------- helpers
def _pods(stack: Stack, namespaces: list[str]) -> list[Any]:
    core: Any = stack.cluster.core()
    return [pod for namespace in namespaces for pod in core.list_namespaced_pod(namespace).items]


def _pod_table(pods: list[Any]) -> str:
    lines = [f"{'NAMESPACE':<18} {'POD':<36} {'CONTAINER':<9} {'NODE':<19} IMAGE ID"]
    for pod in pods:
        for status in pod.status.container_statuses or []:
            lines.append(
                f"{pod.metadata.namespace:<18} {pod.metadata.name:<36} "
                f"{status.name:<9} {pod.spec.node_name:<19} {status.image_id}"
            )
    return "\n".join(lines)


def _assert_from_the_image(stack: Stack, pods: list[Any]) -> None:
    """Every container: the pushed reference, ready, the manifest digest, tini as PID 1."""
    for pod in pods:
        assert pod.spec.node_name == NODE_NAME, pod.metadata.name
        for spec_container, status in zip(pod.spec.containers, pod.status.container_statuses, strict=True):
            assert spec_container.image == stack.image, pod.metadata.name
            assert spec_container.command is None, pod.metadata.name
            assert status.ready, pod.metadata.name
            assert status.image_id.endswith(f"@{stack.manifest_digest}"), status.image_id
            pid = _main_pid(stack, status.container_id)
            assert Path(_cmdline(pid)[0]).name == "tini", (pod.metadata.name, _cmdline(pid))


def _runtime_pod(stack: Stack, namespace: str | None = None) -> Any:
    core: Any = stack.cluster.core()
    pods = core.list_namespaced_pod(
        namespace or stack.namespace,
        label_selector=f"{contract.LABEL_INSTANCE}={ISVC_NAME},"
        f"{contract.LABEL_COMPONENT}={contract.Role.AGGREGATED.value}",
    ).items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


def _router_url(stack: Stack, namespace: str | None = None) -> str:
    core: Any = stack.cluster.core()
    service = core.read_namespaced_service(f"{ISVC_NAME}-router", namespace or stack.namespace)
    assert service.spec.cluster_ip not in (None, "None"), "the router Service has no ClusterIP"
    return f"http://{service.spec.cluster_ip}:{contract.HTTP_PORT}"


def _complete(url: str, prompt: str) -> dict[str, Any]:
    response = httpx.post(
        f"{url}/v1/completions",
        timeout=60.0,
        json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0},
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _main_pid(stack: Stack, container_id: str) -> int:
    return stack.node.container_pid(container_id)


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


# --------------------------------------------------------------------------- tests
def test_operator_runs_from_the_image_as_a_restricted_container(stack: Stack) -> None:
    with explained(stack.cluster, stack.namespaces):
        pod = operator_pod(stack.cluster)
        assert pod is not None
        assert pod.spec.node_name == NODE_NAME
        assert pod.spec.service_account_name == RELEASE
        container = pod.spec.containers[0]
        assert container.image == stack.image and container.image_pull_policy == "IfNotPresent"
        assert container.command is None and container.args[:2] == ["splitserve", "operator"]
        status = pod.status.container_statuses[0]
        assert status.image_id.endswith(f"@{stack.manifest_digest}"), status.image_id
        pid = _main_pid(stack, status.container_id)
        assert Path(_cmdline(pid)[0]).name == "tini", _cmdline(pid)  # the ENTRYPOINT is PID 1
        proc = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        assert proc["Uid"].split()[:2] == ["65532", "65532"]
        assert int(proc["CapEff"], 16) == 0 and proc["NoNewPrivs"].strip() == "1"
        assert proc["Seccomp"].strip() == "2"
        # the Lease is held by this pod: it reached the API server through the Service
        lease = stack.cluster.kubectl(
            "get", "lease", RELEASE, "-n", OPERATOR_NAMESPACE, "-o", "jsonpath={.spec.holderIdentity}"
        ).stdout
        assert pod.metadata.name in lease, lease


def test_inference_service_becomes_ready_on_the_image(served: Stack) -> None:
    stack = served
    with explained(stack.cluster, stack.namespaces):
        pods = _pods(stack, [OPERATOR_NAMESPACE, stack.namespace])
        print("\n" + _pod_table(pods))
        roles = sorted(str(p.metadata.labels.get(contract.LABEL_COMPONENT, "operator")) for p in pods)
        assert roles == ["aggregated", "operator", "router"], roles
        _assert_from_the_image(stack, pods)
        runtime = _runtime_pod(stack)
        mounts = {m.mount_path for m in runtime.spec.containers[0].volume_mounts}
        assert "/var/cache/splitserve/triton" in mounts
        core: Any = stack.cluster.core()
        for pod in pods:  # nothing tried to write to the read-only root
            log = str(core.read_namespaced_pod_log(pod.metadata.name, pod.metadata.namespace))
            assert "Read-only file system" not in log, f"{pod.metadata.name}:\n{log[-3000:]}"
            assert "Permission denied" not in log, f"{pod.metadata.name}:\n{log[-3000:]}"
        fetched = stack.hub.downloaded(MODEL_NAME)
        assert "config.json" in fetched and "model.safetensors" in fetched, fetched
        obj = get_isvc(cluster=stack.cluster, namespace=stack.namespace, name=ISVC_NAME)
        print(f"conditions: {[(c['type'], c['status'], c.get('reason')) for c in obj['status']['conditions']]}")


def test_completion_through_the_router_cluster_ip(served: Stack) -> None:
    stack = served
    with explained(stack.cluster, stack.namespaces):
        url = _router_url(stack)
        body = wait(
            stack.cluster, lambda: _complete(url, "The kubelet runs"), timeout=60, what=f"a completion from {url}"
        )
        assert body["usage"]["completion_tokens"] == 4, body
        log(f"completion via the router ClusterIP {url}: {body['choices'][0]['text']!r}")


def test_operator_reads_metrics_from_prometheus(served: Stack) -> None:
    stack = served
    with explained(stack.cluster, stack.namespaces):

        def healthy() -> dict[str, Any] | None:
            obj = get_isvc(cluster=stack.cluster, namespace=stack.namespace, name=ISVC_NAME)
            found = condition(obj, "MetricsHealthy") or {}
            return found if found.get("status") == "True" else None

        found = wait(stack.cluster, healthy, timeout=180, what="MetricsHealthy=True", interval=2.0)
        log(f"MetricsHealthy: {found.get('reason')} {found.get('message', '')}")


def test_killed_runtime_is_restarted_and_served_again(served: Stack) -> None:
    stack = served
    with explained(stack.cluster, stack.namespaces):
        url = _router_url(stack)
        before = _runtime_pod(stack)
        status = before.status.container_statuses[0]
        tini = _main_pid(stack, status.container_id)
        serve = [pid for pid in _children(tini) if "serve" in _cmdline(pid)]
        assert len(serve) == 1, [(pid, _cmdline(pid)) for pid in _children(tini)]
        log(f"SIGKILL to the runtime process {serve[0]} (child of tini {tini}) in {before.metadata.name}")
        killed_at = time.monotonic()
        os.kill(serve[0], signal.SIGKILL)

        def restarted_and_ready() -> Any:
            pod = _runtime_pod(stack)
            current = pod.status.container_statuses[0]
            return pod if current.restart_count > status.restart_count and current.ready else None

        after = wait(
            stack.cluster,
            restarted_and_ready,
            timeout=RESTART_TIMEOUT_SECONDS,
            what="the runtime container restarted by the kubelet and Ready",
            interval=1.0,
        )
        current = after.status.container_statuses[0]
        assert after.metadata.uid == before.metadata.uid  # the same pod: a container restart
        assert current.last_state.terminated is not None, current.last_state
        assert current.container_id != status.container_id
        restarted = time.monotonic() - killed_at
        body = wait(
            stack.cluster,
            lambda: _complete(url, "After the restart"),
            timeout=120,
            what="a completion through the router after the restart",
        )
        served_again = time.monotonic() - killed_at
        assert body["usage"]["completion_tokens"] == 4
        for i in range(5):
            _complete(url, f"steady {i}")
        stack.figures["runtime SIGKILL -> container Ready again"] = f"{restarted:.1f}s"
        stack.figures["runtime SIGKILL -> served through the router again"] = f"{served_again:.1f}s"
        log(
            f"restarted (exit {current.last_state.terminated.exit_code}, "
            f"{current.last_state.terminated.reason}) and Ready {restarted:.1f}s after the kill; "
            f"served again through the router after {served_again:.1f}s"
        )


def test_disaggregated_serves_through_prefill_and_decode(served_disaggregated: Stack) -> None:
    stack = served_disaggregated
    with explained(stack.cluster, stack.namespaces):
        pods = _pods(stack, [stack.workloads[1]])
        print("\n" + _pod_table(pods))
        roles = sorted(str(p.metadata.labels[contract.LABEL_COMPONENT]) for p in pods)
        assert roles == ["decode", "prefill", "router"], roles
        _assert_from_the_image(stack, pods)
        url = _router_url(stack, stack.workloads[1])
        # Ready pods are not yet pods the router sends to: its health poll admits them (every
        # 2 s), and until it has a prefill pod it sends prompts to decode directly.
        wait(
            stack.cluster,
            lambda: _healthy_behind_router(url) == {"prefill": 1, "decode": 1, "aggregated": 0},
            timeout=60,
            what=f"the router at {url} counting one healthy prefill and one decode pod",
        )
        for i in range(3):
            body = wait(
                stack.cluster,
                functools.partial(_complete, url, f"Prefill then decode {i}"),
                timeout=60,
                what=f"a completion from {url}",
            )
            assert body["usage"]["completion_tokens"] == 4, body
        # the KV cache went from the prefill pod to the decode pod over the pod network
        transferred = {
            str(p.metadata.labels[contract.LABEL_COMPONENT]): _kv_bytes(p)
            for p in pods
            if p.metadata.labels[contract.LABEL_COMPONENT] != "router"
        }
        assert all(value > 0 for value in transferred.values()), transferred
        log(f"Disaggregated: completions via the router ClusterIP {url}; KV bytes {transferred}")


def _healthy_behind_router(url: str) -> dict[str, float]:
    """``splitserve_router_healthy_pods`` by upstream role, from the router's /metrics."""
    text = httpx.get(f"{url}{contract.METRICS_PATH}", timeout=10.0).text
    return {
        line.split('upstream="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("splitserve_router_healthy_pods{")
    }


def _kv_bytes(pod: Any) -> float:
    """``splitserve_kv_transfer_bytes_total`` summed over its labels, from the pod's /metrics."""
    text = httpx.get(f"http://{pod.status.pod_ip}:{contract.HTTP_PORT}{contract.METRICS_PATH}", timeout=10.0).text
    name = contract.Metric.KV_TRANSFER_BYTES_TOTAL
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_tensor_parallel_pool_runs_two_ranks_in_one_pod_and_serves(
    served: Stack, served_tensor_parallel: Stack
) -> None:
    stack = served_tensor_parallel
    namespace = stack.workloads[2]
    with explained(stack.cluster, stack.namespaces):
        pods = _pods(stack, [namespace])
        print("\n" + _pod_table(pods))
        _assert_from_the_image(stack, pods)
        runtime = _runtime_pod(stack, namespace)
        container = runtime.spec.containers[0]
        assert container.args[container.args.index("--tensor-parallel-size") + 1] == "2", container.args
        assert container.resources.limits["nvidia.com/gpu"] == "2"
        assert "/dev/shm" in {m.mount_path for m in container.volume_mounts}
        tini = _main_pid(stack, runtime.status.container_statuses[0].container_id)
        (serve,) = [pid for pid in _children(tini) if "serve" in _cmdline(pid)]
        workers = [
            _cmdline(pid)
            for pid in _children(serve)
            if "splitserve_runtime.engine.parallel.worker" in " ".join(_cmdline(pid))
        ]
        assert len(workers) == 1 and workers[0][workers[0].index("--rank") + 1] == "1", workers
        prompts = [f"Two ranks, one answer {i}" for i in range(3)]
        url, single = _router_url(stack, namespace), _router_url(stack)
        for prompt in prompts:  # greedy: the same model at TP 1 answers the same
            body = wait(
                stack.cluster, functools.partial(_complete, url, prompt), timeout=60, what=f"a completion from {url}"
            )
            assert body["choices"][0]["text"] == _complete(single, prompt)["choices"][0]["text"], prompt
        log(f"tensor parallel 2: worker rank {workers[0][:6]}...; answers equal the TP 1 pool's")
