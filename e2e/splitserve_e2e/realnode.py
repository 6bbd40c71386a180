"""The product on the kubelet node, cluster-scoped, as the real-node e2e modules set it up.

:func:`real_node_stack` takes the session's cluster (its kubelet node, Prometheus on the
node's bridge gateway), the image built from the working tree and the session's model hub,
and installs the chart cluster-scoped into ``splitserve-system`` with
``image.repository``/``image.tag`` set to the pushed reference: the operator runs as a
container under its ServiceAccount and watches every namespace while the module runs (the
other modules install namespace-scoped operators, one at a time). ``restricted`` namespaces
are made for the workloads, each with the hub's token Secret. :func:`isvc_for_node` makes
the tiny InferenceService fit the node. :func:`explained` prints :func:`diagnostics` (pods,
events and logs read through the API, and the node's log tails) when a step fails.

Used by ``e2e/test_real_node.py`` and ``e2e/test_real_node_oom.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from .cluster import LocalCluster
from .hub import LocalHub
from .image import registry_manifest
from .kubeletnode import KubeletNode
from .stack import (
    ISVC_PLURAL,
    ROLES_BY_MODE,
    ModelHub,
    create_hub_token_secret,
    create_namespace,
    install_operator,
    isvc_manifest,
    remove_release,
)

T = TypeVar("T")
RELEASE: Final = "splitserve"
OPERATOR_NAMESPACE: Final = "splitserve-system"
ISVC_NAME: Final = "tiny"


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
                out.append(
                    f"--- pod {namespace}/{pod.metadata.name} phase={pod.status.phase} "
                    f"node={pod.spec.node_name} ip={pod.status.pod_ip}"
                )
                for status in pod.status.container_statuses or []:
                    out.append(
                        f"  {status.name}: ready={status.ready} "
                        f"restarts={status.restart_count} state={status.state} "
                        f"last={status.last_state} imageID={status.image_id}"
                    )
                    for previous in (False, True) if status.restart_count else (False,):
                        with contextlib.suppress(Exception):
                            text = core.read_namespaced_pod_log(
                                pod.metadata.name, namespace, container=status.name, tail_lines=40, previous=previous
                            )
                            out.append(f"  log{' (previous)' if previous else ''}:\n{text}")
        with contextlib.suppress(Exception):
            events = core.list_namespaced_event(namespace).items
            events.sort(key=lambda e: e.last_timestamp or e.event_time or e.metadata.creation_timestamp)
            out.append(f"--- events in {namespace}:")
            out += [
                f"  {e.type} {e.reason} {e.involved_object.kind}/{e.involved_object.name}: {e.message}"
                for e in events[-30:]
            ]
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


def wait(
    cluster: LocalCluster, predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 1.0
) -> T:
    return cluster.wait_for(predicate, timeout_seconds=timeout, interval_seconds=interval, what=what)


# --------------------------------------------------------------------------- the stack
@dataclass
class Stack:
    """What :func:`real_node_stack` set up, with the figures it measured."""

    cluster: LocalCluster
    image: str
    manifest_digest: str
    hub: LocalHub
    model_hub: ModelHub
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


def pull_event(cluster: LocalCluster, namespace: str, pod: str) -> str:
    """The kubelet's Pulled event of ``pod`` ("Successfully pulled ... in 1m2s" or
    "... already present on machine")."""
    core: Any = cluster.core()
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod},reason=Pulled").items
    return str(events[-1].message) if events else ""


def operator_pod(cluster: LocalCluster) -> Any:
    """The operator's pod once all its containers are ready, else None."""
    core: Any = cluster.core()
    pods = core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=operator").items
    ready = [p for p in pods if p.status.container_statuses and all(s.ready for s in p.status.container_statuses)]
    return ready[0] if ready else None


@contextlib.contextmanager
def real_node_stack(
    *,
    cluster: LocalCluster,
    image: str,
    hub: LocalHub,
    model_hub: ModelHub,
    workloads: Sequence[str],
    inference_pool: bool = False,
    vllm_image: str | None = None,
) -> Iterator[Stack]:
    """The namespaces and the cluster-scoped operator (see the module; ``inference_pool``: the
    chart's ``inferencePool.enabled``; ``vllm_image``: the chart's ``runtime.vllmImage``, the
    image of vLLM pools), removed on exit."""
    if cluster.kubelet_node is None or not cluster.prometheus_url:
        raise RuntimeError("real_node_stack needs the cluster's kubelet node and Prometheus")
    found = registry_manifest(image.rsplit(":", 1)[1])
    assert found is not None, f"{image} is not in the loopback registry"
    log(f"image {image} (manifest {found[0]})")
    stack = Stack(
        cluster=cluster, image=image, manifest_digest=found[0], hub=hub, model_hub=model_hub, workloads=list(workloads)
    )
    figures = stack.figures
    figures["kubelet node process start -> Ready"] = f"{cluster.kubelet_node.ready_seconds:.1f}s"
    try:
        with explained(cluster, stack.namespaces):
            for name in stack.namespaces:
                create_namespace(cluster, name, restricted=True)
            for name in stack.workloads:
                create_hub_token_secret(cluster=cluster, namespace=name, hub=model_hub)
            started = time.monotonic()
            install_operator(
                cluster=cluster,
                namespace=OPERATOR_NAMESPACE,
                image=image,
                release=RELEASE,
                cluster_scope=True,
                inference_pool=inference_pool,
                extra_args=(
                    "--set",
                    f"router.namespaces={{{','.join(stack.workloads)}}}",
                    *(("--set-string", f"runtime.vllmImage={vllm_image}") if vllm_image else ()),
                ),
            )
            operator = wait(cluster, lambda: operator_pod(cluster), timeout=60, what="the operator pod Ready")
            figures["helm install -> operator Ready"] = f"{time.monotonic() - started:.1f}s"
            figures["operator image pull (kubelet)"] = pull_event(cluster, OPERATOR_NAMESPACE, operator.metadata.name)
            log(f"operator Ready; {figures['operator image pull (kubelet)']}")
        yield stack
    finally:
        for name in stack.workloads:
            cluster.kubectl(
                "delete", ISVC_PLURAL, "--all", "-n", name, "--timeout=60s", check=False, timeout_seconds=90
            )
        remove_release(cluster=cluster, namespace=OPERATOR_NAMESPACE, release=RELEASE)
        for name in stack.workloads:
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
        print("\nfigures:\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))


def apply_until_ready(stack: Stack, obj: dict[str, Any], *, timeout: float, figure: str) -> None:
    """Apply the InferenceService ``obj`` and wait until it is Ready (the pods, Events and logs
    printed when it is not); the time goes into ``stack.figures[figure]``."""
    from .demo import apply_object, condition, get_isvc  # demo is the larger module: imported when used

    cluster, meta = stack.cluster, obj["metadata"]
    with explained(cluster, stack.namespaces):
        started = time.monotonic()
        apply_object(cluster=cluster, obj=obj)

        def ready() -> dict[str, Any] | None:
            current = get_isvc(cluster=cluster, namespace=meta["namespace"], name=meta["name"])
            return current if (condition(current, "Ready") or {}).get("status") == "True" else None

        wait(cluster, ready, timeout=timeout, what=f"InferenceService {meta['name']} Ready", interval=2.0)
        stack.figures[figure] = f"{time.monotonic() - started:.1f}s"


def isvc_for_node(stack: Stack, *, namespace: str, mode: str, cpu: str, memory: str | None = None) -> dict[str, Any]:
    """The tiny InferenceService of ``mode`` (``hf://`` from the hub; ``--device cpu``;
    ``cpu``, and ``memory`` when given, per pod of each pool), not yet applied."""
    manifest = isvc_manifest(
        name=ISVC_NAME, namespace=namespace, mode=mode, hub=stack.model_hub, max_replicas=1, cpu=cpu
    )
    spec = manifest["spec"]
    for role in ROLES_BY_MODE[mode]:
        if memory is not None:
            spec[role]["resources"]["memory"] = memory
    spec["runtime"]["imagePullPolicy"] = "IfNotPresent"
    assert spec["runtime"]["extraArgs"][:2] == ["--device", "cpu"], spec["runtime"]
    return manifest
