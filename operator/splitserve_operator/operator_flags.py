"""Command-line flags of `splitserve operator`.

The Helm chart's Deployment template passes exactly these flags, and the operator's
entry point builds its argument parser from this table with :func:`add_operator_arguments`,
so the chart and the binary cannot drift (tests/operator/chart/test_chart.py checks every flag
the chart renders against this table). Same shape as the runtime's flag tables in
:mod:`splitserve_contract`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Final

from splitserve_contract import Flag, add_arguments, defaults
from splitserve_contract.engines import VLLM_IMAGE


@dataclasses.dataclass(frozen=True)
class OperatorArgs:
    """Arguments of `splitserve operator`. Defaults here are the operator's defaults."""

    namespace: str = ""  # watch only these namespaces (comma-separated: watched_namespaces); empty: cluster-wide
    runtime_image: str = "ghcr.io/splitserve/splitserve:0.1.0"
    vllm_image: str = VLLM_IMAGE  # pools of runtime.engine vllm that set no image
    router_service_account: str = ""  # serviceAccountName of router pods; empty: namespace default
    allowed_hub_endpoints: str = "https://huggingface.co"  # comma-separated (api.hub_policy); "*": any
    inference_pool: bool = False  # spec.router.mode InferencePool allowed (the chart's inferencePool.enabled)
    metrics_port: int = 8080
    health_port: int = 8081
    leader_election: bool = True
    lease_name: str = "splitserve-operator"
    lease_namespace: str = ""  # empty: the pod's namespace (POD_NAMESPACE)
    prometheus_url: str = ""  # empty: autoscaling reports MetricsHealthy=False
    prometheus_scrape_interval_seconds: float = defaults.SCRAPE_INTERVAL_SECONDS  # staleness is judged against 3x this
    metrics_window_seconds: float = defaults.SIGNAL_WINDOW_SECONDS  # PromQL smoothing window (avg_over_time)
    log_level: str = "info"


OPERATOR_FLAGS: tuple[Flag, ...] = (
    Flag("namespace", "namespace", "watch only these namespaces, comma-separated (empty: all namespaces)"),
    Flag("runtime-image", "runtime_image", "runtime image for InferenceServices that set none"),
    Flag("vllm-image", "vllm_image", "image of vLLM pools (runtime.engine vllm) that set none"),
    Flag("router-service-account", "router_service_account", "serviceAccountName of router pods (empty: default)"),
    Flag(
        "allowed-hub-endpoints",
        "allowed_hub_endpoints",
        "model hubs (scheme://host[:port][/path], comma-separated; no port: any port; '*': any hub) that "
        "spec.model.hubEndpoint may name; InferenceServices with another are Stalled/InvalidSpec",
    ),
    Flag(
        "inference-pool",
        "inference_pool",
        "reconcile spec.router.mode InferencePool (needs create on ServiceAccounts, Roles and RoleBindings); "
        "off: such InferenceServices are Stalled/InferencePoolDisabled",
        is_bool=True,
    ),
    Flag("metrics-port", "metrics_port", "port of /metrics", type=int),
    Flag("health-port", "health_port", "port of /healthz", type=int),
    Flag("leader-election", "leader_election", "elect one active replica with a Lease", is_bool=True),
    Flag("lease-name", "lease_name", "name of the leader election Lease"),
    Flag("lease-namespace", "lease_namespace", "namespace of the Lease (empty: the pod's namespace)"),
    Flag("prometheus-url", "prometheus_url", "Prometheus base URL for autoscaling metrics"),
    Flag(
        "prometheus-scrape-interval-seconds",
        "prometheus_scrape_interval_seconds",
        "scrape interval of the runtime pods (samples older than 3x are stale)",
        type=float,
    ),
    Flag(
        "metrics-window-seconds", "metrics_window_seconds", "smoothing window of the autoscaler's queries", type=float
    ),
    Flag("log-level", "log_level", "log verbosity", choices=("debug", "info", "warning", "error")),
)


def add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every operator flag, with its default, to ``parser``."""
    add_arguments(parser, OPERATOR_FLAGS, OperatorArgs())


def operator_args_from_namespace(ns: argparse.Namespace) -> OperatorArgs:
    return OperatorArgs(**{f.dest: getattr(ns, f.dest) for f in OPERATOR_FLAGS})


_NAMESPACE_NAME: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def watched_namespaces(args: OperatorArgs) -> tuple[str, ...]:
    """The namespaces of ``--namespace`` in order, each once; () means every namespace.

    Each must be a namespace name (a DNS label): kopf reads its namespaces as patterns (``*``
    globs, ``!`` exclusions), and the operator must watch exactly the namespaces its Roles are
    in, never a pattern that a namespace created later could match."""
    names = tuple(dict.fromkeys(n.strip() for n in args.namespace.split(",") if n.strip()))
    bad = [n for n in names if not _NAMESPACE_NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"--namespace: not namespace names: {', '.join(map(repr, bad))}")
    return names


def flag_names() -> frozenset[str]:
    """All accepted long options, including the ``--no-`` forms of booleans."""
    names = {f"--{f.name}" for f in OPERATOR_FLAGS}
    names |= {f"--no-{f.name}" for f in OPERATOR_FLAGS if f.is_bool}
    return frozenset(names)
