"""What puts an InferenceService behind a Gateway (``spec.router.mode: InferencePool``): the
names, labels, arguments and permissions of the Gateway API Inference Extension's objects.

In this mode the Gateway is the front door and the builtin router is not in the path (it is not
rendered at all): Gateway -> HTTPRoute -> InferencePool -> the endpoint picker (EPP) chooses one
of the pool's pods per request -> the Gateway sends the request there. So the operator renders

* an ``InferencePool`` (``inference.networking.k8s.io/v1``) named like the InferenceService,
  selecting the pods that answer clients (:func:`served_role`: the aggregated pool, or the
  decode pool when Disaggregated; a P/D-aware picker names the prefill pod in a request header
  and the decode pod drives the prefill itself, see ``splitserve_runtime.server.prefiller``),
  on the runtime's HTTP port, with its ``endpointPickerRef`` at the picker's Service;
* the picker: a ServiceAccount, a Role and RoleBinding with just what the EPP reads
  (:func:`picker_rules`), a one-replica Deployment of the upstream EPP image with the flags
  that point it at our model-server metrics (:func:`picker_args`), and a Service.

Only the pieces live here; :mod:`.render` turns them into objects with its templates, so the
two modes share one rendering path (and one hash of each pod template). The flags are those of
EPP v1.2.0 (``cmd/epp/runner/runner.go``): another picker image must take the same ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import splitserve_contract as contract
from splitserve_contract import ModelServerMetric, Role

from . import naming
from .api import InferenceService, InferenceServiceSpec, Mode
from .api.spec import RouterMode

API_GROUP: Final = "inference.networking.k8s.io"
API_VERSION: Final = f"{API_GROUP}/v1"
CRD_NAME: Final = f"inferencepools.{API_GROUP}"
OBJECTIVES_API_GROUP: Final = "inference.networking.x-k8s.io"
"""The group of InferenceObjective, which the EPP watches next to its pool."""
CRDS_MANIFEST_URL: Final = (
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/v1.2.0/manifests.yaml"
)
"""The Inference Extension's CRDs (InferencePool, InferenceObjective), the version we render for."""

CHART_VALUE: Final = "inferencePool.enabled"
"""The chart value that turns this mode on (off by default). With it the operator may create
ServiceAccounts, Roles and RoleBindings in the watched namespaces, and so hand any permission it
holds to any subject (RBAC checks a binding's Role against the binder's own permissions, not who
it binds): a grant an installer makes on purpose. Without it, an InferenceService in this mode is
``Stalled``/``InferencePoolDisabled`` (:func:`disabled_message`) and nothing is applied for it."""
OPERATOR_FLAG: Final = "--inference-pool"
"""The operator flag the chart renders from :data:`CHART_VALUE`."""

PICKER_IMAGE: Final = "registry.k8s.io/gateway-api-inference-extension/epp:v1.2.0"
PICKER_COMPONENT: Final = "endpoint-picker"
"""``app.kubernetes.io/component`` of the picker's objects and pods (no ``splitserve.dev/role``:
it is not a runtime pool, and nothing pairs or scales it)."""
PICKER_SUFFIX: Final = "-epp"
PICKER_REPLICAS: Final = 1
"""Upstream's recommended pattern is one active picker (its prefix-cache index is in memory);
more would need leader election and Lease permissions."""
PICKER_GRACE_SECONDS: Final = 130
"""Upstream's: about the longest a request through the picker takes to finish."""
GRPC_PORT: Final = 9002
"""ext-proc, the port the Gateway calls (the InferencePool's endpointPickerRef port)."""
GRPC_HEALTH_PORT: Final = 9003
METRICS_PORT: Final = 9090
GRPC_HEALTH_SERVICE: Final = "inference-extension"
"""The gRPC health service a single (not leader-elected) EPP reports on."""

PICKER_CONFIG: Final = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""
"""The upstream chart's default plugins (queue depth, KV usage, prefix affinity): the EPP has no
built-in default and exits without one."""


def enabled(spec: InferenceServiceSpec) -> bool:
    return spec.router.mode is RouterMode.INFERENCE_POOL


def served_role(spec: InferenceServiceSpec) -> Role:
    """The pool whose pods the InferencePool selects: the pods that answer clients."""
    return Role.AGGREGATED if spec.mode is Mode.AGGREGATED else Role.DECODE


def pool_name(isvc_name: str) -> str:
    """The InferencePool: the InferenceService's own name (what an HTTPRoute's backendRef names)."""
    return isvc_name


def picker_name(isvc_name: str) -> str:
    """The picker's Deployment, Service, ServiceAccount, Role and RoleBinding: ``<isvc>-epp``."""
    return f"{isvc_name}{PICKER_SUFFIX}"


def picker_selector_labels(isvc_name: str) -> dict[str, str]:
    return {**naming.instance_selector_labels(isvc_name), contract.LABEL_COMPONENT: PICKER_COMPONENT}


def picker_labels(isvc_name: str) -> dict[str, str]:
    return {**picker_selector_labels(isvc_name), contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE}


def is_picker(obj: Mapping[str, Any]) -> bool:
    """Whether ``obj`` (a child or a pod) belongs to an endpoint picker."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(contract.LABEL_COMPONENT) == PICKER_COMPONENT)


def picker_image(isvc: InferenceService) -> str:
    return isvc.spec.router.inference_pool_settings.picker.image or PICKER_IMAGE


def picker_args(isvc: InferenceService) -> list[str]:
    """The EPP's command line: its pool, its ports, our model-server metric names.

    * ``--kv-cache-usage-percentage-metric``: the EPP's default is vLLM's older
      ``vllm:gpu_cache_usage_perc``; the runtime exports the current name.
    * ``--lora-info-metric ""``: no LoRA adapters, nothing to scrape.
    * ``--metrics-endpoint-auth=false``: with it the EPP would need a ClusterRole to review
      tokens; the metrics port is open to monitoring namespaces only (NetworkPolicy).
    * ``--tracing=false``: no OpenTelemetry collector is assumed.
    * ext-proc keeps its default TLS (a self-signed certificate), which Gateways expect."""
    meta = isvc.metadata
    return [
        "--pool-name",
        pool_name(meta.name),
        "--pool-namespace",
        meta.namespace or "",
        "--grpc-port",
        str(GRPC_PORT),
        "--grpc-health-port",
        str(GRPC_HEALTH_PORT),
        "--metrics-port",
        str(METRICS_PORT),
        "--total-queued-requests-metric",
        ModelServerMetric.NUM_REQUESTS_WAITING,
        "--kv-cache-usage-percentage-metric",
        ModelServerMetric.KV_CACHE_USAGE_PERC,
        "--cache-info-metric",
        ModelServerMetric.CACHE_CONFIG_INFO,
        "--lora-info-metric",
        "",
        "--metrics-endpoint-auth=false",
        "--tracing=false",
        "--zap-encoder",
        "json",
        "--config-text",
        PICKER_CONFIG,
    ]


def picker_rules(isvc_name: str) -> list[dict[str, Any]]:
    """What the EPP reads, in its own namespace, and nothing else: its InferencePool (by name:
    it lists and watches it with a ``metadata.name`` field selector, which RBAC matches against
    ``resourceNames``), the InferenceObjectives, and the pods it picks from. The operator holds
    these permissions itself, which is what lets it grant them (no ``escalate`` or ``bind``)."""
    read = ["get", "list", "watch"]
    return [
        {
            "apiGroups": [API_GROUP],
            "resources": ["inferencepools"],
            "resourceNames": [pool_name(isvc_name)],
            "verbs": read,
        },
        {"apiGroups": [OBJECTIVES_API_GROUP], "resources": ["inferenceobjectives"], "verbs": read},
        {"apiGroups": [""], "resources": ["pods"], "verbs": read},
    ]


def disabled_message(isvc_name: str) -> str:
    """The Stalled condition's message when this operator runs without InferencePool mode
    (:data:`CHART_VALUE` off, the default): it may not create the picker's ServiceAccount, Role
    and RoleBinding, so nothing is rendered for the InferenceService."""
    return (
        f"spec.router.mode is InferencePool but this operator was installed without InferencePool "
        f"mode, so it may not create the endpoint picker's ServiceAccount, Role and RoleBinding "
        f"({picker_name(isvc_name)}) and applies nothing for this InferenceService: reinstall the "
        f"splitserve chart with --set {CHART_VALUE}=true (operator flag {OPERATOR_FLAG}), which grants "
        "the operator create on ServiceAccounts, Roles and RoleBindings in the watched namespaces, "
        "or use spec.router.mode Builtin in a new InferenceService"
    )


def crd_missing_message(isvc_name: str) -> str:
    """The Stalled condition's message when the cluster has no InferencePool CRD."""
    return (
        f"spec.router.mode is InferencePool but the cluster has no InferencePool CRD ({CRD_NAME}, "
        f"{API_VERSION}), so InferencePool {pool_name(isvc_name)} cannot be created: install the "
        f"Gateway API Inference Extension CRDs (kubectl apply -f {CRDS_MANIFEST_URL}); the "
        "operator retries at least once a minute"
    )
