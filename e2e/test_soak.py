"""Soak: many InferenceService create/delete cycles against the real control plane (issue 12).

The chart's operator (a container on the kubelet node, its own ServiceAccount) reconciles ``SOAK_CYCLES``
InferenceServices, created and deleted in batches, in a cluster whose only untainted
node is cordoned: every child (ConfigMap, Deployments, Services, PDBs, NetworkPolicies, the handoff
key Secret) is rendered, applied, watched, status-reported and garbage-collected as in
production, while no pod process starts, so the run measures the operator and not the
runtime. It asserts, and prints, that

* the operator's resident memory stays flat (growth after warm-up within ``RSS_GROWTH_BOUND``),
* nothing is left behind (no child of any kind with the managed-by label),
* there is no hot loop: at idle, the API server's request rate and the operator's CPU use
  after the soak are what they were before it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.kubeletnode import NODE_NAME
from splitserve_e2e.stack import ModelHub, isvc_manifest, operator_namespace

pytestmark = pytest.mark.e2e

SOAK_CYCLES = int(os.environ.get("SPLITSERVE_SOAK_CYCLES", "200"))
"""`make test` runs 200 cycles; `make soak` runs the full 1,000 (about 15 minutes here)."""
BATCH = 25
WARMUP_CYCLES = 100
RSS_GROWTH_BOUND = 40 * 2**20
"""Allowed growth of the operator's RSS between the end of warm-up and the end of the soak.
CPython's allocator keeps arenas, so a flat process still wanders by some MiB. Over the 900
cycles after warm-up of `make soak`, a leak of 45 KiB per cycle (a few InferenceService bodies)
crosses this bound; the report also prints the growth per cycle over the second half."""
IDLE_SECONDS = 10.0
CHILD_KINDS = "deployments,services,configmaps,poddisruptionbudgets,networkpolicies,secrets,replicasets,pods"
"""Everything with the managed-by label, pods included: the idle window after the soak starts only
when garbage collection is over (pending pods being deleted are events the operator sees)."""


@dataclasses.dataclass(frozen=True)
class Idle:
    """What an idle window of IDLE_SECONDS saw. The API server's rate counts every client
    (the controller manager still collecting, kwok, ...): shown, not asserted; the operator's
    own reconciles and CPU are what a hot loop would raise."""

    api_requests_per_second: float
    operator_cpu_percent: float
    reconciles_per_second: float


@dataclasses.dataclass(frozen=True)
class Process:
    """The operator's process, read from /proc (pid and its start time, so a restart shows)."""

    pid: int
    start_ticks: int

    def _stat(self) -> list[str]:
        text = Path(f"/proc/{self.pid}/stat").read_text()
        return text[text.rindex(")") + 2 :].split()

    def is_running(self) -> bool:
        try:
            return int(self._stat()[19]) == self.start_ticks
        except (OSError, ValueError):
            return False

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def cpu_seconds(self) -> float:
        fields = self._stat()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _running_operator_pods(cluster: LocalCluster, namespace: str) -> list[Any]:
    core: Any = cluster.core()
    return [
        p
        for p in core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=operator").items
        if p.status.phase == "Running" and p.status.pod_ip and not p.metadata.deletion_timestamp
    ]


def _operator_pod(cluster: LocalCluster, namespace: str) -> Any:
    """The one running operator pod. The install returns once the operator holds its Lease;
    the kubelet's status update (phase Running, pod IP) can reach the API server seconds
    later on a loaded machine, so this waits for it rather than reading once."""
    pods = cluster.wait_for(
        functools.partial(_running_operator_pods, cluster, namespace),
        timeout_seconds=60,
        what=f"the operator pod in {namespace} reported Running",
    )
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


def _operator_process(cluster: LocalCluster, namespace: str) -> Process:
    pod = _operator_pod(cluster, namespace)
    init = cluster.container_pid(namespace=namespace, pod=pod.metadata.name)
    assert init is not None
    # the operator is the only child of the container's PID 1 (tini)
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    assert len(children) == 1, children
    pid = int(children[0])
    text = Path(f"/proc/{pid}/stat").read_text()
    return Process(pid=pid, start_ticks=int(text[text.rindex(")") + 2 :].split()[19]))


def _api_requests(cluster: LocalCluster) -> float:
    """Non-watch requests the API server has answered so far (all clients)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total" and sample.labels.get("verb") not in ("WATCH", "CONNECT"):
                total += sample.value
    return total


def _reconciles(metrics_url: str) -> float:
    """Reconciles the operator has run so far (its own /metrics)."""
    text = httpx.get(metrics_url, timeout=10.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"{contract.OperatorMetric.RECONCILE_SECONDS}_count"
    )


def _idle(cluster: LocalCluster, process: Process, metrics_url: str) -> Idle:
    requests, cpu, reconciles = _api_requests(cluster), process.cpu_seconds(), _reconciles(metrics_url)
    time.sleep(IDLE_SECONDS)
    # the closing scrape itself is one request: not subtracted, the same in both windows
    return Idle(
        api_requests_per_second=(_api_requests(cluster) - requests) / IDLE_SECONDS,
        operator_cpu_percent=100.0 * (process.cpu_seconds() - cpu) / IDLE_SECONDS,
        reconciles_per_second=(_reconciles(metrics_url) - reconciles) / IDLE_SECONDS,
    )


def _operator_metrics_url(cluster: LocalCluster, namespace: str) -> str:
    pod = _operator_pod(cluster, namespace)
    port = next((p.container_port for c in pod.spec.containers for p in c.ports or [] if p.name == "metrics"), 8080)
    return f"http://{pod.status.pod_ip}:{port}/metrics"


def _managed_children(cluster: LocalCluster, namespace: str) -> list[str]:
    result = cluster.kubectl(
        "get",
        CHILD_KINDS,
        "-n",
        namespace,
        "-o",
        "name",
        "-l",
        f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_VALUE}",
    )
    return result.stdout.split()


def _applied(cluster: LocalCluster, namespace: str, names: frozenset[str]) -> bool:
    """Every InferenceService of ``names`` has its Deployments (the last kind applied)."""
    apps: Any = cluster.apps()
    deployments = apps.list_namespaced_deployment(
        namespace, label_selector=f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_VALUE}"
    ).items
    return names <= {str((d.metadata.labels or {}).get(contract.LABEL_INSTANCE)) for d in deployments}


@pytest.fixture(scope="module")
def soak_ns(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    """A namespace with the operator installed, and no node that would start a pod."""
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="soak") as namespace:
        # After the operator pod runs: with the kubelet node cordoned (the kwok GPU nodes are
        # tainted and the pools do not tolerate it), the InferenceServices' pods stay Pending
        # and start no container. (A ResourceQuota would be the usual tool, but this control
        # plane has no quota controller filling its status.)
        cluster.kubectl("cordon", NODE_NAME)
        try:
            yield namespace
        finally:
            cluster.kubectl("uncordon", NODE_NAME)


def test_create_delete_soak_keeps_the_operator_flat_and_leaves_nothing(
    cluster: LocalCluster, soak_ns: str, model_hub: ModelHub, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = soak_ns
    custom: Any = cluster.custom()
    process = _operator_process(cluster, namespace)
    metrics_url = _operator_metrics_url(cluster, namespace)
    before = _idle(cluster, process, metrics_url)
    curve: list[tuple[int, int, float]] = []  # (cycles done, RSS bytes, seconds)
    started = time.monotonic()
    done = 0
    while done < SOAK_CYCLES:
        names = [f"soak-{done + i}" for i in range(min(BATCH, SOAK_CYCLES - done))]
        for name in names:
            body = isvc_manifest(name=name, namespace=namespace, mode="Disaggregated", hub=model_hub)
            custom.create_namespaced_custom_object(
                contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, body
            )

        batch = frozenset(names)
        cluster.wait_for(
            functools.partial(_applied, cluster, namespace, batch),
            timeout_seconds=120,
            what=f"children of {names[0]}..{names[-1]}",
        )
        for name in names:
            custom.delete_namespaced_custom_object(
                contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, name
            )
        cluster.wait_for(
            lambda: not _managed_children(cluster, namespace),
            timeout_seconds=120,
            what=f"children of {names[0]}..{names[-1]} collected",
        )
        done += len(names)
        curve.append((done, process.rss_bytes(), time.monotonic() - started))
    after = _idle(cluster, process, metrics_url)

    warm = next((rss for cycles, rss, _ in curve if cycles >= WARMUP_CYCLES), curve[0][1])
    final = curve[-1][1]
    lines = [
        f"soak: {done} create/delete cycles in {curve[-1][2]:.0f}s ({done / curve[-1][2]:.1f}/s), batches of {BATCH}",
        "  cycles  operator RSS (MiB)",
    ]
    step = max(1, len(curve) // 10)
    lines += [f"  {cycles:>6}  {rss / 2**20:8.1f}" for cycles, rss, _ in curve[::step] + curve[-1:]]
    half = curve[len(curve) // 2]
    per_cycle = (final - half[1]) / max(1, done - half[0])
    lines.append(
        f"  RSS growth after {WARMUP_CYCLES} cycles: {(final - warm) / 2**20:+.1f} MiB "
        f"(bound {RSS_GROWTH_BOUND / 2**20:.0f} MiB); second half {per_cycle / 1024:+.1f} KiB/cycle"
    )
    for label, idle in (("idle before", before), ("idle after ", after)):
        lines.append(
            f"  {label}: operator {idle.reconciles_per_second:.2f} reconciles/s, CPU "
            f"{idle.operator_cpu_percent:.1f}%; API server {idle.api_requests_per_second:.1f} req/s (all clients)"
        )
    report = "\n".join(lines)
    with capsys.disabled():
        print("\n" + report)
    assert process.is_running(), "the operator restarted during the soak"
    assert final - warm <= RSS_GROWTH_BOUND, report
    assert not _managed_children(cluster, namespace)
    assert after.reconciles_per_second <= before.reconciles_per_second + 0.5, report
    assert after.operator_cpu_percent <= before.operator_cpu_percent + 5.0, report
