"""Names that cross a process boundary: ports, paths, labels, annotations, headers, env.

The operator renders them into objects and pod specs, the runtime and router listen on them,
Prometheus relabels them, the tests look for them. Each is defined here once; see
``docs/architecture.md`` ("Contracts") for who writes and who reads each one.
"""

from __future__ import annotations

import enum
from typing import Final

# --------------------------------------------------------------------------- ports
HTTP_PORT: Final = 8000
"""OpenAI API, /health, /ready, /metrics on every runtime and router pod."""
KV_TRANSFER_PORT: Final = 8100
"""Prefill -> decode KV block transfer (TCP connector)."""
HTTP_PORT_NAME: Final = "http"
KV_TRANSFER_PORT_NAME: Final = "kv"

# --------------------------------------------------------------------------- CRD identity
API_GROUP: Final = "splitserve.dev"
API_VERSION: Final = "v1alpha1"
KIND: Final = "InferenceService"
PLURAL: Final = "inferenceservices"

# --------------------------------------------------------------------------- labels
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_ROLE: Final = "splitserve.dev/role"
LABEL_COMPAT_HASH: Final = "splitserve.dev/compat-hash"

LABEL_NAME_VALUE: Final = "splitserve"
MANAGED_BY_VALUE: Final = "splitserve-operator"

ANNOTATION_CONFIG_HASH: Final = "splitserve.dev/config-hash"
ANNOTATION_PAUSED: Final = "splitserve.dev/paused"
ANNOTATION_POD_DELETION_COST: Final = "controller.kubernetes.io/pod-deletion-cost"

FIELD_MANAGER_RECONCILER: Final = "splitserve-operator"
FIELD_MANAGER_AUTOSCALER: Final = "splitserve-autoscaler"

LABEL_SCRAPE: Final = "splitserve.dev/scrape"
"""Pods carrying this label (value "true") are scraped on HTTP_PORT at METRICS_PATH; Prometheus
relabels pod labels into ``namespace``, ``pod`` and ``inferenceservice`` (from LABEL_INSTANCE)."""
METRICS_PATH: Final = "/metrics"

# --------------------------------------------------------------------------- runtime endpoints
INFO_PATH: Final = "/v1/splitserve/info"
"""GET: {role, model, compat_hash, kv_endpoint, block_size, max_model_len} of a runtime pod."""
KV_TRANSFER_PARAMS_FIELD: Final = "kv_transfer_params"
"""Extension field of completion/chat requests and responses that carries the P->D handoff:
request to prefill: :class:`.handoff.PrefillRequest`; prefill's response, and request to
decode: :class:`.handoff.HandoffParams` (its fields, JSON form, signed field set and signed
bytes are defined there, once), which makes decode pull the KV instead of computing it
(decode refuses unsigned, forged or expired params, and params computed for another prompt, with
403 KV_TRANSFER_PARAMS_REJECTED_CODE; the router never forwards a client's)."""
KV_TRANSFER_PARAMS_REJECTED_CODE: Final = "kv_transfer_params_rejected"
"""OpenAI error ``code`` of a decode pod's 403 for handoff parameters it must not act on
(unsigned, forged, expired, another pool's, another prompt's)."""
KV_TRANSFER_PARAMS_INVALID_CODE: Final = "invalid_kv_transfer_params"
"""OpenAI error ``code`` of a 400 for handoff parameters that are malformed or unusable here
(a missing field, a first token outside this pod's vocabulary, a handoff to the wrong role).
Either code, on parameters the router (or a decode pod's named prefill pod) supplied, makes it
compute the prompt on the decode pod instead of failing the client."""
HEADER_REQUEST_ID: Final = "x-request-id"

# --------------------------------------------------------------------------- environment
ENV_API_KEY: Final = "SPLITSERVE_API_KEY"
ENV_POD_NAME: Final = "POD_NAME"
ENV_POD_NAMESPACE: Final = "POD_NAMESPACE"
ENV_POD_IP: Final = "POD_IP"
ENV_MODEL_CACHE: Final = "SPLITSERVE_MODEL_CACHE"
"""Directory that `hf://org/name` URIs resolve in (HF hub cache layout or org/name dirs)."""
ENV_HUB_ENDPOINT: Final = "HF_ENDPOINT"
"""The model hub `hf://` models are downloaded from (default https://huggingface.co): the
operator sets it from `spec.model.hubEndpoint`, e.g. a private hub mirror."""
ENV_HUB_TOKEN: Final = "HF_TOKEN"
"""The model hub token; the operator fills it from the Secret `spec.model.hubTokenSecretRef`."""
ENV_HUB_TOKEN_SOURCE: Final = "SPLITSERVE_HUB_TOKEN_SOURCE"
"""Where HF_TOKEN came from, in words (`Secret hf-token, key HF_TOKEN`): the runtime names it
when the hub refuses the token, so the InferenceService's status says which Secret to fix."""
ENV_HUB_OFFLINE: Final = "HF_HUB_OFFLINE"
"""`1`: `hf://` models are only looked up in the model cache, never downloaded."""

HANDOFF_KEY_SECRET_SUFFIX: Final = "-kv-handoff"
"""The operator creates Secret `<InferenceService>-kv-handoff` (one random key per service,
created once, owned by it) and mounts it into the prefill and decode pods."""
HANDOFF_KEY_SECRET_KEY: Final = "key"
HANDOFF_KEY_MOUNT_DIR: Final = "/var/run/splitserve/handoff"
"""Mount directory of that Secret; the file is HANDOFF_KEY_MOUNT_DIR/HANDOFF_KEY_SECRET_KEY,
passed to the runtime as `--handoff-key-file`."""

TERMINATION_MESSAGE_PATH: Final = "/dev/termination-log"
"""Where a runtime pod writes why it could not start (the kubelet copies it into the
container status; the operator shows it in the InferenceService's conditions)."""


class Role(enum.StrEnum):
    """What a runtime process does; also the value of LABEL_ROLE / LABEL_COMPONENT."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


class RoutingPolicy(enum.StrEnum):
    """How the router picks a prefill (or aggregated) pod."""

    PREFIX_AFFINITY = "PrefixAffinity"
    LEAST_LOAD = "LeastLoad"
    ROUND_ROBIN = "RoundRobin"
