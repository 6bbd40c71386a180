"""pytest fixtures for the end-to-end tests: one real local cluster per session.

``cluster`` starts a :class:`LocalCluster` in a pytest temp directory (logs stay there for
inspection) and stops it at session end, also after a failure or Ctrl-C (pytest tears
session fixtures down on KeyboardInterrupt; atexit and the children's parent-death signal cover
harder exits). ``--existing-cluster[=KUBECONFIG]`` or ``SPLITSERVE_E2E_KUBECONFIG`` run the
same tests against a cluster that is already up (``python -m splitserve_e2e up``, or any other);
with a bare kubeconfig, tests that need the local node's files (pod logs, pids) fail with
:class:`LocalNodeUnavailable` saying so; with the `up` cluster they work (files in its state
directory).
``namespace`` gives each test a fresh namespace and deletes it afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import (
    ENV_EXISTING_KUBECONFIG,
    ClusterOptions,
    LocalCluster,
    default_state_dir,
)

_USE_UP_CLUSTER = "__up__"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--existing-cluster", nargs="?", const=_USE_UP_CLUSTER, default=None,
        metavar="KUBECONFIG",
        help="run e2e tests against a running cluster: the given kubeconfig, else "
             f"${ENV_EXISTING_KUBECONFIG}, else the one `python -m splitserve_e2e up` started")


def _existing(config: pytest.Config) -> LocalCluster | None:
    option = config.getoption("--existing-cluster")
    from_env = os.environ.get(ENV_EXISTING_KUBECONFIG)
    if option is None and not from_env:
        return None
    if option not in (None, _USE_UP_CLUSTER):
        return LocalCluster.from_existing(kubeconfig=Path(option))
    if from_env:
        return LocalCluster.from_existing(kubeconfig=Path(from_env))
    return LocalCluster.attach(state_dir=default_state_dir())  # pod logs/pids work too


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    existing = _existing(request.config)
    if existing is not None:
        yield existing
        return
    # not pytest's tmp_path: other pytest sessions on the machine prune those while we run
    runs = cache_root() / "e2e-runs"
    runs.mkdir(parents=True, exist_ok=True)
    _prune_kept_runs(runs)
    state_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))
    local = LocalCluster(state_dir=state_dir,
                         options=ClusterOptions(num_gpu_nodes=2, scrape_interval_seconds=1.0))
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
            print(f"\nlocal cluster logs kept in {state_dir / 'logs'} and {state_dir / 'pods'}")


def _prune_kept_runs(runs: Path, *, keep: int = 5) -> None:
    """State dirs of failed sessions are kept for their logs; keep only the newest few that
    are not running (a running cluster has cluster.json)."""
    stopped = sorted((d for d in runs.iterdir() if d.is_dir() and not (d / "cluster.json").exists()),
                     key=lambda d: d.stat().st_mtime, reverse=True)
    for old in stopped[keep:]:
        shutil.rmtree(old, ignore_errors=True)


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose ``default`` ServiceAccount exists (pods need it)."""
    stem = request.node.name.replace("_", "-").lower()[:40].strip("-")
    name = f"e2e-{stem}-{uuid.uuid4().hex[:5]}"
    core = cluster.core()
    core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
    cluster.wait_for(lambda: core.read_namespaced_service_account("default", name),
                     timeout_seconds=30, what=f"ServiceAccount {name}/default")
    yield name
    try:
        core.delete_namespace(name)
    except ApiException as error:
        if error.status != 404:
            raise
