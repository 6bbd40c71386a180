"""The Prometheus Operator's CRDs and Prometheus's promtool, pinned, for checking the chart's
monitoring objects (PodMonitor, ServiceMonitor, PrometheusRule) the way a cluster running
kube-prometheus-stack would see them.

No Prometheus Operator runs here: what matters to the chart is that the API server, with the
operator's real CRDs (their OpenAPI schemas: patterns, enums, required fields) installed,
accepts what the chart renders. The CRDs come from the operator's Go module
(``example/prometheus-operator-crd/``, the manifests its releases ship) at a pinned version,
fetched with ``go mod download`` like the other pinned tools (:mod:`splitserve_e2e.build`)
and copied to ``~/.cache/splitserve/prometheus-operator-crds/<version>/``. Only the three
kinds the chart renders are installed.

promtool is built from the same Prometheus module as the harness's Prometheus
(:data:`~splitserve_e2e.build.PROMETHEUS_VERSION`, Prometheus 3, what kube-prometheus-stack
runs), with the same tags, so the Go build cache makes it a matter of seconds once Prometheus
is built; Debian's promtool is a 2.x release.

On a cluster that already has these CRDs (``--existing-cluster`` against a cluster with the
operator) they are used as they are: :func:`install_crds` creates only missing ones and
:func:`remove_crds` deletes only what it created, so a real cluster's monitors are never
touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from splitserve_e2e import build
from splitserve_e2e.cluster import LocalCluster

PROMETHEUS_OPERATOR_VERSION: Final = "v0.85.0"
PROMETHEUS_OPERATOR_MODULE: Final = "github.com/prometheus-operator/prometheus-operator"
CRD_DIRECTORY: Final = "example/prometheus-operator-crd"
CRD_GROUP: Final = "monitoring.coreos.com"
CRD_PLURALS: Final = ("podmonitors", "servicemonitors", "prometheusrules")
"""The kinds the chart renders (PodMonitor, ServiceMonitor, PrometheusRule)."""
CRD_NAMES: Final = tuple(f"{plural}.{CRD_GROUP}" for plural in CRD_PLURALS)

_STAMP: Final = ".complete.json"


def crd_cache_dir() -> Path:
    return build.cache_root() / "prometheus-operator-crds" / PROMETHEUS_OPERATOR_VERSION


def _crd_files(directory: Path) -> list[Path]:
    return [directory / f"{CRD_GROUP}_{plural}.yaml" for plural in CRD_PLURALS]


def ensure_crds() -> list[Path]:
    """The pinned CRD manifests (one file per kind), fetched from the Go module once and cached."""
    directory = crd_cache_dir()
    files = _crd_files(directory)
    if (directory / _STAMP).is_file() and all(f.is_file() for f in files):
        return files
    with build.exclusive(directory.with_name(directory.name + ".lock")):
        if (directory / _STAMP).is_file() and all(f.is_file() for f in files):
            return files
        go = shutil.which("go")
        if go is None:
            raise build.BuildError("`go` is not on PATH; it fetches the Prometheus Operator's CRDs")
        module = f"{PROMETHEUS_OPERATOR_MODULE}@{PROMETHEUS_OPERATOR_VERSION}"
        env = dict(os.environ)
        env.setdefault("GOFLAGS", "-buildvcs=false")
        result = subprocess.run(
            [go, "mod", "download", "-json", module], env=env, capture_output=True, text=True, timeout=600, check=False
        )
        if result.returncode != 0:
            raise build.BuildError(f"go mod download {module} failed: {result.stderr or result.stdout}")
        source = Path(json.loads(result.stdout)["Dir"]) / CRD_DIRECTORY
        directory.mkdir(parents=True, exist_ok=True)
        for target in files:
            origin = source / target.name
            if not origin.is_file():
                raise build.BuildError(f"{module} has no {CRD_DIRECTORY}/{target.name}")
            target.write_bytes(origin.read_bytes())  # the module cache is read-only
        (directory / _STAMP).write_text(json.dumps({"module": module, "files": [f.name for f in files]}))
        return files


def ensure_promtool() -> Path:
    """promtool of the pinned Prometheus, built once into ``~/.cache/splitserve/bin``."""
    return build.ensure_binaries().promtool


def _existing(cluster: LocalCluster, names: Sequence[str]) -> set[str]:
    result = cluster.kubectl("get", "crd", *names, "--ignore-not-found", "-o", "name")
    return {line.removeprefix("customresourcedefinition.apiextensions.k8s.io/") for line in result.stdout.split()}


def install_crds(cluster: LocalCluster, files: Sequence[Path]) -> list[str]:
    """Create the CRDs the cluster lacks (server-side apply) and wait until each of the three
    is Established; returns the names it created (what :func:`remove_crds` may delete)."""
    present = _existing(cluster, CRD_NAMES)
    created = [name for name in CRD_NAMES if name not in present]
    for name, path in zip(CRD_NAMES, files, strict=True):
        if name in created:
            cluster.kubectl("apply", "--server-side", "-f", str(path))

    def established() -> bool:
        result = cluster.kubectl(
            "get",
            "crd",
            *CRD_NAMES,
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Established')].status} {end}",
            check=False,
        )
        return result.returncode == 0 and result.stdout.split() == ["True"] * len(CRD_NAMES)

    cluster.wait_for(
        established, timeout_seconds=60, interval_seconds=0.5, what=f"CRDs {', '.join(CRD_NAMES)} Established"
    )
    return created


def remove_crds(cluster: LocalCluster, names: Sequence[str]) -> None:
    """Delete the CRDs :func:`install_crds` created (and with them any object of those kinds)."""
    if names:
        cluster.kubectl("delete", "crd", *names, "--ignore-not-found", "--wait=true", timeout_seconds=120)
