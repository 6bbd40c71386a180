"""The product installed on the local cluster, as the demo and the e2e tests set it up.

Every piece is what a platform team does on a real cluster, made local: the image built from
this working tree and pulled by the kubelet node from the loopback registry
(:func:`~splitserve_e2e.image.ensure_image`); the tiny model published as
``splitserve/tiny-llama`` on a token-protected :class:`~splitserve_e2e.hub.LocalHub` where the
pods reach it (the kubelet node's bridge gateway), downloaded by every pod as ``hf://``; the
chart installed with ``image.repository``/``image.tag`` set, so the operator runs as a
container under its ServiceAccount; InferenceServices from ``examples/``.

:func:`operator_namespace` is the fixture body the e2e modules share: a namespace with the
hub's token Secret and the operator (namespace-scoped) installed, removed again on exit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.hub import LocalHub

REPO: Final = Path(__file__).resolve().parents[2]
CHART: Final = REPO / "helm" / "splitserve"
EXAMPLES: Final = REPO / "examples"
MODEL_NAME: Final = "splitserve/tiny-llama"
SERVED_NAME: Final = "tiny-llama"
RELEASE: Final = "splitserve"
HUB_PORT: Final = 8765
"""The demo hub's port when free (``examples/tiny-aggregated.yaml`` names it), else any."""
HUB_TOKEN_SECRET: Final = "tiny-llama-hub-token"
"""The Secret (key ``HF_TOKEN``) ``spec.model.hubTokenSecretRef`` names."""
ISVC_PLURAL: Final = f"{contract.PLURAL}.{contract.API_GROUP}"
ROLES_BY_MODE: Final[Mapping[str, tuple[str, ...]]] = {
    "Disaggregated": (contract.Role.PREFILL.value, contract.Role.DECODE.value),
    "Aggregated": (contract.Role.AGGREGATED.value,),
}
POOL_CPU: Final = "100m"
"""CPU request per runtime pod in the tests: the kubelet node has the machine's 2 cores to
allocate, and a test may run a dozen pods (requests only: the runtime has no CPU limit)."""


# --------------------------------------------------------------------------- the model
def ensure_model_cache(*, cache_dir: Path) -> Path:
    """``cache_dir`` holding ``splitserve/tiny-llama`` (written once, reused after); the hub
    publishes it from there."""
    model_dir = cache_dir / MODEL_NAME
    if not (model_dir / "config.json").is_file():
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            ["splitserve", "make-tiny-model", str(model_dir)], capture_output=True, text=True, timeout=300, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"`splitserve make-tiny-model {model_dir}` failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
    return cache_dir


@dataclasses.dataclass(frozen=True)
class ModelHub:
    """Where the pods download ``hf://splitserve/tiny-llama`` from: the hub's endpoint, its
    token, and the name of the Secret (key ``HF_TOKEN``) that carries it in each namespace."""

    endpoint: str
    token: str
    token_secret: str = HUB_TOKEN_SECRET


def start_model_hub(
    *, model_dir: Path, root: Path, token: str, host: str, port: int = HUB_PORT
) -> tuple[LocalHub, str]:
    """A :class:`LocalHub` on ``host`` (``port`` if free, else any) serving ``model_dir`` as
    ``MODEL_NAME`` and requiring ``token``; returns it, started, with the commit. ``root`` is
    emptied first, so the commit id is the same every run."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        hub = LocalHub(root, token=token, host=host, port=port)
    except OSError:  # in use: any free port (the manifest gets the actual endpoint)
        hub = LocalHub(root, token=token, host=host, port=0)
    commit = hub.publish(MODEL_NAME, model_dir)
    return hub.start(), commit


def create_hub_token_secret(*, cluster: LocalCluster, namespace: str, hub: ModelHub) -> None:
    core: Any = cluster.core()
    core.create_namespaced_secret(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": hub.token_secret},
            "type": "Opaque",
            "stringData": {contract.ENV_HUB_TOKEN: hub.token},
        },
    )


# --------------------------------------------------------------------------- the image
PULL_TIMEOUT_SECONDS: Final = 1200.0
"""A cold pull: ~3 GB of gzip layers unpacked to 5.6 GB on 2 cores."""


def pull_on_node(*, cluster: LocalCluster, image: str, namespace: str = "splitserve-image-pull") -> str:
    """Run one pod of ``image`` to completion on the kubelet node (``python -c pass``), so
    the kubelet pulls it now, through the CRI as for any pod, rather than inside the first
    test's timeout; then drop older builds of the image from the node's shared containerd
    root. Returns the kubelet's Pulled event ("Successfully pulled ... in 1m2s" or "...
    already present on machine")."""
    core: Any = cluster.core()
    create_namespace(cluster, namespace, restricted=True)
    try:
        core.create_namespaced_pod(
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "pull"},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [
                        {
                            "name": "pull",
                            "image": image,
                            "imagePullPolicy": "IfNotPresent",
                            "args": ["python", "-c", "pass"],
                            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                        }
                    ],
                },
            },
        )

        def finished() -> str:
            phase = str(core.read_namespaced_pod("pull", namespace).status.phase)
            if phase == "Failed":
                raise RuntimeError(f"the image pull pod failed on the node: {image}")
            return phase if phase == "Succeeded" else ""

        cluster.wait_for(
            finished,
            timeout_seconds=PULL_TIMEOUT_SECONDS,
            interval_seconds=1.0,
            what=f"{image} pulled and run once on the kubelet node",
        )
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=pull,reason=Pulled").items
        pulled = str(events[-1].message) if events else ""
    finally:
        core.delete_namespace(namespace)
    if cluster.kubelet_node is not None:
        cluster.kubelet_node.containerd.remove_images(prefix=image.rsplit(":", 1)[0] + ":", keep=image)
    return pulled


# --------------------------------------------------------------------------- the operator
def apply_crds(cluster: LocalCluster, path: Path) -> None:
    """``kubectl apply --server-side`` the CRDs at ``path`` (as a platform team does: Helm
    installs crds/ only once, never upgrades), then poll until the InferenceService CRD is
    Established (polled: ``kubectl wait`` right after the apply has been seen to fail)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))

    def established() -> bool:
        result = cluster.kubectl(
            "get",
            "crd",
            ISVC_PLURAL,
            "-o",
            "jsonpath={.status.conditions[?(@.type=='Established')].status}",
            check=False,
        )
        return result.returncode == 0 and result.stdout.strip() == "True"

    cluster.wait_for(established, timeout_seconds=60, interval_seconds=0.5, what=f"CRD {ISVC_PLURAL} Established")


def install_operator(
    *,
    cluster: LocalCluster,
    namespace: str,
    image: str,
    prometheus_url: str | None = None,
    with_prometheus: bool = True,
    release: str = RELEASE,
    cluster_scope: bool = False,
    replicas: int = 1,
    inference_pool: bool = False,
    extra_args: Sequence[str] = (),
    hub_endpoints: Sequence[str] | None = None,
    timeout_seconds: float = 300.0,
) -> None:
    """The chart into ``namespace`` (namespace-scoped RBAC unless ``cluster_scope``), the
    operator container from ``image`` (``registry/name:tag``), reading ``prometheus_url``
    (default: the cluster's; none at all when not ``with_prometheus``: no autoscaling
    decisions), with ``spec.router.mode: InferencePool`` allowed when ``inference_pool`` (the
    chart's ``inferencePool.enabled``, off by default), serving the model hubs
    ``hub_endpoints`` (the chart's ``hub.allowedEndpoints``; default:
    :func:`harness_hub_endpoints`); returns once the operator holds its Lease."""
    apply_crds(cluster, CHART / "crds")
    repository, tag = image.rsplit(":", 1)
    values = [
        "--set-string",
        f"image.repository={repository}",
        "--set-string",
        f"image.tag={tag}",
        "--set-string",
        "image.pullPolicy=IfNotPresent",
        "--set",
        f"rbac.scope={'cluster' if cluster_scope else 'namespace'}",
        "--set",
        f"replicaCount={replicas}",
        "--set",
        f"inferencePool.enabled={str(inference_pool).lower()}",
        "--set-json",
        "hub.allowedEndpoints="
        + json.dumps(list(harness_hub_endpoints(cluster) if hub_endpoints is None else hub_endpoints)),
    ]
    if with_prometheus:
        prometheus = prometheus_url or cluster.prometheus_url
        if not prometheus:
            raise RuntimeError("install_operator: the cluster has no Prometheus")
        interval = cluster.options.scrape_interval_seconds
        values += [
            "--set-string",
            f"prometheus.url={prometheus}",
            # match the harness's fast scrape so the loop reacts in seconds
            "--set",
            f"prometheus.scrapeIntervalSeconds={interval:g}",
            "--set",
            f"prometheus.windowSeconds={max(3 * interval, 6):g}",
        ]
    result = cluster.helm(
        "install",
        release,
        str(CHART),
        "-n",
        namespace,
        "--skip-crds",
        *values,
        *extra_args,
        check=False,
        timeout_seconds=120,
    )
    if result.returncode != 0:
        raise RuntimeError(f"helm install {release} -n {namespace} failed: {result.stderr.strip()}")
    lease = release if "splitserve" in release else f"{release}-splitserve"  # chart fullname

    def holder() -> str:
        result = cluster.kubectl(
            "get", "lease", lease, "-n", namespace, "-o", "jsonpath={.spec.holderIdentity}", check=False
        )
        return result.stdout.strip() if result.returncode == 0 else ""

    cluster.wait_for(
        holder,
        timeout_seconds=timeout_seconds,
        interval_seconds=1.0,
        what=f"the operator ({namespace}) holding Lease {lease}",
    )


def harness_hub_endpoints(cluster: LocalCluster) -> list[str]:
    """The hubs an operator of this harness serves: huggingface.co (the chart's default) and
    every hub the harness runs for the pods (the demo's and the tests'), which listen on the
    kubelet node's bridge gateway, each on a port of its own (an entry without a port allows
    them all). Without a kubelet node the hubs are on loopback, which the CRD refuses anyway."""
    hubs = ["https://huggingface.co"]
    if cluster.pod_gateway:
        hubs.append(f"http://{cluster.pod_gateway}")
    return hubs


def remove_release(*, cluster: LocalCluster, namespace: str, release: str = RELEASE) -> None:
    """InferenceServices first, while the operator still runs to release its finalizer, then
    the release and the namespace (a finalizer left behind is cleared rather than waited on)."""
    cluster.kubectl("delete", ISVC_PLURAL, "--all", "-n", namespace, "--timeout=60s", check=False, timeout_seconds=90)
    cluster.helm("uninstall", release, "-n", namespace, check=False)
    listed = cluster.kubectl("get", ISVC_PLURAL, "-n", namespace, "-o", "name", check=False)
    for name in listed.stdout.split():
        cluster.kubectl(
            "patch", name, "-n", namespace, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
        )
    cluster.kubectl("delete", "namespace", namespace, "--timeout=90s", check=False, timeout_seconds=120)


def create_namespace(cluster: LocalCluster, name: str, *, restricted: bool = False) -> None:
    """``name``, optionally enforcing the ``restricted`` Pod Security level; returns once its
    ``default`` ServiceAccount exists (pods need it)."""
    core: Any = cluster.core()
    labels = (
        {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}
        if restricted
        else {}
    )
    core.create_namespace({"metadata": {"name": name, "labels": labels}})
    cluster.wait_for(
        lambda: core.read_namespaced_service_account("default", name),
        timeout_seconds=60,
        interval_seconds=0.5,
        what=f"ServiceAccount {name}/default",
    )


@contextlib.contextmanager
def operator_namespace(
    *,
    cluster: LocalCluster,
    image: str,
    hub: ModelHub,
    stem: str,
    release: str = RELEASE,
    restricted: bool = True,
    unique: bool = True,
) -> Iterator[str]:
    """A fresh namespace ``<stem>-<random>`` (``<stem>`` when not ``unique``; ``restricted``
    Pod Security by default: every pod the operator renders must pass it) with the hub's
    token Secret and the operator installed; everything is removed on exit."""
    name = f"{stem}-{uuid.uuid4().hex[:5]}" if unique else stem
    create_namespace(cluster, name, restricted=restricted)
    try:
        create_hub_token_secret(cluster=cluster, namespace=name, hub=hub)
        install_operator(cluster=cluster, namespace=name, image=image, release=release)
        yield name
    finally:
        remove_release(cluster=cluster, namespace=name, release=release)


# --------------------------------------------------------------------------- manifests
def isvc_manifest(
    *,
    name: str,
    namespace: str,
    mode: str,
    hub: ModelHub,
    interval: str = "5s",
    max_replicas: int = 3,
    scale_down_stabilization_seconds: int = 20,
    prefill_target_queue_depth: float = 2.0,
    decode_target_queue_depth: float = 2.0,
    decode_target_kv: float = 0.6,
    cpu: str = POOL_CPU,
    extra_spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The example InferenceService of ``mode`` with a fast, short-windowed autoscaler and
    ``cpu`` requested per pod, its model ``hf://`` from ``hub`` (every pod downloads it into
    its own model cache, as in production; the namespace needs the hub's token Secret)."""
    example = "tiny-disaggregated.yaml" if mode == "Disaggregated" else "tiny-aggregated.yaml"
    body: dict[str, Any] = yaml.safe_load((EXAMPLES / example).read_text())
    body["metadata"] = {"name": name, "namespace": namespace}
    spec = body["spec"]
    spec["model"].update(
        {"uri": f"hf://{MODEL_NAME}", "hubEndpoint": hub.endpoint, "hubTokenSecretRef": {"name": hub.token_secret}}
    )
    for role in ROLES_BY_MODE[mode]:
        spec[role]["replicas"] = {"min": 1, "max": max_replicas}
        spec[role]["resources"]["cpu"] = cpu
    spec["autoscaling"] = {
        "interval": interval,
        "prefill": {"targetQueueDepth": prefill_target_queue_depth},
        "decode": {"targetKVCacheUtilization": decode_target_kv, "targetQueueDepth": decode_target_queue_depth},
        "behavior": {
            "scaleUp": {"stabilizationSeconds": 0, "maxStepPercent": 100},
            "scaleDown": {"stabilizationSeconds": scale_down_stabilization_seconds, "maxStep": 1},
        },
    }
    if mode == "Disaggregated":
        spec["autoscaling"]["gpuBudget"] = 4
    for key, value in (extra_spec or {}).items():
        spec[key] = copy.deepcopy(value)
    return body
