"""Render the desired children of an InferenceService: a pure function of the spec.

:func:`render_children` turns one parsed :class:`~splitserve_operator.api.InferenceService`
into the list of objects the reconciler server-side-applies: the ConfigMap, one Deployment +
Service + PodDisruptionBudget per component (prefill, decode, router; or engine + router in
Aggregated mode) and the NetworkPolicies. A pool whose replicas span several nodes
(``resources.gpusPerNode`` smaller than ``resources.gpus``) is a LeaderWorkerSet instead of a
Deployment, its Service selecting the group leaders (:mod:`.leader_worker_set`). With ``spec.router.mode: InferencePool`` there is no
router: an InferencePool and its endpoint picker (ServiceAccount, Role, RoleBinding, Deployment,
Service; :mod:`.inference_pool`) put the pods behind a Gateway instead. The KV handoff key Secret that prefill and decode
pods mount is not rendered here: it is created once, never applied (:mod:`.handoff_key`). No I/O, no clock, no randomness: the same spec and
operator flags give byte-identical output, which is what makes two properties hold:

* the pod-template annotation :data:`~splitserve_contract.ANNOTATION_CONFIG_HASH` is a
  hash of the rendered pod template itself, so any change that matters to pods rolls them, and
  an operator upgrade that renders the same pods does not;
* ``spec.replicas`` is rendered only when the caller asks (``include_replicas=True``, on
  create): replica counts belong to the autoscaler's field manager afterwards.

The YAML shape of each kind lives in ``templates/<kind>.yaml.j2``; every value is inserted with
``tojson`` (JSON is YAML), so user strings can never change the structure. The owner reference
is added by :mod:`splitserve_operator.apply`, not here: rendering needs no UID.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import jinja2
import yaml

import splitserve_contract as contract
from splitserve_contract import Role

from . import handoff_key, inference_pool, leader_worker_set, naming
from .api import InferenceService, InferenceServiceSpec, Mode, PoolSpec

TEMPLATE_DIR: Final = Path(__file__).parent / "templates"

MONITORING_NAMESPACE_LABEL: Final = "splitserve.dev/monitoring"
"""Namespaces labelled ``splitserve.dev/monitoring=true`` may scrape pods on the HTTP port."""

MODEL_CACHE_DIR: Final = "/var/cache/splitserve/models"
TRITON_CACHE_DIR: Final = "/var/cache/splitserve/triton"
"""``TRITON_CACHE_DIR`` of the image: compiled kernels; an emptyDir (the root is read-only)."""
PVC_MOUNT_ROOT: Final = "/mnt/models"
SHM_SIZE: Final = "2Gi"
RUN_AS_USER: Final = 65532
GPU_RESOURCE: Final = "nvidia.com/gpu"
TERMINATION_GRACE_MARGIN_SECONDS: Final = 15
ROUTER_DRAIN_SECONDS: Final = 30
STARTUP_PROBE_BUDGET_SECONDS: Final = 1800
"""Model download + load may take this long before liveness starts counting."""

_JINJA = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
    undefined=jinja2.StrictUndefined,
    autoescape=False,
    keep_trailing_newline=True,
    auto_reload=False,  # templates ship with the package: no stat() per render
)
_YAML_LOADER: Final = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML was built with it (about 5x faster per manifest), else the pure one."""


@dataclasses.dataclass(frozen=True)
class Component:
    """One Deployment-backed component of an InferenceService."""

    role: Role
    pool: PoolSpec | None  # None for the router

    @property
    def is_router(self) -> bool:
        return self.role is Role.ROUTER


def components(spec: InferenceServiceSpec) -> list[Component]:
    """Components in apply order: runtime pools first, then the router (none in router mode
    InferencePool: the Gateway and the endpoint picker route)."""
    if spec.mode is Mode.AGGREGATED:
        assert spec.aggregated is not None  # guaranteed by the API validators
        out = [Component(Role.AGGREGATED, spec.aggregated)]
    else:
        assert spec.prefill is not None and spec.decode is not None
        out = [Component(Role.PREFILL, spec.prefill), Component(Role.DECODE, spec.decode)]
    if inference_pool.enabled(spec):
        return out
    return [*out, Component(Role.ROUTER, None)]


def image_of(*, isvc: InferenceService, runtime_image: str) -> str:
    return isvc.spec.runtime.image or runtime_image


def compat_hash_of(*, isvc: InferenceService, runtime_image: str) -> str:
    spec = isvc.spec
    return naming.compat_hash(
        image=image_of(isvc=isvc, runtime_image=runtime_image),
        model_uri=spec.model.uri,
        revision=spec.model.revision,
        dtype=spec.model.dtype,
        quantization=spec.model.quantization,
        block_size=spec.kv_cache.block_size,
        kv_cache_dtype=spec.kv_cache.dtype,
    )


def served_name(isvc: InferenceService) -> str:
    return isvc.spec.model.served_name or isvc.metadata.name


def _model_location(
    uri: str,
    *,
    volume_name: str = "model-pvc",
) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """The --model value plus, for pvc://claim/path, the read-only volume and its mount."""
    if not uri.startswith("pvc://"):
        return uri, None, None
    claim, _, sub_path = uri.removeprefix("pvc://").partition("/")
    mount = f"{PVC_MOUNT_ROOT}/{claim}"
    volume = {"name": volume_name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    volume_mount = {"name": volume_name, "mountPath": mount, "readOnly": True}
    return f"file://{mount}/{sub_path}".rstrip("/"), volume, volume_mount


def _draft_model_location(isvc: InferenceService) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """--speculative-draft-model plus its volume and mount: none when the draft is not on a
    claim, or on the claim that holds the model (mounted already, at the same path)."""
    draft_model = isvc.spec.engine.speculative.draft_model or ""
    path, volume, mount = _model_location(draft_model, volume_name="draft-model-pvc")
    _, _, model_mount = _model_location(isvc.spec.model.uri)
    if mount is not None and model_mount is not None and mount["mountPath"] == model_mount["mountPath"]:
        return path, None, None
    return path, volume, mount


def serve_args(
    *,
    isvc: InferenceService,
    role: Role,
    pool: PoolSpec,
    runtime_image: str,
) -> contract.ServeArgs:
    """The `splitserve serve` arguments of one pool (before runtime.extraArgs). The compat hash
    goes on the command line too: pods report it and the router pairs only equal hashes.
    Prefill and decode get the KV handoff key file (:mod:`.handoff_key`); decode and
    aggregated pods the speculative decoding settings (:func:`speculates`)."""
    spec = isvc.spec
    model, _, _ = _model_location(spec.model.uri)
    return contract.ServeArgs(
        model=model,
        served_model_name=served_name(isvc),
        revision=spec.model.revision or "",
        role=role.value,
        host=f"$({contract.ENV_POD_IP})",
        port=contract.HTTP_PORT,
        kv_port=contract.KV_TRANSFER_PORT,
        device="cuda" if pool.resources.gpus > 0 else "cpu",
        dtype=spec.model.dtype,
        quantization=spec.model.quantization,
        max_model_len=spec.model.max_model_len or 0,
        block_size=spec.kv_cache.block_size,
        kv_memory_fraction=spec.kv_cache.memory_fraction,
        prefix_caching=spec.kv_cache.prefix_caching,
        kv_cache_dtype=spec.kv_cache.dtype,
        max_num_seqs=spec.engine.max_num_seqs,
        max_num_batched_tokens=spec.engine.max_batched_tokens,
        chunked_prefill=spec.engine.chunked_prefill,
        tensor_parallel_size=pool.parallelism.tensor,
        pipeline_parallel_size=pool.parallelism.pipeline,
        compat_hash=compat_hash_of(isvc=isvc, runtime_image=runtime_image),
        handoff_key_file=handoff_key.KEY_FILE if uses_handoff_key(role) else "",
        prefill_headers=role is Role.DECODE and inference_pool.enabled(spec),
        **_speculative_args(isvc=isvc, role=role),
        **_multi_node_args(pool),
    )


def _multi_node_args(pool: PoolSpec) -> dict[str, Any]:
    """``--nnodes`` for a replica of several pods. Each pod's node rank and its group's leader
    come from the env the LWS pod webhook injects (``LWS_WORKER_INDEX``,
    ``LWS_LEADER_ADDRESS``), which the runtime reads when the flags are left out: one pod
    template serves the leader and every worker."""
    return (
        {"nnodes": pool.resources.pods_per_replica, "rendezvous_key_file": leader_worker_set.RENDEZVOUS_KEY_FILE}
        if pool.resources.multi_node
        else {}
    )


def speculates(isvc: InferenceService, role: Role) -> bool:
    """Whether pods of ``role`` get the speculative decoding flags (and a draft model's volume):
    only pools that decode, and only when a method is set (so pods of a spec without
    speculation render as before). A prefill pod only computes prompts, and speculation leaves
    the model's KV layout alone (a draft keeps its own cache on the decode pod), so it is not in
    the compat hash: prefill and decode pods pair whatever the setting."""
    return isvc.spec.engine.speculative.enabled and role in (Role.DECODE, Role.AGGREGATED)


def _speculative_args(*, isvc: InferenceService, role: Role) -> dict[str, Any]:
    if not speculates(isvc, role):
        return {}
    speculative = isvc.spec.engine.speculative
    args: dict[str, Any] = {
        "speculative_method": speculative.method,
        "num_speculative_tokens": speculative.num_tokens,
        "speculative_max_num_seqs": speculative.max_num_seqs,
    }
    if speculative.draft_model:
        args["speculative_draft_model"], _, _ = _draft_model_location(isvc)
    return args


def uses_handoff_key(role: Role) -> bool:
    """Prefill signs the KV handoff and decode verifies it; nobody else holds the key."""
    return role in (Role.PREFILL, Role.DECODE)


def router_args(*, isvc: InferenceService) -> contract.RouterArgs:
    spec = isvc.spec
    model, _, _ = _model_location(spec.model.uri)
    if model.startswith("hf://") and spec.model.revision:
        # The router has no --revision: it reads the pinned revision's tokenizer from the URI.
        model = f"{model}@{spec.model.revision}"
    return contract.RouterArgs(
        host=f"$({contract.ENV_POD_IP})",
        port=contract.HTTP_PORT,
        policy=spec.router.policy.value,
        session_header=spec.router.session_header,
        discovery="kubernetes",
        namespace=isvc.metadata.namespace or "",
        inference_service=isvc.metadata.name,
        model=model,
        served_model_name=served_name(isvc),
        block_size=spec.kv_cache.block_size,
        short_prompt_threshold=spec.router.short_prompt_threshold,
        prefill_overflow_tokens=spec.router.prefill_overflow_tokens,
    )


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def _env(*, isvc: InferenceService) -> list[dict[str, Any]]:
    """Container env: pod identity from fieldRefs, the model cache and hub (every container
    resolves the model: the router loads its tokenizer), secrets by reference (never read
    here), then runtime.env. A user variable replaces ours of the same name (SSA keys env by name,
    so duplicates would be rejected)."""
    env: dict[str, dict[str, Any]] = {}
    for var, path in (
        (contract.ENV_POD_NAME, "metadata.name"),
        (contract.ENV_POD_NAMESPACE, "metadata.namespace"),
        (contract.ENV_POD_IP, "status.podIP"),
    ):
        env[var] = _field_env(var, path)
    env[contract.ENV_MODEL_CACHE] = {"name": contract.ENV_MODEL_CACHE, "value": MODEL_CACHE_DIR}
    model = isvc.spec.model
    if model.hub_endpoint:
        env[contract.ENV_HUB_ENDPOINT] = {"name": contract.ENV_HUB_ENDPOINT, "value": model.hub_endpoint}
    hub = model.hub_token_secret_ref
    if hub is not None:
        env[contract.ENV_HUB_TOKEN] = {
            "name": contract.ENV_HUB_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": hub.name, "key": hub.key}},
        }
        # Named by the runtime when the hub refuses the token, so the status says what to fix.
        env[contract.ENV_HUB_TOKEN_SOURCE] = {
            "name": contract.ENV_HUB_TOKEN_SOURCE,
            "value": f"Secret {hub.name}, key {hub.key}",
        }
    api_key = isvc.spec.runtime.api_key_secret_ref
    if api_key is not None:
        env[contract.ENV_API_KEY] = {
            "name": contract.ENV_API_KEY,
            "valueFrom": {"secretKeyRef": {"name": api_key.name, "key": api_key.key}},
        }
    for user_var in isvc.spec.runtime.env:
        if user_var.name in (contract.ENV_POD_IP, contract.ENV_POD_NAME, contract.ENV_POD_NAMESPACE):
            continue  # the pod's identity is not the user's to override
        env[user_var.name] = {"name": user_var.name, "value": user_var.value}
    return list(env.values())


def _http_get(path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": contract.HTTP_PORT_NAME}}


def _probes(*, startup_budget_seconds: int) -> dict[str, Any]:
    period = 10
    return {
        "startupProbe": {
            **_http_get("/health"),
            "periodSeconds": period,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, startup_budget_seconds // period),
        },
        "readinessProbe": {
            **_http_get("/ready"),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
            "successThreshold": 1,
        },
        "livenessProbe": {**_http_get("/health"), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _resources(pool: PoolSpec | None) -> dict[str, Any]:
    if pool is None:  # router: small, CPU only
        return {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    res = pool.resources
    if res.cpu is not None:
        requests["cpu"] = res.cpu
    if res.memory is not None:
        requests["memory"] = res.memory
        limits["memory"] = res.memory
    if res.gpus > 0:
        requests[GPU_RESOURCE] = res.gpus_per_pod
        limits[GPU_RESOURCE] = res.gpus_per_pod
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


_CONTAINER_SECURITY: Final[dict[str, Any]] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
_POD_SECURITY: Final[dict[str, Any]] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pod_spec(
    *,
    isvc: InferenceService,
    component: Component,
    runtime_image: str,
    router_service_account: str,
) -> dict[str, Any]:
    spec = isvc.spec
    image = image_of(isvc=isvc, runtime_image=runtime_image)
    # Every container resolves the model (the router loads its tokenizer for prefix hashing).
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}, {"name": "model-cache", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
    ]
    _, pvc_volume, pvc_mount = _model_location(spec.model.uri)
    if pvc_volume is not None and pvc_mount is not None:
        volumes.append(pvc_volume)
        mounts.append(pvc_mount)
    ports = [{"name": contract.HTTP_PORT_NAME, "containerPort": contract.HTTP_PORT, "protocol": "TCP"}]
    pod: dict[str, Any]
    if component.is_router:
        argv = ["splitserve", "router", *contract.router_argv(router_args(isvc=isvc))]
        grace = ROUTER_DRAIN_SECONDS + TERMINATION_GRACE_MARGIN_SECONDS
        probes = _probes(startup_budget_seconds=300)
        pod = {}
        if router_service_account:
            pod["serviceAccountName"] = router_service_account
        container_name = "router"
    else:
        pool = component.pool
        assert pool is not None
        args = serve_args(isvc=isvc, role=component.role, pool=pool, runtime_image=runtime_image)
        argv = ["splitserve", "serve", *contract.serve_argv(args), *spec.runtime.extra_args]
        grace = int(args.drain_timeout_seconds) + TERMINATION_GRACE_MARGIN_SECONDS
        probes = _probes(startup_budget_seconds=STARTUP_PROBE_BUDGET_SECONDS)
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "triton-cache", "emptyDir": {}})
        mounts.append({"name": "triton-cache", "mountPath": TRITON_CACHE_DIR})
        if component.role is not Role.AGGREGATED:
            ports.append(
                {"name": contract.KV_TRANSFER_PORT_NAME, "containerPort": contract.KV_TRANSFER_PORT, "protocol": "TCP"}
            )
        if pool.resources.multi_node:
            ports.append(
                {
                    "name": leader_worker_set.RENDEZVOUS_PORT_NAME,
                    "containerPort": args.rendezvous_port,
                    "protocol": "TCP",
                }
            )
        if uses_handoff_key(component.role) or pool.resources.multi_node:  # a group's rendezvous key too
            volumes.append(handoff_key.volume(isvc.metadata.name))
            mounts.append(handoff_key.volume_mount())
        _, draft_volume, draft_mount = _draft_model_location(isvc)
        if speculates(isvc, component.role) and draft_volume is not None and draft_mount is not None:
            volumes.append(draft_volume)
            mounts.append(draft_mount)
        pod = {"automountServiceAccountToken": False}
        if pool.node_selector:
            pod["nodeSelector"] = dict(pool.node_selector)
        if pool.tolerations:
            pod["tolerations"] = [dict(t) for t in pool.tolerations]
        if pool.affinity:
            pod["affinity"] = dict(pool.affinity)
        if pool.priority_class_name:
            pod["priorityClassName"] = pool.priority_class_name
        container_name = "runtime"
    container: dict[str, Any] = {
        "name": container_name,
        "image": image,
        # `args`, not `command`: the image's ENTRYPOINT (tini) stays PID 1, forwarding SIGTERM
        # (the runtime drains on it) and reaping Triton's compiler children.
        "args": argv,
        "env": _env(isvc=isvc),
        "ports": ports,
        **probes,
        "resources": _resources(component.pool),
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": mounts,
        # The runtime writes why it exited (e.g. a model that cannot be loaded) to the
        # termination message file; without one, the log tail is used. The reconciler reads
        # it from the pod's status into the InferenceService's conditions.
        "terminationMessagePath": contract.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.runtime.image_pull_policy:
        container["imagePullPolicy"] = spec.runtime.image_pull_policy
    return {
        **pod,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace,
        "securityContext": _POD_SECURITY,
        "containers": [container],
        "volumes": volumes,
    }


def config_hash(pod_template: Mapping[str, Any]) -> str:
    """Stable hash of everything in a pod template except the hash annotation itself."""
    meta = dict(pod_template.get("metadata", {}))
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != contract.ANNOTATION_CONFIG_HASH}
    payload = {**pod_template, "metadata": {**meta, "annotations": annotations}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _load(template: str, **values: Any) -> dict[str, Any]:
    text = _JINJA.get_template(template).render(**values)
    obj = yaml.load(text, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader either way
    assert isinstance(obj, dict)
    return obj


def _deployment(
    *,
    isvc: InferenceService,
    component: Component,
    runtime_image: str,
    router_service_account: str,
    compat: str,
    include_replicas: bool,
) -> dict[str, Any]:
    name = isvc.metadata.name
    labels = naming.labels(name, component.role, compat_hash=compat)
    pod_spec = _pod_spec(
        isvc=isvc, component=component, runtime_image=runtime_image, router_service_account=router_service_account
    )
    replicas: int | None = None
    if include_replicas:
        replicas = isvc.spec.router.replicas if component.pool is None else component.pool.replicas.min
    template = {"metadata": {"labels": labels, "annotations": {}}, "spec": pod_spec}
    pod_annotations = {contract.ANNOTATION_CONFIG_HASH: config_hash(template)}
    return _load(
        "deployment.yaml.j2",
        name=naming.child_name(name, component.role),
        namespace=isvc.metadata.namespace,
        labels=labels,
        selector=naming.selector_labels(name, component.role),
        replicas=replicas,
        max_surge=1 if component.is_router else 0,
        max_unavailable=1,
        pod_annotations=pod_annotations,
        pod_spec=pod_spec,
    )


def is_multi_node(component: Component) -> bool:
    """Whether the component is a pool whose replicas span several pods (a LeaderWorkerSet)."""
    return component.pool is not None and component.pool.resources.multi_node


def _leader_worker_set(
    *,
    isvc: InferenceService,
    component: Component,
    runtime_image: str,
    compat: str,
    include_replicas: bool,
) -> dict[str, Any]:
    """A multi-node pool (:mod:`.leader_worker_set`): leader and workers run the same pod; the
    workers are not scraped (they serve no metrics, only the kubelet's probes)."""
    pool = component.pool
    assert pool is not None
    name = isvc.metadata.name
    leader_labels = naming.labels(name, component.role, compat_hash=compat)
    worker_labels = {k: v for k, v in leader_labels.items() if k != contract.LABEL_SCRAPE}
    pod_spec = _pod_spec(isvc=isvc, component=component, runtime_image=runtime_image, router_service_account="")
    templates = {
        role: {"metadata": {"labels": labels, "annotations": {}}, "spec": pod_spec}
        for role, labels in (("leader", leader_labels), ("worker", worker_labels))
    }
    return _load(
        "leaderworkerset.yaml.j2",
        name=naming.child_name(name, component.role),
        namespace=isvc.metadata.namespace,
        labels=leader_labels,
        replicas=pool.replicas.min if include_replicas else None,
        size=pool.resources.pods_per_replica,
        leader_labels=leader_labels,
        worker_labels=worker_labels,
        pod_annotations={contract.ANNOTATION_CONFIG_HASH: config_hash(templates)},
        pod_spec=pod_spec,
    )


def _workload(
    *,
    isvc: InferenceService,
    component: Component,
    runtime_image: str,
    router_service_account: str,
    compat: str,
    include_replicas: bool,
) -> dict[str, Any]:
    """The component's Deployment, or the LeaderWorkerSet of a multi-node pool."""
    if is_multi_node(component):
        return _leader_worker_set(
            isvc=isvc,
            component=component,
            runtime_image=runtime_image,
            compat=compat,
            include_replicas=include_replicas,
        )
    return _deployment(
        isvc=isvc,
        component=component,
        runtime_image=runtime_image,
        router_service_account=router_service_account,
        compat=compat,
        include_replicas=include_replicas,
    )


def pod_template(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod template of a Deployment, or the leader's of a LeaderWorkerSet."""
    spec = workload["spec"]
    if leader_worker_set.is_leader_worker_set(workload):
        template: Mapping[str, Any] = spec["leaderWorkerTemplate"]["leaderTemplate"]
        return template
    deployment_template: Mapping[str, Any] = spec["template"]
    return deployment_template


def _service_selector(isvc: InferenceService, component: Component) -> dict[str, str]:
    """What the component's Service (and an InferencePool of its pods) selects: a multi-node
    pool's leaders only, which serve the API; every pod of the others."""
    if is_multi_node(component):
        return leader_worker_set.leader_selector(isvc.metadata.name, component.role)
    return naming.selector_labels(isvc.metadata.name, component.role)


def _service(*, isvc: InferenceService, component: Component, compat: str) -> dict[str, Any]:
    name = isvc.metadata.name
    ports = [
        {
            "name": contract.HTTP_PORT_NAME,
            "port": contract.HTTP_PORT,
            "targetPort": contract.HTTP_PORT_NAME,
            "protocol": "TCP",
        }
    ]
    if component.role in (Role.PREFILL, Role.DECODE):
        ports.append(
            {
                "name": contract.KV_TRANSFER_PORT_NAME,
                "port": contract.KV_TRANSFER_PORT,
                "targetPort": contract.KV_TRANSFER_PORT_NAME,
                "protocol": "TCP",
            }
        )
    return _load(
        "service.yaml.j2",
        name=naming.child_name(name, component.role),
        namespace=isvc.metadata.namespace,
        labels=naming.labels(name, component.role, compat_hash=compat),
        selector=_service_selector(isvc, component),
        headless=not component.is_router,
        ports=ports,
    )


def _pdb(*, isvc: InferenceService, component: Component, compat: str) -> dict[str, Any]:
    name = isvc.metadata.name
    return _load(
        "pdb.yaml.j2",
        name=naming.child_name(name, component.role),
        namespace=isvc.metadata.namespace,
        labels=naming.labels(name, component.role, compat_hash=compat),
        selector=naming.selector_labels(name, component.role),
    )


def _peer(isvc_name: str, role: Role) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": naming.selector_labels(isvc_name, role)}}


def _port(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def _kv_ports(component: Component) -> dict[str, Any]:
    """The KV ports of a pod: every rank of a parallel prefill pod serves its own slice of the
    KV on the KV port + its index within the pod (the runtime's ``engine.parallel.rank_kv``)."""
    pool = component.pool
    ranks = (
        1 if pool is None else pool.parallelism.tensor * pool.parallelism.pipeline // pool.resources.pods_per_replica
    )
    if ranks <= 1:
        return _port(contract.KV_TRANSFER_PORT)
    return {**_port(contract.KV_TRANSFER_PORT), "endPort": contract.KV_TRANSFER_PORT + ranks - 1}


def _monitoring() -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {MONITORING_NAMESPACE_LABEL: "true"}}}


def _ingress_rules(*, isvc: InferenceService, component: Component) -> list[dict[str, Any]]:
    """Who may connect to this component's pods (on top of the default deny)."""
    name = isvc.metadata.name
    if component.is_router:
        # Clients: anyone may call the OpenAI endpoint (API-key auth is the runtime's job).
        return [{"ports": [_port(contract.HTTP_PORT)]}]
    if not inference_pool.enabled(isvc.spec):
        http_from: list[dict[str, Any]] | None = [_peer(name, Role.ROUTER), _monitoring()]
    elif component.role is inference_pool.served_role(isvc.spec):
        # The Gateway's proxies (in whatever namespace the Gateway runs) send the requests, and
        # the endpoint picker reads /metrics, on the HTTP port: as the router's, open to anyone.
        http_from = None
    else:
        http_from = [_monitoring()]
    http: dict[str, Any] = {"ports": [_port(contract.HTTP_PORT)]}
    if http_from is not None:
        http = {"from": http_from, **http}
    rules: list[dict[str, Any]] = [http]
    if component.role in (Role.PREFILL, Role.DECODE):
        other = Role.DECODE if component.role is Role.PREFILL else Role.PREFILL
        rules.append({"from": [_peer(name, other)], "ports": [_port(contract.HTTP_PORT), _kv_ports(component)]})
    if is_multi_node(component):
        # The ranks of a group: the rendezvous port, and the ports torch's gloo/NCCL pick for
        # their collectives at run time, so any TCP port, from the pool's own pods.
        rules.append({"from": [_peer(name, component.role)], "ports": [{"protocol": "TCP"}]})
    return rules


def _network_policies(*, isvc: InferenceService, comps: Sequence[Component], compat: str) -> list[dict[str, Any]]:
    name = isvc.metadata.name
    deny = _load(
        "networkpolicy.yaml.j2",
        name=naming.network_policy_name(name),
        namespace=isvc.metadata.namespace,
        labels={**naming.instance_selector_labels(name), contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE},
        selector=naming.instance_selector_labels(name),
        ingress=[],
    )
    allows = [
        _load(
            "networkpolicy.yaml.j2",
            name=naming.child_name(name, c.role),
            namespace=isvc.metadata.namespace,
            labels=naming.labels(name, c.role, compat_hash=compat),
            selector=naming.selector_labels(name, c.role),
            ingress=_ingress_rules(isvc=isvc, component=c),
        )
        for c in comps
    ]
    if inference_pool.enabled(isvc.spec):
        allows.append(
            _load(
                "networkpolicy.yaml.j2",
                name=inference_pool.picker_name(name),
                namespace=isvc.metadata.namespace,
                labels=inference_pool.picker_labels(name),
                selector=inference_pool.picker_selector_labels(name),
                # ext-proc from the Gateway's proxies (any namespace); metrics from monitoring.
                ingress=[
                    {"ports": [_port(inference_pool.GRPC_PORT)]},
                    {"from": [_monitoring()], "ports": [_port(inference_pool.METRICS_PORT)]},
                ],
            )
        )
    return [deny, *allows]


def _config_map(
    *,
    isvc: InferenceService,
    comps: Sequence[Component],
    deployments: Sequence[Mapping[str, Any]],
    compat: str,
    runtime_image: str,
) -> dict[str, Any]:
    name = isvc.metadata.name
    engine: dict[str, Any] = {}
    for c in comps:
        if c.pool is None:
            engine[c.role.value] = dataclasses.asdict(router_args(isvc=isvc))
        else:
            engine[c.role.value] = {
                "serveArgs": dataclasses.asdict(
                    serve_args(isvc=isvc, role=c.role, pool=c.pool, runtime_image=runtime_image)
                ),
                "extraArgs": list(isvc.spec.runtime.extra_args),
            }
    hashes = {
        str(d["metadata"]["labels"][contract.LABEL_ROLE]): str(
            pod_template(d)["metadata"]["annotations"][contract.ANNOTATION_CONFIG_HASH]
        )
        for d in deployments
    }
    labels = {
        **naming.instance_selector_labels(name),
        contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE,
        contract.LABEL_COMPAT_HASH: compat,
    }
    return _load(
        "configmap.yaml.j2",
        name=naming.config_map_name(name),
        namespace=isvc.metadata.namespace,
        labels=labels,
        annotations={
            contract.ANNOTATION_CONFIG_HASH: hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[
                :16
            ]
        },
        data={
            "engine.json": json.dumps(engine, indent=2, sort_keys=True),
            "config-hashes.json": json.dumps(hashes, indent=2, sort_keys=True),
            "image": image_of(isvc=isvc, runtime_image=runtime_image),
        },
    )


def _picker_pod_spec(isvc: InferenceService) -> dict[str, Any]:
    """The endpoint picker's pod: the upstream EPP with our flags, under its own
    ServiceAccount (it reads pods and its InferencePool), as locked down as our pods."""
    name = isvc.metadata.name

    def grpc_probe(period_seconds: int) -> dict[str, Any]:
        return {
            "grpc": {"port": inference_pool.GRPC_HEALTH_PORT, "service": inference_pool.GRPC_HEALTH_SERVICE},
            "periodSeconds": period_seconds,
        }

    container: dict[str, Any] = {
        "name": "epp",
        "image": inference_pool.picker_image(isvc),
        "args": inference_pool.picker_args(isvc),
        "env": [_field_env("NAMESPACE", "metadata.namespace"), _field_env("POD_NAME", "metadata.name")],
        "ports": [
            {"name": "grpc", "containerPort": inference_pool.GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": inference_pool.GRPC_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": inference_pool.METRICS_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": {**grpc_probe(10), "initialDelaySeconds": 5},
        "readinessProbe": grpc_probe(2),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "securityContext": _CONTAINER_SECURITY,
    }
    return {
        "serviceAccountName": inference_pool.picker_name(name),
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": inference_pool.PICKER_GRACE_SECONDS,
        "securityContext": _POD_SECURITY,
        "containers": [container],
    }


def _picker_children(isvc: InferenceService) -> list[dict[str, Any]]:
    """The endpoint picker's ServiceAccount, Role, RoleBinding, Deployment and Service, then the
    InferencePool that names it (router mode InferencePool)."""
    name, namespace = isvc.metadata.name, isvc.metadata.namespace
    picker = inference_pool.picker_name(name)
    labels = inference_pool.picker_labels(name)
    identity = {"name": picker, "namespace": namespace, "labels": labels}
    template = {"metadata": {"labels": labels, "annotations": {}}, "spec": _picker_pod_spec(isvc)}
    deployment = _load(
        "deployment.yaml.j2",
        **identity,
        selector=inference_pool.picker_selector_labels(name),
        replicas=inference_pool.PICKER_REPLICAS,
        # One picker at a time would mean no picker while it is replaced (and, with
        # failureMode FailClose, failed requests): the new one is ready before the old goes.
        max_surge=1,
        max_unavailable=0,
        pod_annotations={contract.ANNOTATION_CONFIG_HASH: config_hash(template)},
        pod_spec=template["spec"],
    )
    service = _load(
        "service.yaml.j2",
        **identity,
        selector=inference_pool.picker_selector_labels(name),
        headless=False,
        ports=[
            {
                "name": "grpc-ext-proc",
                "port": inference_pool.GRPC_PORT,
                "targetPort": "grpc",
                "protocol": "TCP",
                "appProtocol": "http2",
            },
            {"name": "http-metrics", "port": inference_pool.METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
        ],
    )
    served = next(c for c in components(isvc.spec) if c.role is inference_pool.served_role(isvc.spec))
    pool = _load(
        "inferencepool.yaml.j2",
        name=inference_pool.pool_name(name),
        namespace=namespace,
        labels={**naming.instance_selector_labels(name), contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE},
        selector=_service_selector(isvc, served),
        target_port=contract.HTTP_PORT,
        picker=picker,
        picker_port=inference_pool.GRPC_PORT,
        failure_mode=isvc.spec.router.inference_pool_settings.failure_mode.value,
    )
    return [
        _load("serviceaccount.yaml.j2", **identity),
        _load("role.yaml.j2", **identity, rules=inference_pool.picker_rules(name)),
        _load("rolebinding.yaml.j2", **identity),
        deployment,
        service,
        pool,
    ]


def render_children(
    *,
    isvc: InferenceService,
    runtime_image: str,
    router_service_account: str,
    include_replicas: bool = False,
) -> list[dict[str, Any]]:
    """Every child object of ``isvc``, without owner references, in apply order
    (ConfigMap, then per component Deployment or LeaderWorkerSet/Service/PDB, then in router mode InferencePool
    the endpoint picker's objects and the InferencePool, then NetworkPolicies).

    ``include_replicas``: put ``spec.replicas`` (pool min, router replicas) on the
    Deployments and LeaderWorkerSets; only for the apply that creates them (the picker's, always 1, always).

    This is also how to see what an InferenceService renders without a cluster, e.g. for a
    server-side dry run: ``render_children(isvc=InferenceService.parse(obj), runtime_image=...,
    router_service_account="")``."""
    compat = compat_hash_of(isvc=isvc, runtime_image=runtime_image)
    comps = components(isvc.spec)
    deployments = [
        _workload(
            isvc=isvc,
            component=c,
            runtime_image=runtime_image,
            router_service_account=router_service_account,
            compat=compat,
            include_replicas=include_replicas,
        )
        for c in comps
    ]
    out: list[dict[str, Any]] = [
        _config_map(isvc=isvc, comps=comps, deployments=deployments, compat=compat, runtime_image=runtime_image)
    ]
    for c, deployment in zip(comps, deployments, strict=True):
        out += [
            deployment,
            _service(isvc=isvc, component=c, compat=compat),
            _pdb(isvc=isvc, component=c, compat=compat),
        ]
    if inference_pool.enabled(isvc.spec):
        out += _picker_children(isvc)
    out += _network_policies(isvc=isvc, comps=comps, compat=compat)
    return out


def initial_replicas(*, isvc: InferenceService, role: Role) -> int:
    """spec.replicas a freshly created Deployment of ``role`` starts with."""
    for c in components(isvc.spec):
        if c.role is role:
            return isvc.spec.router.replicas if c.pool is None else c.pool.replicas.min
    raise ValueError(f"no {role.value} component in mode {isvc.spec.mode.value}")
