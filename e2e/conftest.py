"""pytest fixtures for the end-to-end tests: one real local cluster per session.

``cluster`` starts a :class:`LocalCluster` (control plane, two kwok GPU nodes, the kubelet
node that runs pods as containers, Prometheus) in a state directory under the cache (logs stay
there for inspection when a test failed) and stops it at session end, also after a failure or
Ctrl-C (pytest tears session fixtures down on KeyboardInterrupt; atexit and the children's
parent-death signal cover harder exits). ``--existing-cluster[=KUBECONFIG]`` or
``SPLITSERVE_E2E_KUBECONFIG`` run the same tests against a cluster that is already up
(``python -m splitserve_e2e up``, or any other); with a bare kubeconfig, tests that kill a
container's process fail with :class:`NodeUnavailable` saying so.

``image`` is the image built from this working tree and pushed to the loopback registry
(``$SPLITSERVE_E2E_IMAGE`` names another, e.g. for an existing cluster); ``model_hub`` is the
token-protected hub serving ``hf://splitserve/tiny-llama`` where the pods reach it.
``namespace`` gives each test a fresh namespace and deletes it afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from splitserve_e2e import kubeletnode, nodehost, smollm2
from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import (
    ENV_EXISTING_KUBECONFIG,
    ClusterOptions,
    LocalCluster,
    default_state_dir,
)
from splitserve_e2e.demo import VLLM_REPO_ID
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.image import ensure_image, ensure_vllm_image
from splitserve_e2e.net import LOOPBACK
from splitserve_e2e.process import is_alive
from splitserve_e2e.realnode import Stack, real_node_stack
from splitserve_e2e.stack import (
    MODEL_NAME,
    ModelHub,
    create_namespace,
    ensure_model_cache,
    pull_on_node,
    start_model_hub,
)

ENV_IMAGE = "SPLITSERVE_E2E_IMAGE"
ENV_VLLM_IMAGE = "SPLITSERVE_E2E_VLLM_IMAGE"
"""Run another vLLM image (e.g. on an existing cluster) instead of building this tree's."""
HUB_TOKEN = "hf_e2e_session_token"

_USE_UP_CLUSTER = "__up__"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--existing-cluster",
        nargs="?",
        const=_USE_UP_CLUSTER,
        default=None,
        metavar="KUBECONFIG",
        help="run e2e tests against a running cluster: the given kubeconfig, else "
        f"${ENV_EXISTING_KUBECONFIG}, else the one `python -m splitserve_e2e up` started",
    )


def _existing(config: pytest.Config) -> LocalCluster | None:
    option = config.getoption("--existing-cluster")
    from_env = os.environ.get(ENV_EXISTING_KUBECONFIG)
    if option is None and not from_env:
        return None
    if option not in (None, _USE_UP_CLUSTER):
        return LocalCluster.from_existing(kubeconfig=Path(option))
    if from_env:
        return LocalCluster.from_existing(kubeconfig=Path(from_env))
    return LocalCluster.attach(state_dir=default_state_dir())  # container pids work too


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    existing = _existing(request.config)
    if existing is not None:
        yield existing
        return
    # not pytest's tmp_path: other pytest sessions on the machine prune those while we run
    missing = kubeletnode.missing_prerequisites()
    if missing:
        pytest.fail(
            f"the e2e cluster's kubelet node needs {', '.join(missing)} "
            "(`make deps` installs the packages; run as root)",
            pytrace=False,
        )
    runs = cache_root() / "e2e-runs"
    runs.mkdir(parents=True, exist_ok=True)
    _prune_kept_runs(runs)
    # short: the kubelet's unix sockets live below it
    state_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%m%d%H%M%S-"), dir=runs))
    local = LocalCluster(state_dir=state_dir, options=ClusterOptions(num_gpu_nodes=2, scrape_interval_seconds=1.0))
    failures_before = request.session.testsfailed
    try:
        local.start()
        print(f"\nlocal cluster started in {local.start_seconds:.1f}s (state {state_dir})")
        yield local
    finally:
        local.stop()
        if request.session.testsfailed == failures_before:
            shutil.rmtree(state_dir, ignore_errors=True)
        else:
            print(f"\nlocal cluster logs kept in {state_dir / 'logs'}")


@pytest.fixture(scope="session")
def image(cluster: LocalCluster) -> str:
    """The image the pods run: ``$SPLITSERVE_E2E_IMAGE``, else the one built from this
    working tree and pushed to the loopback registry (a no-change call takes seconds); on
    this harness's kubelet node it is pulled once up front
    (:func:`~splitserve_e2e.stack.pull_on_node`)."""
    reference = os.environ.get(ENV_IMAGE)
    if not reference:
        started = time.monotonic()
        reference = ensure_image()
        print(f"\nimage {reference} built and pushed in {time.monotonic() - started:.1f}s")
    if cluster.kubelet_node is not None:
        started = time.monotonic()
        pulled = pull_on_node(cluster=cluster, image=reference)
        print(f"image on the kubelet node in {time.monotonic() - started:.1f}s ({pulled})")
    return reference


@pytest.fixture(scope="session")
def vllm_image() -> str:
    """vLLM's CPU image (``Containerfile.vllm``): ``$SPLITSERVE_E2E_VLLM_IMAGE``, else built when
    its inputs changed and pushed to the loopback registry."""
    reference = os.environ.get(ENV_VLLM_IMAGE)
    if not reference:
        started = time.monotonic()
        reference = ensure_vllm_image()
        print(f"\nvLLM image {reference} built and pushed in {time.monotonic() - started:.1f}s")
    return reference


@pytest.fixture(scope="session")
def vllm_image_on_node(cluster: LocalCluster, vllm_image: str) -> str:
    """The vLLM image, pulled once per session by the kubelet node (a cold pull unpacks several GB)."""
    if cluster.kubelet_node is not None:
        started = time.monotonic()
        pulled = pull_on_node(cluster=cluster, image=vllm_image, namespace=f"vllm-image-pull-{uuid.uuid4().hex[:5]}")
        print(f"\nvLLM image on the kubelet node in {time.monotonic() - started:.1f}s ({pulled})")
    return vllm_image


@pytest.fixture(scope="module")
def vllm_stack(
    request: pytest.FixtureRequest,
    cluster: LocalCluster,
    image: str,
    vllm_image_on_node: str,
    local_hub: LocalHub,
    model_hub: ModelHub,
) -> Iterator[Stack]:
    """The real-node stack (:func:`~splitserve_e2e.realnode.real_node_stack`) with the chart's
    ``runtime.vllmImage`` set and SmolLM2-135M-Instruct published on the session's hub, one per
    module (its namespace named after the module)."""
    local_hub.publish(VLLM_REPO_ID, smollm2.hf_dir(), exclude=[smollm2.STAMP])
    stem = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")[:20]
    with real_node_stack(
        cluster=cluster,
        image=image,
        hub=local_hub,
        model_hub=model_hub,
        workloads=[f"{stem}-{uuid.uuid4().hex[:4]}"],
        vllm_image=vllm_image_on_node,
    ) as stack:
        yield stack


@pytest.fixture(scope="session")
def local_hub(cluster: LocalCluster) -> Iterator[LocalHub]:
    """The token-protected hub serving ``splitserve/tiny-llama`` where the pods reach it (the
    kubelet node's bridge gateway); its request log says what was downloaded."""
    model_dir = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
    # in the run's state dir: a killed session leaves it where the next one prunes it
    root = Path(tempfile.mkdtemp(prefix="e2e-hub-", dir=cluster.state_dir))
    hub, _ = start_model_hub(
        model_dir=model_dir, root=root, token=HUB_TOKEN, host=cluster.pod_gateway or LOOPBACK, port=0
    )
    try:
        yield hub
    finally:
        hub.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def model_hub(local_hub: LocalHub) -> ModelHub:
    """``hf://splitserve/tiny-llama`` from :func:`local_hub`; each namespace needs the token
    Secret (:func:`~splitserve_e2e.stack.create_hub_token_secret`)."""
    return ModelHub(endpoint=local_hub.endpoint, token=HUB_TOKEN)


def _running(run: Path) -> bool:
    """A run is running while the pytest process its ``cluster.json`` names is alive (a
    SIGKILLed or timed-out session leaves the file behind)."""
    try:
        pid = int(json.loads((run / "cluster.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return is_alive(pid)


_BULK = ("etcd-data", "prometheus-data", "kn/kubelet", "kn/containerd", "kn/images")
"""What a kept run does not need for its logs: several hundred MB each (pod volumes, the
hub's model copies under ``e2e-hub-*``, etcd and Prometheus data)."""


def _prune_kept_runs(runs: Path, *, keep: int = 3) -> None:
    """State dirs of failed sessions are kept for their logs (``logs/``, ``kn/pod-logs/``):
    keep only the newest few that are not running, and only their logs. The disk is shared
    with the kubelet node, which evicts pods when it runs short."""
    stopped = sorted(
        (d for d in runs.iterdir() if d.is_dir() and not _running(d)),
        key=lambda d: d.stat().st_mtime,
        reverse=True,
    )
    for index, old in enumerate(stopped):
        nodehost.unmount_under(old)  # a killed node leaves its kubelet dir mounted
        if index >= keep:
            shutil.rmtree(old, ignore_errors=True)
            continue
        for bulky in (*(old / part for part in _BULK), *old.glob("e2e-hub-*")):
            shutil.rmtree(bulky, ignore_errors=True)


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose ``default`` ServiceAccount exists (pods need it)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    name = f"e2e-{stem}-{uuid.uuid4().hex[:5]}"
    create_namespace(cluster, name)
    core = cluster.core()
    yield name
    try:
        core.delete_namespace(name)
    except ApiException as error:
        if error.status != 404:
            raise
