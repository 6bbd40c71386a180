"""The product on the kubelet node, as the real-node e2e modules set it up.

:func:`real_node_stack` gives a module its own cluster with only the kubelet node (no kwok
nodes, no process-based local node) and Prometheus on the node's bridge gateway, the image
built from the working tree (:func:`~splitserve_e2e.image.ensure_image`, pulled by containerd
into its root under the cache), a token-protected :class:`~splitserve_e2e.hub.LocalHub` on the
gateway serving ``splitserve/tiny-llama``, ``restricted`` namespaces, and the chart installed
with ``image.repository``/``image.tag`` set to the pushed reference: the operator runs as a
container under its ServiceAccount. :func:`isvc_for_node` makes the tiny InferenceService fit
the node (no node selector, ``IfNotPresent``). :func:`explained` prints :func:`diagnostics`
(pods, events and logs read through the API, and the node's log tails) when a step fails.

Used by ``e2e/test_real_node.py`` and ``e2e/test_real_node_oom.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from . import kubeletnode
from .build import cache_root
from .cluster import ClusterOptions, LocalCluster
from .demo import (
    CHART,
    MODEL_NAME,
    ROLES_BY_MODE,
    ModelHub,
    create_hub_token_secret,
    ensure_model_cache,
    isvc_manifest,
)
from .hub import LocalHub
from .image import ensure_image, registry_manifest
from .kubeletnode import KubeletNode

T = TypeVar("T")
RELEASE: Final = "splitserve"
OPERATOR_NAMESPACE: Final = "splitserve-system"
ISVC_NAME: Final = "tiny"
HUB_TOKEN: Final = "hf_real_node_token"
PULL_TIMEOUT_SECONDS: Final = 1200.0  # a cold pull: ~3 GB gzip layers, unpacked to 5.6 GB, 2 cores


def missing_prerequisites() -> list[str]:
    """What this machine lacks for the kubelet node and the image (empty: nothing)."""
    missing = kubeletnode.missing_prerequisites()
    if shutil.which("buildah") is None:
        missing.append("buildah")
    return missing


def log(message: str) -> None:
    print(f"[real-node {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------- diagnostics
def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"({error})"


def diagnostics(cluster: LocalCluster, namespaces: Sequence[str]) -> str:
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
                            text = core.read_namespaced_pod_log(
                                pod.metadata.name, namespace, container=status.name,
                                tail_lines=40, previous=previous)
                            out.append(f"  log{' (previous)' if previous else ''}:\n{text}")
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
def explained(cluster: LocalCluster, namespaces: Sequence[str]) -> Iterator[None]:
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


# --------------------------------------------------------------------------- the stack
@dataclass
class Stack:
    """What :func:`real_node_stack` set up, with the figures it measured."""

    cluster: LocalCluster
    image: str
    manifest_digest: str
    hub: LocalHub
    workloads: list[str]
    """The restricted namespaces for InferenceServices (the router may watch them)."""
    figures: dict[str, str] = field(default_factory=dict)

    @property
    def node(self) -> KubeletNode:
        assert self.cluster.kubelet_node is not None
        return self.cluster.kubelet_node

    @property
    def namespace(self) -> str:
        """The first workload namespace."""
        return self.workloads[0]

    @property
    def namespaces(self) -> list[str]:
        return [OPERATOR_NAMESPACE, *self.workloads]


def restricted_namespace(cluster: LocalCluster, name: str) -> None:
    core: Any = cluster.core()
    core.create_namespace({"metadata": {"name": name, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest"}}})
    wait(cluster, lambda: core.read_namespaced_service_account("default", name), timeout=60,
         what=f"ServiceAccount {name}/default", interval=0.5)


def pull_event(cluster: LocalCluster, namespace: str, pod: str) -> str:
    """The kubelet's Pulled event of ``pod`` ("Successfully pulled ... in 1m2s" or
    "... already present on machine")."""
    core: Any = cluster.core()
    events = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod},reason=Pulled").items
    return str(events[-1].message) if events else ""


def install_chart(stack: Stack) -> None:
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
                 "--set", f"router.namespaces={{{','.join(stack.workloads)}}}",
                 timeout_seconds=180)


def operator_pod(cluster: LocalCluster) -> Any:
    """The operator's pod once all its containers are ready, else None."""
    core: Any = cluster.core()
    pods = core.list_namespaced_pod(
        OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=operator").items
    ready = [p for p in pods if p.status.container_statuses
             and all(s.ready for s in p.status.container_statuses)]
    return ready[0] if ready else None


@contextlib.contextmanager
def real_node_stack(*, workloads: Sequence[str], hub_root: Path,
                    keep_state: Callable[[], bool]) -> Iterator[Stack]:
    """The cluster, hub, namespaces and operator (see the module); everything is stopped on
    exit, and the cluster's state directory removed unless ``keep_state()`` (a test failed),
    when its path is printed. The caller checks :func:`missing_prerequisites` first."""
    figures: dict[str, str] = {}
    started = time.monotonic()
    image = ensure_image()  # built from this working tree; a no-change call takes seconds
    figures["image build+push (ensure_image)"] = f"{time.monotonic() - started:.1f}s"
    found = registry_manifest(image.rsplit(":", 1)[1])
    assert found is not None, f"{image} is not in the loopback registry"
    log(f"image {image} (manifest {found[0]})")

    runs = cache_root() / "e2e-runs"
    runs.mkdir(parents=True, exist_ok=True)
    state_dir = Path(tempfile.mkdtemp(prefix="rn-", dir=runs))  # short: unix socket paths
    cluster = LocalCluster(state_dir=state_dir, options=ClusterOptions(
        num_gpu_nodes=0, with_local_node=False, with_prometheus=True, with_kubelet_node=True,
        scrape_interval_seconds=2.0))
    model_dir = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
    hub: LocalHub | None = None
    try:
        cluster.start()
        node = cluster.kubelet_node
        assert node is not None
        figures["cluster start (with kubelet node)"] = f"{cluster.start_seconds:.1f}s"
        figures["kubelet node process start -> Ready"] = f"{node.ready_seconds:.1f}s"
        log(f"cluster started in {cluster.start_seconds:.1f}s (state {state_dir}); "
            f"Prometheus {cluster.prometheus_url}")
        hub = LocalHub(hub_root, token=HUB_TOKEN, host=node.network.gateway).start()
        hub.publish(MODEL_NAME, model_dir)
        stack = Stack(cluster=cluster, image=image, manifest_digest=found[0], hub=hub,
                      workloads=list(workloads), figures=figures)
        with explained(cluster, stack.namespaces):
            for name in stack.namespaces:
                restricted_namespace(cluster, name)
            started = time.monotonic()
            install_chart(stack)
            operator = wait(cluster, lambda: operator_pod(cluster), timeout=PULL_TIMEOUT_SECONDS,
                            what="the operator pod Ready (includes pulling the image)")
            figures["helm install -> operator Ready"] = f"{time.monotonic() - started:.1f}s"
            figures["operator image pull (kubelet)"] = pull_event(
                cluster, OPERATOR_NAMESPACE, operator.metadata.name)
            log(f"operator Ready; {figures['operator image pull (kubelet)']}")
            removed = node.containerd.remove_images(prefix=image.rsplit(":", 1)[0] + ":",
                                                    keep=image)
            if removed:
                log(f"removed older builds from containerd's shared root: {removed}")
        yield stack
    finally:
        if hub is not None:
            hub.stop()
        cluster.stop()
        if keep_state():
            print(f"kubelet node state and logs kept in {state_dir}")
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
        print("\nfigures:\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))


def isvc_for_node(stack: Stack, *, namespace: str, mode: str, cpu: str,
                  memory: str | None = None) -> dict[str, Any]:
    """The tiny InferenceService of ``mode`` for the kubelet node (``hf://`` from the hub, whose
    token Secret this creates in ``namespace``; ``--device cpu``; ``cpu``, and ``memory`` when
    given, per pod of each pool; the node has the machine's cores), not yet applied."""
    create_hub_token_secret(cluster=stack.cluster, namespace=namespace, token=HUB_TOKEN)
    manifest = isvc_manifest(name=ISVC_NAME, namespace=namespace, mode=mode,
                             hub=ModelHub(endpoint=stack.hub.endpoint), max_replicas=1)
    spec = manifest["spec"]
    for role in ROLES_BY_MODE[mode]:
        spec[role].pop("nodeSelector", None)  # only the kubelet node here
        spec[role]["resources"]["cpu"] = cpu
        if memory is not None:
            spec[role]["resources"]["memory"] = memory
    spec["runtime"]["imagePullPolicy"] = "IfNotPresent"
    assert spec["runtime"]["extraArgs"][:2] == ["--device", "cpu"], spec["runtime"]
    return manifest
