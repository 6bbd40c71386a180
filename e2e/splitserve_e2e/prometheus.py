"""Prometheus scraping the cluster's pods, as the autoscaler will read it in production.

Debian's Prometheus discovers pods with ``kubernetes_sd_configs`` (role ``pod``) against the
local API server, authenticating with the harness's admin certificate. It keeps only pods
labelled ``splitserve.dev/scrape=true`` (contract.LABEL_SCRAPE) and running, scrapes
``<podIP>:<port>`` where the port is contract.HTTP_PORT unless the annotation
``prometheus.io/port`` says otherwise, and adds the labels ``namespace``, ``pod`` and
``inferenceservice`` (from ``app.kubernetes.io/instance``) named in docs/architecture.md, "Metrics".
The short default interval (2 s) keeps tests fast.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import httpx
import yaml

from splitserve_contract import HTTP_PORT, LABEL_INSTANCE, LABEL_ROLE, LABEL_SCRAPE, METRICS_PATH
from splitserve_e2e.net import LOOPBACK, free_port
from splitserve_e2e.pki import ClusterPki
from splitserve_e2e.process import ManagedProcess, start_process, wait_until

PORT_ANNOTATION = "prometheus.io/port"
PATH_ANNOTATION = "prometheus.io/path"
JOB_NAME = "splitserve-pods"


class PrometheusQueryError(RuntimeError):
    """Prometheus answered a query with an error (the message is Prometheus's)."""


def _meta_name(kind: str, key: str) -> str:
    """Prometheus's name for a pod label/annotation meta label (non-alphanumerics -> _)."""
    return f"__meta_kubernetes_pod_{kind}_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def scrape_config(*, api_server_url: str, pki: ClusterPki, interval_seconds: float) -> dict[str, Any]:
    """The whole prometheus.yml for the local cluster."""
    interval = f"{interval_seconds:g}s"
    tls = {"ca_file": str(pki.ca_cert), "cert_file": str(pki.admin.cert), "key_file": str(pki.admin.key)}
    port_meta = _meta_name("annotation", PORT_ANNOTATION)
    return {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            "scrape_timeout": f"{min(interval_seconds, 10.0):g}s",
        },
        "scrape_configs": [
            {
                "job_name": JOB_NAME,
                "metrics_path": METRICS_PATH,
                "kubernetes_sd_configs": [{"role": "pod", "api_server": api_server_url, "tls_config": tls}],
                "relabel_configs": [
                    {"source_labels": [_meta_name("label", LABEL_SCRAPE)], "regex": "true", "action": "keep"},
                    {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
                    {
                        "source_labels": ["__meta_kubernetes_pod_ip"],
                        "regex": "(.+)",
                        "target_label": "__address__",
                        "replacement": f"$1:{HTTP_PORT}",
                    },
                    {
                        "source_labels": ["__meta_kubernetes_pod_ip", port_meta],
                        "regex": "(.+);([0-9]+)",
                        "target_label": "__address__",
                        "replacement": "$1:$2",
                    },
                    {
                        "source_labels": [_meta_name("annotation", PATH_ANNOTATION)],
                        "regex": "(.+)",
                        "target_label": "__metrics_path__",
                    },
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"source_labels": [_meta_name("label", LABEL_INSTANCE)], "target_label": "inferenceservice"},
                    # The pool, from the pod: every engine's series carry it (vLLM's have no
                    # role label of their own; the bundled runtime's equal value is kept as
                    # exported_role).
                    {"source_labels": [_meta_name("label", LABEL_ROLE)], "target_label": "role"},
                ],
            }
        ],
    }


@dataclasses.dataclass
class Prometheus:
    process: ManagedProcess
    url: str

    def query(self, promql: str) -> list[dict[str, Any]]:
        return query(url=self.url, promql=promql)


def query(*, url: str, promql: str, timeout_seconds: float = 10.0) -> list[dict[str, Any]]:
    """Instant query; returns ``data.result`` (vector/matrix entries)."""
    response = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=timeout_seconds)
    body = response.json()
    if body.get("status") != "success":
        raise PrometheusQueryError(f"{promql!r}: {body.get('errorType')}: {body.get('error')}")
    return list(body["data"]["result"])


def start_prometheus(
    *,
    binary: Path,
    api_server_url: str,
    pki: ClusterPki,
    state_dir: Path,
    log_dir: Path,
    pid_dir: Path,
    interval_seconds: float = 2.0,
    timeout_seconds: float = 60.0,
    listen_host: str = LOOPBACK,
) -> Prometheus:
    """Write the config, start Prometheus and wait for ``/-/ready``. ``listen_host``: the
    address it serves on (loopback; the kubelet node's bridge gateway when pods, such as the
    operator running as a container, must reach it)."""
    if interval_seconds <= 0:
        raise ValueError(f"interval_seconds must be > 0, got {interval_seconds}")
    port = free_port(host=listen_host)
    config_path = state_dir / "prometheus.yml"
    config_path.write_text(
        yaml.safe_dump(scrape_config(api_server_url=api_server_url, pki=pki, interval_seconds=interval_seconds))
    )
    storage = state_dir / "prometheus-data"
    storage.mkdir(parents=True, exist_ok=True)
    url = f"http://{listen_host}:{port}"
    argv = [
        str(binary),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={storage}",
        f"--web.listen-address={listen_host}:{port}",
        "--storage.tsdb.retention.time=1d",
        "--log.level=warn",
    ]
    process = start_process(name="prometheus", argv=argv, log_path=log_dir / "prometheus.log", pid_dir=pid_dir)
    wait_until(
        lambda: httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200,
        timeout_seconds=timeout_seconds,
        what="prometheus /-/ready",
        alive=process,
    )
    return Prometheus(process=process, url=url)
