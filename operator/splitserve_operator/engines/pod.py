"""What the runtime pods of every engine have in common, and the one interface each engine's
module implements.

Why: a pool's pod is the same Kubernetes object whichever engine runs in it (the restricted
security context, the model cache and claim volumes, the downward-API identity, the hub and
Secret wiring, the probes' shape); only the command line, a few variables and volumes, and the
paths the probes call differ. :class:`EngineRenderer` is that difference, and :mod:`.splitserve`
and :mod:`.vllm` are its two implementations, so the renderer of the pod (:mod:`..render`)
never asks which engine it is rendering.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, Protocol

import splitserve_contract as contract
from splitserve_contract import Role
from splitserve_contract.engines import ENGINE_PODS, Engine

from .. import naming
from ..api import InferenceService, PoolSpec

MODEL_CACHE_DIR: Final = "/var/cache/splitserve/models"
TRITON_CACHE_DIR: Final = "/var/cache/splitserve/triton"
PVC_MOUNT_ROOT: Final = "/mnt/models"
SHM_SIZE: Final = "2Gi"
TERMINATION_GRACE_MARGIN_SECONDS: Final = 15
STARTUP_PROBE_BUDGET_SECONDS: Final = 1800


@dataclasses.dataclass(frozen=True)
class PoolContainer:
    """The engine-specific part of one pool's runtime container and pod."""

    command: list[str] | None
    """The container's command; None: the image's entrypoint runs ``args``."""
    args: list[str]
    env: list[dict[str, Any]]
    ports: list[dict[str, Any]]
    """Ports beyond the HTTP port every engine serves on."""
    volumes: list[dict[str, Any]]
    """Volumes beyond /tmp, the model cache and the model's claim."""
    mounts: list[dict[str, Any]]
    grace_seconds: int
    """terminationGracePeriodSeconds: the engine's drain plus a margin."""
    config: dict[str, Any]
    """What the pool runs, for the InferenceService's ConfigMap (``engine.json``)."""
    lifecycle: dict[str, Any] | None = None
    """The container's lifecycle hooks (vLLM's preStop wait); None: none."""


class EngineRenderer(Protocol):
    """How pods of one engine run (one module per engine implements it)."""

    @property
    def engine(self) -> Engine:
        """The engine whose pods this renders."""
        ...

    def kv_ports(self, pool: PoolSpec) -> list[dict[str, Any]]:
        """The ports (NetworkPolicy port entries) on which a pod of a prefill or decode
        ``pool`` hands KV over to the other pool's pods."""
        ...

    def container(self, *, isvc: InferenceService, role: Role, pool: PoolSpec, compat_hash: str) -> PoolContainer:
        """The pool's container: command line, variables, ports, volumes, grace period."""
        ...


def served_name(isvc: InferenceService) -> str:
    return isvc.spec.model.served_name or isvc.metadata.name


def model_location(
    uri: str,
    *,
    volume_name: str = "model-pvc",
) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """The model's location as the runtime reads it (``pvc://claim/path`` becomes
    ``file://<mount>/path``) plus, for a claim, the read-only volume and its mount."""
    if not uri.startswith("pvc://"):
        return uri, None, None
    claim, _, sub_path = uri.removeprefix("pvc://").partition("/")
    mount = f"{PVC_MOUNT_ROOT}/{claim}"
    volume = {"name": volume_name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    volume_mount = {"name": volume_name, "mountPath": mount, "readOnly": True}
    return f"file://{mount}/{sub_path}".rstrip("/"), volume, volume_mount


def draft_model_location(isvc: InferenceService) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """The draft model's location plus its volume and mount: none when the draft is not on a
    claim, or on the claim that holds the model (mounted already, at the same path)."""
    draft_model = isvc.spec.scheduling_settings.speculative.draft_model or ""
    path, volume, mount = model_location(draft_model, volume_name="draft-model-pvc")
    _, _, model_mount = model_location(isvc.spec.model.uri)
    if mount is not None and model_mount is not None and mount["mountPath"] == model_mount["mountPath"]:
        return path, None, None
    return path, volume, mount


def speculates(isvc: InferenceService, role: Role) -> bool:
    """Whether pods of ``role`` get the speculative decoding settings (and a draft model's
    volume): only pools that decode, and only when a method is set (so pods of a spec without
    speculation render as before). A prefill pod only computes prompts, and speculation leaves
    the model's KV layout alone (a draft keeps its own cache on the decode pod), so it is not in
    the compat hash: prefill and decode pods pair whatever the setting."""
    return isvc.spec.scheduling_settings.speculative.enabled and role in (Role.DECODE, Role.AGGREGATED)


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def env(*, isvc: InferenceService, engine_env: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Container env: pod identity from fieldRefs, the model cache and hub (every container
    resolves the model: the router loads its tokenizer), secrets by reference (never read
    here), then the engine's own variables, then runtime.env. A user variable replaces ours of
    the same name (SSA keys env by name, so duplicates would be rejected)."""
    out: dict[str, dict[str, Any]] = {}
    for var, path in (
        (contract.ENV_POD_NAME, "metadata.name"),
        (contract.ENV_POD_NAMESPACE, "metadata.namespace"),
        (contract.ENV_POD_IP, "status.podIP"),
    ):
        out[var] = field_env(var, path)
    out[contract.ENV_MODEL_CACHE] = {"name": contract.ENV_MODEL_CACHE, "value": MODEL_CACHE_DIR}
    model = isvc.spec.model
    if model.hub_endpoint:
        out[contract.ENV_HUB_ENDPOINT] = {"name": contract.ENV_HUB_ENDPOINT, "value": model.hub_endpoint}
    hub = model.hub_token_secret_ref
    if hub is not None:
        out[contract.ENV_HUB_TOKEN] = secret_env(contract.ENV_HUB_TOKEN, hub.name, hub.key)
        # Named by the runtime when the hub refuses the token, so the status says what to fix.
        out[contract.ENV_HUB_TOKEN_SOURCE] = {
            "name": contract.ENV_HUB_TOKEN_SOURCE,
            "value": f"Secret {hub.name}, key {hub.key}",
        }
    api_key = isvc.spec.runtime.api_key_secret_ref
    if api_key is not None:
        out[contract.ENV_API_KEY] = secret_env(contract.ENV_API_KEY, api_key.name, api_key.key)
    for engine_var in engine_env or []:
        out[engine_var["name"]] = engine_var
    for user_var in isvc.spec.runtime.env:
        if user_var.name in (contract.ENV_POD_IP, contract.ENV_POD_NAME, contract.ENV_POD_NAMESPACE):
            continue  # the pod's identity is not the user's to override
        out[user_var.name] = {"name": user_var.name, "value": user_var.value}
    return list(out.values())


def _http_get(path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": contract.HTTP_PORT_NAME}}


def probes(*, engine: Engine, startup_budget_seconds: int) -> dict[str, Any]:
    """Startup and liveness on the engine's "alive" path, readiness on its "takes traffic" path."""
    paths = ENGINE_PODS[engine]
    period = 10
    return {
        "startupProbe": {
            **_http_get(paths.health_path),
            "periodSeconds": period,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, startup_budget_seconds // period),
        },
        "readinessProbe": {
            **_http_get(paths.ready_path),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
            "successThreshold": 1,
        },
        "livenessProbe": {
            **_http_get(paths.health_path),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def compat_hash(*, isvc: InferenceService, image: str) -> str:
    """What prefill and decode pods must share to pair (:func:`..naming.compat_hash`)."""
    spec = isvc.spec
    return naming.compat_hash(
        image=image,
        model_uri=spec.model.uri,
        revision=spec.model.revision,
        dtype=spec.model.dtype,
        quantization=spec.model.quantization,
        block_size=spec.kv_cache.block_size,
        kv_cache_dtype=spec.kv_cache.dtype,
    )


def extra_args(isvc: InferenceService, pool: PoolSpec) -> list[str]:
    """runtime.extraArgs, then the pool's own: appended after the rendered arguments."""
    return [*isvc.spec.runtime.extra_args, *pool.extra_args]


def shared_memory_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
        {"name": "dshm", "mountPath": "/dev/shm"},
    )


def triton_cache_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    return {"name": "triton-cache", "emptyDir": {}}, {"name": "triton-cache", "mountPath": TRITON_CACHE_DIR}
