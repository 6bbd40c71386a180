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
from splitserve_contract.engines import VLLM_IMAGE, Engine

from . import engines, inference_pool, leader_worker_set, naming
from .api import InferenceService, InferenceServiceSpec, Mode, PoolSpec
from .engines import pod
from .engines import splitserve as engine_splitserve

TEMPLATE_DIR: Final = Path(__file__).parent / "templates"

MONITORING_NAMESPACE_LABEL: Final = "splitserve.dev/monitoring"
"""Namespaces labelled ``splitserve.dev/monitoring=true`` may scrape pods on the HTTP port."""

"""``TRITON_CACHE_DIR`` of the image: compiled kernels; an emptyDir (the root is read-only)."""
RUN_AS_USER: Final = 65532
GPU_RESOURCE: Final = "nvidia.com/gpu"
ROUTER_DRAIN_SECONDS: Final = 30
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


def image_of(*, isvc: InferenceService, runtime_image: str, vllm_image: str = VLLM_IMAGE) -> str:
    """The pools' image: spec.runtime.image, else the operator's default for the engine."""
    if isvc.spec.runtime.image:
        return isvc.spec.runtime.image
    return vllm_image if isvc.spec.runtime.engine is Engine.VLLM else runtime_image


def router_image_of(*, isvc: InferenceService, runtime_image: str) -> str:
    """The router runs the bundled image: the pools' for engine splitserve (one version of
    both), the operator's runtime image for any other engine."""
    if isvc.spec.runtime.engine is Engine.SPLITSERVE:
        return image_of(isvc=isvc, runtime_image=runtime_image)
    return runtime_image


def compat_hash_of(*, isvc: InferenceService, runtime_image: str, vllm_image: str = VLLM_IMAGE) -> str:
    return pod.compat_hash(isvc=isvc, image=image_of(isvc=isvc, runtime_image=runtime_image, vllm_image=vllm_image))


def uses_handoff_key(role: Role) -> bool:
    return engine_splitserve.uses_handoff_key(role)


def router_args(*, isvc: InferenceService) -> contract.RouterArgs:
    spec = isvc.spec
    model, _, _ = pod.model_location(spec.model.uri)
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
        served_model_name=pod.served_name(isvc),
        block_size=spec.kv_cache.block_size,
        short_prompt_threshold=spec.router.short_prompt_threshold,
        prefill_overflow_tokens=spec.router.prefill_overflow_tokens,
        engine=spec.runtime.engine.value,
    )


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
    vllm_image: str,
    router_service_account: str,
) -> dict[str, Any]:
    spec = isvc.spec
    # Every container resolves the model (the router loads its tokenizer for prefix hashing).
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}, {"name": "model-cache", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model-cache", "mountPath": pod.MODEL_CACHE_DIR},
    ]
    _, pvc_volume, pvc_mount = pod.model_location(spec.model.uri)
    if pvc_volume is not None and pvc_mount is not None:
        volumes.append(pvc_volume)
        mounts.append(pvc_mount)
    ports = [{"name": contract.HTTP_PORT_NAME, "containerPort": contract.HTTP_PORT, "protocol": "TCP"}]
    pod_fields: dict[str, Any]
    command: list[str] | None = None
    lifecycle: dict[str, Any] | None = None
    if component.is_router:
        image = router_image_of(isvc=isvc, runtime_image=runtime_image)
        argv = ["splitserve", "router", *contract.router_argv(router_args(isvc=isvc))]
        grace = ROUTER_DRAIN_SECONDS + pod.TERMINATION_GRACE_MARGIN_SECONDS
        probes = pod.probes(engine=Engine.SPLITSERVE, startup_budget_seconds=300)
        env = pod.env(isvc=isvc)
        pod_fields = {}
        if router_service_account:
            pod_fields["serviceAccountName"] = router_service_account
        container_name = "router"
    else:
        pool = component.pool
        assert pool is not None
        image = image_of(isvc=isvc, runtime_image=runtime_image, vllm_image=vllm_image)
        engine = engines.renderer(spec.runtime.engine).container(
            isvc=isvc, role=component.role, pool=pool, compat_hash=pod.compat_hash(isvc=isvc, image=image)
        )
        command, argv, env, grace = engine.command, engine.args, engine.env, engine.grace_seconds
        lifecycle = engine.lifecycle
        probes = pod.probes(engine=spec.runtime.engine, startup_budget_seconds=pod.STARTUP_PROBE_BUDGET_SECONDS)
        ports += engine.ports
        volumes += engine.volumes
        mounts += engine.mounts
        pod_fields = {"automountServiceAccountToken": False}
        if pool.node_selector:
            pod_fields["nodeSelector"] = dict(pool.node_selector)
        if pool.tolerations:
            pod_fields["tolerations"] = [dict(t) for t in pool.tolerations]
        if pool.affinity:
            pod_fields["affinity"] = dict(pool.affinity)
        if pool.priority_class_name:
            pod_fields["priorityClassName"] = pool.priority_class_name
        container_name = "runtime"
    container: dict[str, Any] = {"name": container_name, "image": image}
    if command is not None:
        container["command"] = command
    container |= {
        # `args` for the bundled image: its ENTRYPOINT (tini) stays PID 1, forwarding SIGTERM
        # (the runtime drains on it) and reaping Triton's compiler children.
        "args": argv,
        "env": env,
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
    if lifecycle is not None:
        container["lifecycle"] = lifecycle
    if spec.runtime.image_pull_policy:
        container["imagePullPolicy"] = spec.runtime.image_pull_policy
    return {
        **pod_fields,
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
    vllm_image: str,
    router_service_account: str,
    compat: str,
    include_replicas: bool,
) -> dict[str, Any]:
    name = isvc.metadata.name
    labels = naming.labels(name, component.role, compat_hash=compat)
    pod_spec = _pod_spec(
        isvc=isvc,
        component=component,
        runtime_image=runtime_image,
        vllm_image=vllm_image,
        router_service_account=router_service_account,
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
    vllm_image: str,
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
    pod_spec = _pod_spec(
        isvc=isvc, component=component, runtime_image=runtime_image, vllm_image=vllm_image, router_service_account=""
    )
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
    vllm_image: str,
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
            vllm_image=vllm_image,
            compat=compat,
            include_replicas=include_replicas,
        )
    return _deployment(
        isvc=isvc,
        component=component,
        runtime_image=runtime_image,
        vllm_image=vllm_image,
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
        assert component.pool is not None  # a prefill or decode component has its pool
        kv_ports = engines.renderer(isvc.spec.runtime.engine).kv_ports(component.pool)
        rules.append({"from": [_peer(name, other)], "ports": [_port(contract.HTTP_PORT), *kv_ports]})
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
    image: str,
) -> dict[str, Any]:
    name = isvc.metadata.name
    engine: dict[str, Any] = {}
    for c in comps:
        if c.pool is None:
            engine[c.role.value] = dataclasses.asdict(router_args(isvc=isvc))
        else:
            engine[c.role.value] = (
                engines.renderer(isvc.spec.runtime.engine)
                .container(isvc=isvc, role=c.role, pool=c.pool, compat_hash=compat)
                .config
            )
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
            "image": image,
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
        "env": [pod.field_env("NAMESPACE", "metadata.namespace"), pod.field_env("POD_NAME", "metadata.name")],
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
    vllm_image: str = VLLM_IMAGE,
) -> list[dict[str, Any]]:
    """Every child object of ``isvc``, without owner references, in apply order
    (ConfigMap, then per component Deployment or LeaderWorkerSet/Service/PDB, then in router mode InferencePool
    the endpoint picker's objects and the InferencePool, then NetworkPolicies).

    ``include_replicas``: put ``spec.replicas`` (pool min, router replicas) on the
    Deployments and LeaderWorkerSets; only for the apply that creates them (the picker's, always 1, always).

    This is also how to see what an InferenceService renders without a cluster, e.g. for a
    server-side dry run: ``render_children(isvc=InferenceService.parse(obj), runtime_image=...,
    router_service_account="")``."""
    image = image_of(isvc=isvc, runtime_image=runtime_image, vllm_image=vllm_image)
    compat = pod.compat_hash(isvc=isvc, image=image)
    comps = components(isvc.spec)
    deployments = [
        _workload(
            isvc=isvc,
            component=c,
            runtime_image=runtime_image,
            vllm_image=vllm_image,
            router_service_account=router_service_account,
            compat=compat,
            include_replicas=include_replicas,
        )
        for c in comps
    ]
    out: list[dict[str, Any]] = [
        _config_map(isvc=isvc, comps=comps, deployments=deployments, compat=compat, image=image)
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
