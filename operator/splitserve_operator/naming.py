"""Names, labels and the compatibility hash of an InferenceService's children.

Every name and label the operator puts on a child object is derived here, from the
InferenceService name and the component, with no I/O and no Kubernetes client: the
reconciler, the autoscaler, the router's discovery and the tests all agree because they
all call these functions. Label keys and values come from :mod:`splitserve_contract`.

Length budget: the CRD rejects InferenceService names longer than :data:`MAX_NAME_LENGTH`
(40). The longest suffix is ``-prefill`` (8), so every child name stays <= 48 characters,
a valid DNS-1035 label (Service names) and a valid label value (<= 63), with room left for
the ReplicaSet hash that Deployments append to pod names.
"""

from __future__ import annotations

import hashlib
import json
from typing import Final

from splitserve_contract import (
    HANDOFF_KEY_SECRET_SUFFIX,
    LABEL_COMPAT_HASH,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_NAME_VALUE,
    LABEL_ROLE,
    LABEL_SCRAPE,
    MANAGED_BY_VALUE,
    Role,
)

MAX_NAME_LENGTH: Final = 40
"""Longest InferenceService name the CRD accepts (see the module docstring)."""

NAME_PATTERN: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""InferenceService names must be DNS-1035 labels: children include Services."""

COMPAT_HASH_LENGTH: Final = 10

_SUFFIX: Final[dict[Role, str]] = {
    Role.PREFILL: "prefill",
    Role.DECODE: "decode",
    Role.ROUTER: "router",
    Role.AGGREGATED: "engine",
}


def child_name(isvc_name: str, component: Role | str) -> str:
    """Name of the Deployment, Service and PodDisruptionBudget of one component:
    ``<isvc>-prefill``, ``<isvc>-decode``, ``<isvc>-router`` or ``<isvc>-engine``
    (aggregated)."""
    return f"{isvc_name}-{_SUFFIX[Role(component)]}"


def config_map_name(isvc_name: str) -> str:
    """The one ConfigMap of an InferenceService (rendered runtime configuration)."""
    return f"{isvc_name}-config"


def slo_state_config_map_name(isvc_name: str) -> str:
    """The ConfigMap keeping the SLO autoscaler's learned state (``<isvc>-slo-state``,
    :mod:`.autoscaler.slo.store`): machine state, apart from the runtime's configuration."""
    return f"{isvc_name}-slo-state"


def handoff_key_secret_name(isvc_name: str) -> str:
    """The Secret holding the InferenceService's KV handoff key (``<isvc>-kv-handoff``)."""
    return f"{isvc_name}{HANDOFF_KEY_SECRET_SUFFIX}"


def network_policy_name(isvc_name: str) -> str:
    """The default-deny NetworkPolicy covering all pods of an InferenceService."""
    return f"{isvc_name}-netpol"


def selector_labels(isvc_name: str, component: Role | str) -> dict[str, str]:
    """Labels a Deployment selects its pods by. Stable for the object's lifetime
    (Deployment selectors are immutable), so the compat hash is not among them."""
    role = Role(component).value
    return {
        LABEL_NAME: LABEL_NAME_VALUE,
        LABEL_INSTANCE: isvc_name,
        LABEL_COMPONENT: role,
    }


def instance_selector_labels(isvc_name: str) -> dict[str, str]:
    """Labels shared by every pod of an InferenceService (NetworkPolicy pod selector)."""
    return {LABEL_NAME: LABEL_NAME_VALUE, LABEL_INSTANCE: isvc_name}


def labels(isvc_name: str, component: Role | str, *, compat_hash: str | None = None) -> dict[str, str]:
    """Full label set for a child object and its pods. Runtime pods (not the router)
    also carry the compat hash and the Prometheus scrape label; the router is scraped too."""
    role = Role(component).value
    out = selector_labels(isvc_name, component)
    out[LABEL_MANAGED_BY] = MANAGED_BY_VALUE
    out[LABEL_ROLE] = role
    out[LABEL_SCRAPE] = "true"
    if compat_hash is not None and Role(component) is not Role.ROUTER:
        out[LABEL_COMPAT_HASH] = compat_hash
    return out


def compat_hash(
    *,
    image: str,
    model_uri: str,
    revision: str | None,
    dtype: str,
    quantization: str,
    block_size: int,
    kv_cache_dtype: str = "auto",
) -> str:
    """Short hash of everything that must match for a prefill pod's KV blocks to be
    usable by a decode pod: runtime image, model and revision, dtype, quantization,
    KV block size and KV cache dtype. The router pairs only pods with equal hashes, so a
    rolling update never sends KV between incompatible pods. Not the parallel layout:
    blocks travel in the whole-model layout, so a TP 2 prefill pool feeds a TP 1 decode pool
    (the payload keeps its old ``tensorParallel: 1`` entry, so hashes from before stay valid).
    ``kv_cache_dtype`` enters the hash only when it is not ``auto`` (auto is the activation
    dtype, already covered), for the same reason."""
    payload = {
        "image": image,
        "modelUri": model_uri,
        "revision": revision or "",
        "dtype": dtype,
        "quantization": quantization,
        "blockSize": block_size,
        "tensorParallel": 1,
    }
    if kv_cache_dtype != "auto":
        payload["kvCacheDtype"] = kv_cache_dtype
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return digest[:COMPAT_HASH_LENGTH]
