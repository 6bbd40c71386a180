"""Real Prometheus plumbing shared by the autoscaler tests.

:class:`FakePod` is a ``prometheus_client`` HTTP server with its own registry exporting the
runtime's gauges for one pod; :func:`start_prometheus` runs the harness' Prometheus binary
scraping such pods every second, with ``static_configs`` labels adding ``namespace``,
``pod`` and ``inferenceservice`` the way the chart's pod relabelling does. The binaries
(Prometheus, etcd, kube-apiserver) are the harness' own builds
(:func:`splitserve_e2e.build.ensure_binaries`, cached under ``~/.cache/splitserve``).

:func:`wait_until` and :func:`eventually` wait on an observable condition; tests never sleep
to order events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

import pytest
import requests
from kubernetes import client as k8s
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from urllib3.util.retry import Retry

import splitserve_contract as contract
from splitserve_e2e import build
from splitserve_e2e import pki as build_pki
from splitserve_e2e.net import free_port
from splitserve_operator.autoscaler.decision import MetricsUnavailable
from splitserve_operator.autoscaler.signals import quote_label_value

T = TypeVar("T")


@functools.cache
def harness_binaries() -> build.Binaries | None:
    """The harness' binaries (reused from the cache; built when missing and Go is available),
    or None when they cannot be had."""
    try:
        return build.ensure_binaries()
    except build.BuildError:
        return None


def require_binaries() -> build.Binaries:
    """:func:`harness_binaries`, or skip the test."""
    binaries = harness_binaries()
    if binaries is None:
        pytest.skip("needs the harness' binaries (python -m splitserve_e2e.build)")
    return binaries


@dataclasses.dataclass(frozen=True)
class BareApiserver:
    """A kube-apiserver (with its etcd) and nothing else: no controllers, no nodes."""

    url: str
    pki: build_pki.ClusterPki
    api_client: k8s.ApiClient


@contextlib.contextmanager
def bare_apiserver(state: Path) -> Iterator[BareApiserver]:
    """Start etcd and kube-apiserver under ``state`` (skip without the harness' binaries), with
    an admin client; both stop on exit."""
    from splitserve_e2e.apiserver import start_apiserver
    from splitserve_e2e.etcd import start_etcd

    binaries = require_binaries()
    logs, pids = state / "logs", state / "pids"
    logs.mkdir()
    pids.mkdir()
    pki = build_pki.ensure_pki(directory=state / "pki")
    etcd = start_etcd(binary=binaries.etcd, data_dir=state / "etcd", log_dir=logs, pid_dir=pids)
    try:
        server = start_apiserver(
            binary=binaries.kube_apiserver, etcd_url=etcd.client_url, pki=pki, log_dir=logs, pid_dir=pids
        )
        try:
            configuration = k8s.Configuration()
            configuration.host = server.url
            configuration.ssl_ca_cert = str(pki.ca_cert)
            configuration.cert_file = str(pki.admin.cert)
            configuration.key_file = str(pki.admin.key)
            yield BareApiserver(url=server.url, pki=pki, api_client=k8s.ApiClient(configuration))
        finally:
            server.process.stop(grace_seconds=5)
    finally:
        etcd.process.stop(grace_seconds=5)


def create_inference_service(
    server: BareApiserver, obj: Mapping[str, object], *, namespace: str = "default"
) -> str | None:
    """Create the InferenceService ``obj`` on ``server``: None when admitted, else the API
    server's refusal message (a 422; anything else fails the test). Waits for a CRD created
    just before to be served."""
    objects = k8s.CustomObjectsApi(server.api_client)
    deadline = time.monotonic() + 30
    while True:
        try:
            objects.create_namespaced_custom_object(
                contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, dict(obj)
            )
            return None
        except k8s.ApiException as exc:
            if exc.status == 404 and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            assert exc.status == 422, exc.body
            return str(json.loads(exc.body or "{}").get("message"))


async def wait_until(
    predicate: Callable[[], object],
    *,
    timeout_seconds: float = 10.0,
    poll_seconds: float = 0.05,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` (plain or async; any truthy result) until it holds; fail after
    ``timeout_seconds``."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        outcome = predicate()
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds:g}s waiting for {what}")
        await asyncio.sleep(poll_seconds)


def wait_for_window(
    client: PrometheusConnect,
    *,
    values: Mapping[tuple[str, str], float],
    window_seconds: float,
    timeout_seconds: float = 15.0,
) -> None:
    """Wait until Prometheus' last ``window_seconds`` hold only ``values`` ((pod, metric) ->
    value): every smoothed query from then on sees the new values and nothing older."""

    def settled() -> None:
        for (pod, metric), value in values.items():
            selector = f"{metric}{{pod={quote_label_value(pod)}}}"
            for fn in ("min_over_time", "max_over_time"):
                result = client.custom_query(query=f"{fn}({selector}[{window_seconds:g}s])")
                assert result and float(result[0]["value"][1]) == value, (fn, pod, metric, result)

    eventually(settled, timeout_seconds=timeout_seconds)


@dataclasses.dataclass
class FakePod:
    namespace: str
    name: str
    role: str
    values: dict[str, float]
    inferenceservice: str = "svc"
    port: int = 0
    server: WSGIServer | None = None
    gauges: dict[str, Gauge] = dataclasses.field(default_factory=dict)

    def start(self) -> None:
        registry = CollectorRegistry()
        for metric, value in self.values.items():
            self.gauges[metric] = Gauge(metric, "test gauge", ["role", "model"], registry=registry)
            self.gauges[metric].labels(role=self.role, model="tiny").set(value)
        self.port = free_port()
        self.server, _thread = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    def set(self, metric: str, value: float) -> None:
        self.gauges[metric].labels(role=self.role, model="tiny").set(value)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def eventually(probe: Callable[[], T], *, timeout_seconds: float = 15.0) -> T:
    """Retry ``probe`` until it stops raising (real scrapes take time)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            return probe()
        except (AssertionError, MetricsUnavailable, requests.RequestException, PrometheusApiClientException):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@contextlib.contextmanager
def running_prometheus(*, pods: Sequence[FakePod], workdir: Path) -> Iterator[PrometheusConnect]:
    """Start the pods' servers and a Prometheus scraping them; wait until all are up."""
    for pod in pods:
        pod.start()
    targets = "\n".join(
        f"""      - targets: ["127.0.0.1:{pod.port}"]
        labels: {{namespace: "{pod.namespace}", pod: "{pod.name}", inferenceservice: "{pod.inferenceservice}"}}"""
        for pod in pods
    )
    (workdir / "prometheus.yml").write_text(
        f"""global:
  scrape_interval: 1s
  scrape_timeout: 900ms
scrape_configs:
  - job_name: splitserve
    static_configs:
{targets}
"""
    )
    port = free_port()
    with (workdir / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                str(require_binaries().prometheus),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        client = PrometheusConnect(url=f"http://127.0.0.1:{port}", retry=Retry(total=0), timeout=5)
        try:

            def all_scraped() -> None:
                up = client.custom_query(query="sum(up)")
                assert up and float(up[0]["value"][1]) == len(pods)

            eventually(all_scraped, timeout_seconds=30)
            yield client
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            for pod in pods:
                pod.stop()
