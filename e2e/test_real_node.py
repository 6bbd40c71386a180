"""The product as a platform team gets it: the image built from this commit, on a real node.

One cluster for the module with only the kubelet node (no kwok nodes, no process-based local
node) and Prometheus on the node's bridge gateway, where pods reach it. The image is built and
pushed to the loopback registry (:func:`splitserve_e2e.image.ensure_image`); containerd pulls
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

Figures printed: image build/push, pull (kubelet event), cluster start, time to Ready, and the
pod list with image digests. On a failure the pods' statuses, events and logs (read through
the API) and the node's log tails are printed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import ClusterOptions, LocalCluster
from splitserve_e2e.demo import (
    CHART,
    MODEL_NAME,
    ROLES_BY_MODE,
    SERVED_NAME,
    ModelHub,
    apply_object,
    condition,
    create_hub_token_secret,
    ensure_model_cache,
    get_isvc,
    isvc_manifest,
)
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.image import ensure_image, registry_manifest
from splitserve_e2e.kubeletnode import NODE_NAME, KubeletNode
from splitserve_e2e.nodehost import is_cgroup_v1

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

T = TypeVar("T")
RELEASE = "splitserve"
OPERATOR_NAMESPACE = "splitserve-system"
ISVC_NAME = "tiny"
HUB_TOKEN = "hf_real_node_token"
PULL_TIMEOUT_SECONDS = 1200.0  # a cold pull: ~3 GB gzip layers, unpacked to 5.6 GB, 2 cores
READY_TIMEOUT_SECONDS = 600.0
RESTART_TIMEOUT_SECONDS = 300.0


def _missing_prerequisites() -> list[str]:
    missing = [tool for tool in ("containerd", "ctr", "runc", "iptables", "ip", "buildah")
               if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if not Path("/usr/lib/cni/bridge").is_file():
        missing.append("containernetworking-plugins")
    if not is_cgroup_v1():
        missing.append("cgroup v1 hierarchies")
    return missing


def _log(message: str) -> None:
    print(f"[real-node {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------- diagnostics
def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"({error})"


def diagnostics(cluster: LocalCluster, namespaces: list[str]) -> str:
    """Pod statuses, recent events and container logs (all through the API), node logs."""
    core: Any = cluster.core()
    out: list[str] = []
    for namespace in namespaces:
        with contextlib.suppress(Exception):
            for pod in core.list_namespaced_pod(namespace).items:
                out.append(f"--- pod {namespace}/{pod.metadata.name} phase={pod.status.phase} "
                           f"node={pod.spec.node_name} ip={pod.status.pod_ip}")
                for status in pod.status.container_statuses or []:
                    out.append(f"  {status.name}: ready={status.ready} "
                               f"restarts={status.restart_count} state={status.state} "
                               f"last={status.last_state} imageID={status.image_id}")
                    for previous in (False, True) if status.restart_count else (False,):
                        with contextlib.suppress(Exception):
                            log = core.read_namespaced_pod_log(
                                pod.metadata.name, namespace, container=status.name,
                                tail_lines=40, previous=previous)
                            out.append(f"  log{' (previous)' if previous else ''}:\n{log}")
        with contextlib.suppress(Exception):
            events = core.list_namespaced_event(namespace).items
            events.sort(key=lambda e: e.last_timestamp or e.event_time or e.metadata.creation_timestamp)
            out.append(f"--- events in {namespace}:")
            out += [f"  {e.type} {e.reason} {e.involved_object.kind}/{e.involved_object.name}: "
                    f"{e.message}" for e in events[-30:]]
    for name in ("kubelet.log", "containerd.log", "kube-proxy.log", "prometheus.log"):
        out.append(f"--- {name} (tail):\n{_tail(cluster.log_dir / name, 25)}")
    return "\n".join(out)


@contextlib.contextmanager
def explained(cluster: LocalCluster, namespaces: list[str]) -> Iterator[None]:
    """On any failure inside, print :func:`diagnostics` before it propagates."""
    try:
        yield
    except BaseException:
        print(f"\n===== diagnostics =====\n{diagnostics(cluster, namespaces)}", flush=True)
        raise


def wait(cluster: LocalCluster, predicate: Callable[[], T | None], *, timeout: float,
         what: str, interval: float = 1.0) -> T:
    return cluster.wait_for(predicate, timeout_seconds=timeout, interval_seconds=interval,
                            what=what)


# --------------------------------------------------------------------------- fixtures
@dataclass
class Stack:
    """What the module set up, with the figures it measured."""

    cluster: LocalCluster
    image: str
    manifest_digest: str
    hub: LocalHub
    namespace: str
    pd_namespace: str
    figures: dict[str, str]

    @property
    def node(self) -> KubeletNode:
        assert self.cluster.kubelet_node is not None
        return self.cluster.kubelet_node

    @property
    def namespaces(self) -> list[str]:
        return [OPERATOR_NAMESPACE, self.namespace, self.pd_namespace]


def _restricted_namespace(cluster: LocalCluster, name: str) -> None:
    core: Any = cluster.core()
    core.create_namespace({"metadata": {"name": name, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest"}}})
    wait(cluster, lambda: core.read_namespaced_service_account("default", name), timeout=60,
         what=f"ServiceAccount {name}/default", interval=0.5)


def _pull_event(cluster: LocalCluster, namespace: str, pod: str) -> str:
    """The kubelet's Pulled event of ``pod`` ("Successfully pulled ... in 1m2s" or
    "... already present on machine")."""
    core: Any = cluster.core()
    events = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod},reason=Pulled").items
    return str(events[-1].message) if events else ""


def _install_chart(stack: Stack) -> None:
    cluster = stack.cluster
    repository, tag = stack.image.rsplit(":", 1)
    prometheus = cluster.prometheus_url
    assert prometheus and prometheus.startswith(f"http://{stack.node.network.gateway}:"), prometheus
    interval = cluster.options.scrape_interval_seconds
    cluster.helm("install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE,
                 "--set-string", f"image.repository={repository}",
                 "--set-string", f"image.tag={tag}",
                 "--set-string", "image.pullPolicy=IfNotPresent",
                 "--set", "replicaCount=1",
                 "--set-string", f"prometheus.url={prometheus}",
                 "--set", f"prometheus.scrapeIntervalSeconds={interval:g}",
                 "--set", f"prometheus.windowSeconds={max(3 * interval, 6):g}",
                 "--set", f"router.namespaces={{{stack.namespace},{stack.pd_namespace}}}",
                 timeout_seconds=180)


def _operator_pod(cluster: LocalCluster) -> Any:
    core: Any = cluster.core()
    pods = core.list_namespaced_pod(
        OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=operator").items
    ready = [p for p in pods if p.status.container_statuses
             and all(s.ready for s in p.status.container_statuses)]
    return ready[0] if ready else None


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    missing = _missing_prerequisites()
    if missing:
        pytest.skip(f"the kubelet node and the image need {', '.join(missing)}")
    figures: dict[str, str] = {}
    started = time.monotonic()
    image = ensure_image()  # built from this working tree; a no-change call takes seconds
    figures["image build+push (ensure_image)"] = f"{time.monotonic() - started:.1f}s"
    found = registry_manifest(image.rsplit(":", 1)[1])
    assert found is not None, f"{image} is not in the loopback registry"
    _log(f"image {image} (manifest {found[0]})")

    runs = cache_root() / "e2e-runs"
    runs.mkdir(parents=True, exist_ok=True)
    state_dir = Path(tempfile.mkdtemp(prefix="rn-", dir=runs))  # short: unix socket paths
    cluster = LocalCluster(state_dir=state_dir, options=ClusterOptions(
        num_gpu_nodes=0, with_local_node=False, with_prometheus=True, with_kubelet_node=True,
        scrape_interval_seconds=2.0))
    model_dir = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
    failures_before = request.session.testsfailed
    hub: LocalHub | None = None
    suffix = uuid.uuid4().hex[:4]
    namespace, pd_namespace = f"inference-{suffix}", f"inference-pd-{suffix}"
    try:
        cluster.start()
        node = cluster.kubelet_node
        assert node is not None
        figures["cluster start (with kubelet node)"] = f"{cluster.start_seconds:.1f}s"
        figures["kubelet node process start -> Ready"] = f"{node.ready_seconds:.1f}s"
        _log(f"cluster started in {cluster.start_seconds:.1f}s (state {state_dir}); "
             f"Prometheus {cluster.prometheus_url}")
        hub = LocalHub(tmp_path_factory.mktemp("hub"), token=HUB_TOKEN,
                       host=node.network.gateway).start()
        hub.publish(MODEL_NAME, model_dir)
        result = Stack(cluster=cluster, image=image, manifest_digest=found[0], hub=hub,
                       namespace=namespace, pd_namespace=pd_namespace, figures=figures)
        with explained(cluster, result.namespaces):
            for name in result.namespaces:
                _restricted_namespace(cluster, name)
            started = time.monotonic()
            _install_chart(result)
            operator = wait(cluster, lambda: _operator_pod(cluster), timeout=PULL_TIMEOUT_SECONDS,
                            what="the operator pod Ready (includes pulling the image)")
            figures["helm install -> operator Ready"] = f"{time.monotonic() - started:.1f}s"
            figures["operator image pull (kubelet)"] = _pull_event(
                cluster, OPERATOR_NAMESPACE, operator.metadata.name)
            _log(f"operator Ready; {figures['operator image pull (kubelet)']}")
            removed = node.containerd.remove_images(prefix=image.rsplit(":", 1)[0] + ":",
                                                    keep=image)
            if removed:
                _log(f"removed older builds from containerd's shared root: {removed}")
        yield result
    finally:
        if hub is not None:
            hub.stop()
        cluster.stop()
        if request.session.testsfailed == failures_before:
            shutil.rmtree(state_dir, ignore_errors=True)
        else:
            print(f"kubelet node state and logs kept in {state_dir}")
        print("\nfigures:\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))


def _apply_and_wait(stack: Stack, *, namespace: str, mode: str, cpu: str) -> float:
    """Apply the tiny InferenceService of ``mode`` (hf:// from the hub, ``--device cpu``,
    ``cpu`` requested per pool: the node has the machine's cores) and wait for Ready;
    returns the seconds from apply to Ready."""
    cluster = stack.cluster
    create_hub_token_secret(cluster=cluster, namespace=namespace, token=HUB_TOKEN)
    manifest = isvc_manifest(name=ISVC_NAME, namespace=namespace, mode=mode,
                             hub=ModelHub(endpoint=stack.hub.endpoint), max_replicas=1)
    spec = manifest["spec"]
    for role in ROLES_BY_MODE[mode]:
        spec[role].pop("nodeSelector", None)  # only the kubelet node here
        spec[role]["resources"]["cpu"] = cpu
    spec["runtime"]["imagePullPolicy"] = "IfNotPresent"
    assert spec["runtime"]["extraArgs"][:2] == ["--device", "cpu"], spec["runtime"]
    started = time.monotonic()
    apply_object(cluster=cluster, obj=manifest)

    def ready() -> dict[str, Any] | None:
        obj = get_isvc(cluster=cluster, namespace=namespace, name=ISVC_NAME)
        return obj if (condition(obj, "Ready") or {}).get("status") == "True" else None
    wait(cluster, ready, timeout=READY_TIMEOUT_SECONDS,
         what=f"InferenceService {namespace}/{ISVC_NAME} Ready", interval=2.0)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def served(stack: Stack) -> Stack:
    """The Aggregated InferenceService applied (hf:// from the hub) and Ready."""
    with explained(stack.cluster, stack.namespaces):
        seconds = _apply_and_wait(stack, namespace=stack.namespace, mode="Aggregated", cpu="1")
        stack.figures["Aggregated InferenceService apply -> Ready"] = f"{seconds:.1f}s"
        _log(f"{stack.namespace}/{ISVC_NAME} (Aggregated) Ready in {seconds:.1f}s")
    return stack


@pytest.fixture(scope="module")
def served_disaggregated(stack: Stack) -> Stack:
    """The Disaggregated InferenceService (prefill + decode + router) Ready in its own
    namespace; small CPU requests, so that it fits next to the Aggregated one."""
    with explained(stack.cluster, stack.namespaces):
        seconds = _apply_and_wait(stack, namespace=stack.pd_namespace, mode="Disaggregated",
                                  cpu="300m")
        stack.figures["Disaggregated InferenceService apply -> Ready"] = f"{seconds:.1f}s"
        _log(f"{stack.pd_namespace}/{ISVC_NAME} (Disaggregated) Ready in {seconds:.1f}s")
    return stack


# --------------------------------------------------------------------------- helpers
def _pods(stack: Stack, namespaces: list[str]) -> list[Any]:
    core: Any = stack.cluster.core()
    return [pod for namespace in namespaces for pod in core.list_namespaced_pod(namespace).items]


def _pod_table(pods: list[Any]) -> str:
    lines = [f"{'NAMESPACE':<18} {'POD':<36} {'CONTAINER':<9} {'NODE':<19} IMAGE ID"]
    for pod in pods:
        for status in pod.status.container_statuses or []:
            lines.append(f"{pod.metadata.namespace:<18} {pod.metadata.name:<36} "
                         f"{status.name:<9} {pod.spec.node_name:<19} {status.image_id}")
    return "\n".join(lines)


def _assert_from_the_image(stack: Stack, pods: list[Any]) -> None:
    """Every container: the pushed reference, ready, the manifest digest, tini as PID 1."""
    for pod in pods:
        assert pod.spec.node_name == NODE_NAME, pod.metadata.name
        for spec_container, status in zip(pod.spec.containers,
                                          pod.status.container_statuses, strict=True):
            assert spec_container.image == stack.image, pod.metadata.name
            assert spec_container.command is None, pod.metadata.name
            assert status.ready, pod.metadata.name
            assert status.image_id.endswith(f"@{stack.manifest_digest}"), status.image_id
            pid = _main_pid(stack, status.container_id)
            assert Path(_cmdline(pid)[0]).name == "tini", (pod.metadata.name, _cmdline(pid))


def _runtime_pod(stack: Stack) -> Any:
    core: Any = stack.cluster.core()
    pods = core.list_namespaced_pod(
        stack.namespace, label_selector=f"{contract.LABEL_INSTANCE}={ISVC_NAME},"
                                        f"{contract.LABEL_COMPONENT}={contract.Role.AGGREGATED.value}").items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


def _router_url(stack: Stack, namespace: str | None = None) -> str:
    core: Any = stack.cluster.core()
    service = core.read_namespaced_service(f"{ISVC_NAME}-router", namespace or stack.namespace)
    assert service.spec.cluster_ip not in (None, "None"), "the router Service has no ClusterIP"
    return f"http://{service.spec.cluster_ip}:{contract.HTTP_PORT}"


def _complete(url: str, prompt: str) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", timeout=60.0, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0})
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
        pod = _operator_pod(stack.cluster)
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
        proc = dict(line.split(":", 1) for line in
                    Path(f"/proc/{pid}/status").read_text().splitlines())
        assert proc["Uid"].split()[:2] == ["65532", "65532"]
        assert int(proc["CapEff"], 16) == 0 and proc["NoNewPrivs"].strip() == "1"
        assert proc["Seccomp"].strip() == "2"
        # the Lease is held by this pod: it reached the API server through the Service
        lease = stack.cluster.kubectl("get", "lease", RELEASE, "-n", OPERATOR_NAMESPACE, "-o",
                                      "jsonpath={.spec.holderIdentity}").stdout
        assert pod.metadata.name in lease, lease


def test_inference_service_becomes_ready_on_the_image(served: Stack) -> None:
    stack = served
    with explained(stack.cluster, stack.namespaces):
        pods = _pods(stack, [OPERATOR_NAMESPACE, stack.namespace])
        print("\n" + _pod_table(pods))
        roles = sorted(str(p.metadata.labels.get(contract.LABEL_COMPONENT, "operator"))
                       for p in pods)
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
        body = wait(stack.cluster, lambda: _complete(url, "The kubelet runs"), timeout=60,
                    what=f"a completion from {url}")
        assert body["usage"]["completion_tokens"] == 4, body
        _log(f"completion via the router ClusterIP {url}: {body['choices'][0]['text']!r}")


def test_operator_reads_metrics_from_prometheus(served: Stack) -> None:
    stack = served
    with explained(stack.cluster, stack.namespaces):
        def healthy() -> dict[str, Any] | None:
            obj = get_isvc(cluster=stack.cluster, namespace=stack.namespace, name=ISVC_NAME)
            found = condition(obj, "MetricsHealthy") or {}
            return found if found.get("status") == "True" else None
        found = wait(stack.cluster, healthy, timeout=180, what="MetricsHealthy=True", interval=2.0)
        _log(f"MetricsHealthy: {found.get('reason')} {found.get('message', '')}")


def test_killed_runtime_is_restarted_and_served_again(served: Stack) -> None:
    stack = served
    with explained(stack.cluster, stack.namespaces):
        url = _router_url(stack)
        before = _runtime_pod(stack)
        status = before.status.container_statuses[0]
        tini = _main_pid(stack, status.container_id)
        serve = [pid for pid in _children(tini) if "serve" in _cmdline(pid)]
        assert len(serve) == 1, [(pid, _cmdline(pid)) for pid in _children(tini)]
        _log(f"SIGKILL to the runtime process {serve[0]} (child of tini {tini}) in "
             f"{before.metadata.name}")
        killed_at = time.monotonic()
        os.kill(serve[0], signal.SIGKILL)

        def restarted_and_ready() -> Any:
            pod = _runtime_pod(stack)
            current = pod.status.container_statuses[0]
            return pod if current.restart_count > status.restart_count and current.ready else None
        after = wait(stack.cluster, restarted_and_ready, timeout=RESTART_TIMEOUT_SECONDS,
                     what="the runtime container restarted by the kubelet and Ready", interval=1.0)
        current = after.status.container_statuses[0]
        assert after.metadata.uid == before.metadata.uid  # the same pod: a container restart
        assert current.last_state.terminated is not None, current.last_state
        assert current.container_id != status.container_id
        restarted = time.monotonic() - killed_at
        body = wait(stack.cluster, lambda: _complete(url, "After the restart"), timeout=120,
                    what="a completion through the router after the restart")
        served_again = time.monotonic() - killed_at
        assert body["usage"]["completion_tokens"] == 4
        for i in range(5):
            _complete(url, f"steady {i}")
        stack.figures["runtime SIGKILL -> container Ready again"] = f"{restarted:.1f}s"
        stack.figures["runtime SIGKILL -> served through the router again"] = f"{served_again:.1f}s"
        _log(f"restarted (exit {current.last_state.terminated.exit_code}, "
             f"{current.last_state.terminated.reason}) and Ready {restarted:.1f}s after the kill; "
             f"served again through the router after {served_again:.1f}s")



def test_disaggregated_serves_through_prefill_and_decode(served_disaggregated: Stack) -> None:
    stack = served_disaggregated
    with explained(stack.cluster, stack.namespaces):
        pods = _pods(stack, [stack.pd_namespace])
        print("\n" + _pod_table(pods))
        roles = sorted(str(p.metadata.labels[contract.LABEL_COMPONENT]) for p in pods)
        assert roles == ["decode", "prefill", "router"], roles
        _assert_from_the_image(stack, pods)
        url = _router_url(stack, stack.pd_namespace)
        for i in range(3):
            body = wait(stack.cluster, functools.partial(_complete, url, f"Prefill then decode {i}"),
                        timeout=60, what=f"a completion from {url}")
            assert body["usage"]["completion_tokens"] == 4, body
        # the KV cache went from the prefill pod to the decode pod over the pod network
        transferred = {str(p.metadata.labels[contract.LABEL_COMPONENT]): _kv_bytes(p)
                       for p in pods if p.metadata.labels[contract.LABEL_COMPONENT] != "router"}
        assert all(value > 0 for value in transferred.values()), transferred
        _log(f"Disaggregated: completions via the router ClusterIP {url}; KV bytes {transferred}")


def _kv_bytes(pod: Any) -> float:
    """``splitserve_kv_transfer_bytes_total`` summed over its labels, from the pod's /metrics."""
    text = httpx.get(f"http://{pod.status.pod_ip}:{contract.HTTP_PORT}{contract.METRICS_PATH}",
                     timeout=10.0).text
    name = contract.Metric.KV_TRANSFER_BYTES_TOTAL
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))
