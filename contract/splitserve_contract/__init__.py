"""The contract between the operator, the runtime, the router, the planner and the tests.

Everything that crosses a process or package boundary is defined here exactly once: CRD
identity, labels, ports, paths, environment variables (:mod:`.wire`), metric names
(:mod:`.metrics`), the ``serve``/``router`` flag tables (:mod:`.flags`), condition types and
reasons (:mod:`.reasons`), shared defaults (:mod:`.defaults`), what this version supports
(:mod:`.capabilities`), the KV block hash (:mod:`.block_hash`) and the prefill → decode
handoff's wire objects (:mod:`.handoff`).

This package imports nothing but the standard library: the operator image (no torch), the
router and the runtime all depend on it, and it depends on none of them. import-linter
enforces that (``.importlinter``; ``docs/architecture.md``, "Layers").
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

from . import block_hash, capabilities, defaults, handoff
from .flags import (
    ROUTER_FLAGS,
    SERVE_FLAGS,
    Flag,
    RouterArgs,
    ServeArgs,
    add_arguments,
    add_router_arguments,
    add_serve_arguments,
    router_args_from_namespace,
    router_argv,
    serve_args_from_namespace,
    serve_argv,
    unsupported_serve_settings,
)
from .metrics import OUTCOMES, Metric, ModelServerMetric, OperatorMetric
from .reasons import ConditionType, Reason
from .wire import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_PAUSED,
    ANNOTATION_POD_DELETION_COST,
    API_GROUP,
    API_VERSION,
    ENV_API_KEY,
    ENV_HUB_ENDPOINT,
    ENV_HUB_OFFLINE,
    ENV_HUB_TOKEN,
    ENV_HUB_TOKEN_SOURCE,
    ENV_MODEL_CACHE,
    ENV_POD_IP,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    FIELD_MANAGER_AUTOSCALER,
    FIELD_MANAGER_RECONCILER,
    HANDOFF_KEY_MOUNT_DIR,
    HANDOFF_KEY_SECRET_KEY,
    HANDOFF_KEY_SECRET_SUFFIX,
    HEADER_REQUEST_ID,
    HTTP_PORT,
    HTTP_PORT_NAME,
    INFO_PATH,
    KIND,
    KV_TRANSFER_PARAMS_FIELD,
    KV_TRANSFER_PORT,
    KV_TRANSFER_PORT_NAME,
    LABEL_COMPAT_HASH,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_NAME_VALUE,
    LABEL_ROLE,
    LABEL_SCRAPE,
    MANAGED_BY_VALUE,
    METRICS_PATH,
    PLURAL,
    TERMINATION_MESSAGE_PATH,
    Role,
    RoutingPolicy,
)

try:
    __version__ = _distribution_version("splitserve")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "ANNOTATION_CONFIG_HASH",
    "ANNOTATION_PAUSED",
    "ANNOTATION_POD_DELETION_COST",
    "API_GROUP",
    "API_VERSION",
    "ENV_API_KEY",
    "ENV_HUB_ENDPOINT",
    "ENV_HUB_OFFLINE",
    "ENV_HUB_TOKEN",
    "ENV_HUB_TOKEN_SOURCE",
    "ENV_MODEL_CACHE",
    "ENV_POD_IP",
    "ENV_POD_NAME",
    "ENV_POD_NAMESPACE",
    "FIELD_MANAGER_AUTOSCALER",
    "FIELD_MANAGER_RECONCILER",
    "HANDOFF_KEY_MOUNT_DIR",
    "HANDOFF_KEY_SECRET_KEY",
    "HANDOFF_KEY_SECRET_SUFFIX",
    "HEADER_REQUEST_ID",
    "HTTP_PORT",
    "HTTP_PORT_NAME",
    "INFO_PATH",
    "KIND",
    "KV_TRANSFER_PARAMS_FIELD",
    "KV_TRANSFER_PORT",
    "KV_TRANSFER_PORT_NAME",
    "LABEL_COMPAT_HASH",
    "LABEL_COMPONENT",
    "LABEL_INSTANCE",
    "LABEL_MANAGED_BY",
    "LABEL_NAME",
    "LABEL_NAME_VALUE",
    "LABEL_ROLE",
    "LABEL_SCRAPE",
    "MANAGED_BY_VALUE",
    "METRICS_PATH",
    "OUTCOMES",
    "PLURAL",
    "ROUTER_FLAGS",
    "SERVE_FLAGS",
    "TERMINATION_MESSAGE_PATH",
    "ConditionType",
    "Flag",
    "Metric",
    "ModelServerMetric",
    "OperatorMetric",
    "Reason",
    "Role",
    "RouterArgs",
    "RoutingPolicy",
    "ServeArgs",
    "add_arguments",
    "add_router_arguments",
    "add_serve_arguments",
    "block_hash",
    "capabilities",
    "defaults",
    "handoff",
    "router_args_from_namespace",
    "router_argv",
    "serve_args_from_namespace",
    "serve_argv",
    "unsupported_serve_settings",
]
