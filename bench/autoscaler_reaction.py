"""How fast the autoscaler's control loop reacts to a load step, measured on real parts.

A real kube-apiserver (with etcd), the real Prometheus (Debian binary, 1 s scrape) and the
operator's autoscaler running inside kopf (:func:`splitserve_operator.autoscaler.loop.register`)
scale the decode pool of one InferenceService. What is simulated is only what the control
loop does not own: the ReplicaSet (this script creates Ready pods for ``spec.replicas``,
optionally after ``--pod-start-seconds``) and the runtime's queue (a total load ``L`` of
waiting requests spread evenly over the Ready pods, exported per pod by ``prometheus_client``
servers the way the runtime exports ``splitserve_requests_waiting``).

Timeline: ``L = 4`` (2 pods at the target of 2 waiting per pod), then a step to ``L = 12``
(6 pods wanted), then a drop to ``L = 2`` (1 pod). Printed figures:

* load step -> first ``spec.replicas`` write (reaction), and -> 6 replicas (settled);
* load drop -> first scale-down (expected: the scale-down stabilization window plus up to
  one interval) and -> 1 replica (one pod per interval with ``maxStep: 1``);
* the worst case the configuration allows for noticing a step: one scrape, one interval and
  one base tick of the autoscaler loop.

    python bench/autoscaler_reaction.py [--interval 2s] [--window-seconds 2] \
        [--down-stabilization-seconds 10] [--pod-start-seconds 0]

Writes ``$OUT/autoscaler_reaction.json`` when ``OUT`` is set. Needs the kube-apiserver that
``python -m splitserve_e2e.build`` builds, ``/usr/bin/etcd`` and ``/usr/bin/prometheus``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from splitserve_contract import API_GROUP, API_VERSION, KIND, PLURAL, Metric
from splitserve_e2e.apiserver import start_apiserver
from splitserve_e2e.build import KUBERNETES_VERSION, cache_root
from splitserve_e2e.etcd import start_etcd
from splitserve_e2e.pki import ensure_pki
from splitserve_operator import kube, naming
from splitserve_operator.api import parse_duration_seconds
from splitserve_operator.autoscaler.loop import register

NS, NAME, ROLE = "bench", "svc", "decode"
MAX_PODS = 8
SCRAPE_SECONDS = 1.0
CRD = kube.Kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False)
NAMESPACE = kube.Kind("v1", "Namespace", "namespaces", namespaced=False)
SERVICE_ACCOUNT = kube.Kind("v1", "ServiceAccount", "serviceaccounts")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PodExporter:
    """One pod's runtime gauges on its own HTTP port."""

    def __init__(self, name: str) -> None:
        self.name = name
        registry = CollectorRegistry()
        self.waiting = Gauge(Metric.REQUESTS_WAITING, "waiting", ["role", "model"], registry=registry).labels(ROLE, "m")
        self.running = Gauge(Metric.REQUESTS_RUNNING, "running", ["role", "model"], registry=registry).labels(ROLE, "m")
        self.kv = Gauge(Metric.KV_CACHE_USAGE_RATIO, "kv", ["role", "model"], registry=registry).labels(ROLE, "m")
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    def set_load(self, waiting: float) -> None:
        self.waiting.set(waiting)
        self.running.set(min(waiting, 1.0))
        self.kv.set(0.1)


@contextlib.contextmanager
def control_plane(workdir: Path) -> Iterator[tuple[kube.Kube, k8s.CoreV1Api, kopf.ConnectionInfo]]:
    binary = cache_root() / "bin" / f"k8s-{KUBERNETES_VERSION}" / "kube-apiserver"
    logs, pids = workdir / "logs", workdir / "pids"
    logs.mkdir()
    pids.mkdir()
    pki = ensure_pki(directory=workdir / "pki")
    etcd = start_etcd(binary=Path("/usr/bin/etcd"), data_dir=workdir / "etcd", log_dir=logs, pid_dir=pids)
    try:
        server = start_apiserver(binary=binary, etcd_url=etcd.client_url, pki=pki, log_dir=logs, pid_dir=pids)
        try:
            configuration = k8s.Configuration()
            configuration.host = server.url
            configuration.ssl_ca_cert = str(pki.ca_cert)
            configuration.cert_file = str(pki.admin.cert)
            configuration.key_file = str(pki.admin.key)
            login = kopf.ConnectionInfo(
                server=server.url,
                ca_path=str(pki.ca_cert),
                certificate_path=str(pki.admin.cert),
                private_key_path=str(pki.admin.key),
            )
            api_client = k8s.ApiClient(configuration)
            yield kube.Kube(api_client=api_client), k8s.CoreV1Api(api_client), login
        finally:
            server.process.stop(grace_seconds=5)
    finally:
        etcd.process.stop(grace_seconds=5)


@contextlib.contextmanager
def prometheus(workdir: Path, exporters: list[PodExporter]) -> Iterator[str]:
    targets = "\n".join(
        f'      - targets: ["127.0.0.1:{e.port}"]\n'
        f'        labels: {{namespace: "{NS}", pod: "{e.name}", inferenceservice: "{NAME}"}}'
        for e in exporters
    )
    (workdir / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {SCRAPE_SECONDS:g}s\n  scrape_timeout: 900ms\n"
        f"scrape_configs:\n  - job_name: bench\n    static_configs:\n{targets}\n"
    )
    port = free_port()
    with (workdir / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                "/usr/bin/prometheus",
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def setup_objects(api: kube.Kube, *, interval: str, down_stabilization_seconds: int) -> None:
    api.create(
        kind=CRD,
        namespace=None,
        obj={
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
            "spec": {
                "group": API_GROUP,
                "scope": "Namespaced",
                "names": {"kind": KIND, "plural": PLURAL, "singular": KIND.lower()},
                "versions": [
                    {
                        "name": API_VERSION,
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                ],
            },
        },
    )
    api.create(kind=NAMESPACE, namespace=None, obj={"metadata": {"name": NS}})
    api.create(kind=SERVICE_ACCOUNT, namespace=NS, obj={"metadata": {"name": "default"}})
    time.sleep(1.0)  # the CRD's REST endpoint appears asynchronously
    api.create(
        kind=kube.INFERENCE_SERVICE,
        namespace=NS,
        obj={
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {
                "model": {"uri": "hf://splitserve/tiny-llama"},
                "mode": "Disaggregated",
                "prefill": {"replicas": {"min": 1, "max": 1}, "resources": {"gpus": 1}},
                "decode": {"replicas": {"min": 1, "max": MAX_PODS}, "resources": {"gpus": 1}},
                "autoscaling": {
                    "interval": interval,
                    "decode": {"targetQueueDepth": 2},
                    "behavior": {"scaleDown": {"stabilizationSeconds": down_stabilization_seconds}},
                },
            },
        },
    )
    labels = naming.labels(NAME, ROLE)
    api.create(
        kind=kube.DEPLOYMENT,
        namespace=NS,
        obj={
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": naming.child_name(NAME, ROLE), "namespace": NS, "labels": labels},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": naming.selector_labels(NAME, ROLE)},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "runtime", "image": "splitserve:bench"}]},
                },
            },
        },
    )


class ReplicaSetStandIn:
    """Creates Ready pods ``<isvc>-decode-<i>`` for ``spec.replicas`` (after a start delay),
    deletes the highest-numbered ones on scale-down, and spreads the load over Ready pods."""

    def __init__(
        self, *, api: kube.Kube, core: k8s.CoreV1Api, exporters: list[PodExporter], pod_start_seconds: float
    ) -> None:
        self.api = api
        self.core = core
        self.exporters = exporters
        self.pod_start_seconds = pod_start_seconds
        self.load = 4.0
        self.starting: dict[str, float] = {}  # pod -> when it turns Ready (monotonic seconds)
        self.ready: set[str] = set()
        self.timeline: list[dict[str, float]] = []

    def replicas(self) -> int:
        obj = self.api.get(kind=kube.DEPLOYMENT, namespace=NS, name=naming.child_name(NAME, ROLE))
        return int((obj or {}).get("spec", {}).get("replicas") or 0)

    def _create_pod(self, name: str) -> None:
        self.api.create(
            kind=kube.POD,
            namespace=NS,
            obj={
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": NS, "labels": naming.labels(NAME, ROLE)},
                "spec": {"containers": [{"name": "runtime", "image": "splitserve:bench"}]},
            },
        )

    def _mark_ready(self, name: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.api.merge_patch(
            kind=kube.POD,
            namespace=NS,
            name=name,
            subresource="status",
            patch={
                "status": {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
                }
            },
        )

    def step(self, *, t_seconds: float) -> int:
        wanted = self.replicas()
        now = time.monotonic()
        for i, exporter in enumerate(self.exporters):
            name = exporter.name
            exists = name in self.ready or name in self.starting
            if i < wanted and not exists:
                self._create_pod(name)
                self.starting[name] = now + self.pod_start_seconds
            elif i >= wanted and exists:
                self.core.delete_namespaced_pod(name=name, namespace=NS, grace_period_seconds=0)
                self.ready.discard(name)
                self.starting.pop(name, None)
        for name, ready_at in list(self.starting.items()):
            if ready_at <= now:
                self._mark_ready(name)
                self.ready.add(name)
                del self.starting[name]
        for exporter in self.exporters:
            exporter.set_load(self.load / len(self.ready) if exporter.name in self.ready else 0.0)
        self.timeline.append(
            {"t": round(t_seconds, 2), "load": self.load, "replicas": wanted, "ready": len(self.ready)}
        )
        return wanted


def first(timeline: list[dict[str, float]], *, after: float, predicate: Any) -> float | None:
    return next((p["t"] - after for p in timeline if p["t"] >= after and predicate(p)), None)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING)
    exporters = [PodExporter(f"{NAME}-{ROLE}-{i}") for i in range(MAX_PODS)]
    with (
        tempfile.TemporaryDirectory(prefix="splitserve-bench-") as tmp,
        control_plane(Path(tmp)) as (api, core, login),
        prometheus(Path(tmp), exporters) as prometheus_url,
    ):
        setup_objects(api, interval=args.interval, down_stabilization_seconds=args.down_stabilization_seconds)
        registry = kopf.OperatorRegistry()
        kopf.on.login(registry=registry)(lambda **_: login)
        register(
            registry=registry,
            api=api,
            prometheus_url=prometheus_url,
            metrics_registry=CollectorRegistry(),
            base_tick_seconds=args.tick_seconds,
            scrape_interval_seconds=SCRAPE_SECONDS,
            window_seconds=args.window_seconds,
        )
        settings = kopf.OperatorSettings()
        settings.posting.enabled = False
        stop = asyncio.Event()
        operator = asyncio.create_task(
            kopf.operator(registry=registry, settings=settings, standalone=True, namespaces=[NS], stop_flag=stop)
        )
        rs = ReplicaSetStandIn(api=api, core=core, exporters=exporters, pod_start_seconds=args.pod_start_seconds)
        started = time.monotonic()
        interval_seconds = parse_duration_seconds(args.interval)
        phases = [(4.0, 10.0), (12.0, 30.0), (2.0, args.down_stabilization_seconds + 10 * interval_seconds + 10)]
        t_step = t_drop = 0.0
        try:
            for load, duration in phases:
                rs.load = load
                t0 = time.monotonic() - started
                if load == 12.0:
                    t_step = t0
                if load == 2.0:
                    t_drop = t0
                while time.monotonic() - started < t0 + duration:
                    await asyncio.to_thread(rs.step, t_seconds=time.monotonic() - started)
                    await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.wait_for(operator, timeout=30)
            for exporter in exporters:
                exporter.server.shutdown()
        timeline = rs.timeline
    return {
        "config": {
            "interval": args.interval,
            "tick_seconds": args.tick_seconds,
            "window_seconds": args.window_seconds,
            "scrape_seconds": SCRAPE_SECONDS,
            "down_stabilization_seconds": args.down_stabilization_seconds,
            "pod_start_seconds": args.pod_start_seconds,
        },
        "worst_case_reaction_seconds": SCRAPE_SECONDS + interval_seconds + args.tick_seconds,
        "scale_up_first_write_seconds": first(timeline, after=t_step, predicate=lambda p: p["replicas"] > 2),
        "scale_up_settled_seconds": first(timeline, after=t_step, predicate=lambda p: p["replicas"] >= 6),
        "scale_down_first_write_seconds": first(timeline, after=t_drop, predicate=lambda p: p["replicas"] < 6),
        "scale_down_settled_seconds": first(timeline, after=t_drop, predicate=lambda p: p["replicas"] == 1),
        "replica_path": [
            p["replicas"] for i, p in enumerate(timeline) if i == 0 or timeline[i - 1]["replicas"] != p["replicas"]
        ],
        "timeline": timeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", default="2s", help="spec.autoscaling.interval")
    parser.add_argument("--tick-seconds", type=float, default=1.0, help="autoscaler loop base tick")
    parser.add_argument("--window-seconds", type=float, default=2.0, help="gauge smoothing window")
    parser.add_argument("--down-stabilization-seconds", type=int, default=10)
    parser.add_argument("--pod-start-seconds", type=float, default=0.0, help="simulated pod start-up")
    result = asyncio.run(run(parser.parse_args()))
    summary = {k: v for k, v in result.items() if k != "timeline"}
    print(json.dumps(summary, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "autoscaler_reaction.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
