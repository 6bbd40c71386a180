"""EndpointSlices for Services whose pods run on the local node.

The API server rejects loopback addresses in IPv4 EndpointSlices ("may not be in the loopback
range"), so the endpointslice controller cannot publish the 127.x.y.z IPs of local-node pods,
and anything that discovers peers through EndpointSlices (the router, ``endpoints_of``) would
see nothing. The local node therefore publishes, per Service that selects its pods, one slice
of ``addressType: FQDN`` (which the API accepts for a dotted address) labelled
``kubernetes.io/service-name`` like the controller's and ``managed-by`` this agent, so the
controller leaves it alone. Its endpoints follow exactly the controller's rules: every selected
pod with an IP, ``ready``/``serving`` from the pod's Ready condition, ``terminating`` once it
has a deletionTimestamp, ports from the Service's targetPorts resolved against named container
ports. The Service owns the slice, so it goes with the Service.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "splitserve-local-node.splitserve.dev"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SLICE_SUFFIX = "-local"


def slice_name(service: str) -> str:
    return service[:63 - len(SLICE_SUFFIX)] + SLICE_SUFFIX


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _target_port(port: Mapping[str, Any], pod: Mapping[str, Any]) -> int | None:
    target = port.get("targetPort", port["port"])
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for container_port in container.get("ports") or []:
            if container_port.get("name") == target:
                return int(container_port["containerPort"])
    return None


def desired_slice(*, service: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                  node_name: str) -> dict[str, Any] | None:
    """The slice for ``service`` given the local pods, or None when it selects none of them."""
    selector = (service.get("spec") or {}).get("selector") or {}
    metadata = service["metadata"]
    if not selector:
        return None
    selected = [p for p in pods if p["metadata"]["namespace"] == metadata["namespace"]
                and (p.get("status") or {}).get("podIP")
                and _selects(selector, p["metadata"].get("labels") or {})]
    if not selected:
        return None
    service_ports = service["spec"].get("ports") or []
    ports = []
    for port in service_ports:
        target = next((t for t in (_target_port(port, p) for p in selected) if t is not None), None)
        if target is not None:
            ports.append({"name": port.get("name", ""), "port": target,
                          "protocol": port.get("protocol", "TCP")})
    endpoints = []
    for pod in sorted(selected, key=lambda p: p["metadata"]["name"]):
        terminating = bool(pod["metadata"].get("deletionTimestamp"))
        ready = _ready(pod) and not terminating
        endpoints.append({
            "addresses": [pod["status"]["podIP"]],
            "conditions": {"ready": ready, "serving": _ready(pod), "terminating": terminating},
            "nodeName": node_name,
            "targetRef": {"kind": "Pod", "namespace": metadata["namespace"],
                          "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]},
        })
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": slice_name(metadata["name"]), "namespace": metadata["namespace"],
            "labels": {SERVICE_NAME_LABEL: metadata["name"], MANAGED_BY_LABEL: MANAGED_BY_VALUE},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": metadata["name"],
                                 "uid": metadata["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "addressType": "FQDN",
        "endpoints": endpoints,
        "ports": ports,
    }


class SliceMirror:
    """Keeps the local-node EndpointSlices equal to :func:`desired_slice` for every Service."""

    def __init__(self, *, api: k8s.ApiClient, node_name: str) -> None:
        self._core = k8s.CoreV1Api(api)
        self._discovery = k8s.DiscoveryV1Api(api)
        self._node_name = node_name
        self._published: dict[tuple[str, str], dict[str, Any]] = {}

    def sync(self, *, pods: Sequence[Mapping[str, Any]]) -> None:
        services: Any = self._core.list_service_for_all_namespaces(
            resource_version="0", _preload_content=False)
        desired: dict[tuple[str, str], dict[str, Any]] = {}
        for service in json.loads(services.data)["items"]:
            wanted = desired_slice(service=service, pods=pods, node_name=self._node_name)
            if wanted is not None:
                desired[(wanted["metadata"]["namespace"], wanted["metadata"]["name"])] = wanted
        for key, wanted in desired.items():
            if self._published.get(key) != wanted:
                try:
                    self._apply(key, wanted)
                except ApiException as error:  # e.g. the namespace is terminating
                    log.warning("EndpointSlice %s/%s not applied: %s", *key, error.reason)
                    continue
                self._published[key] = wanted
        for key in [k for k in self._published if k not in desired]:
            self._delete(key)
            self._published.pop(key, None)

    def _apply(self, key: tuple[str, str], wanted: dict[str, Any]) -> None:
        namespace, name = key
        body: Any = wanted
        self._discovery.patch_namespaced_endpoint_slice(
            name, namespace, body, field_manager=MANAGED_BY_VALUE, force=True,
            _content_type="application/apply-patch+yaml")

    def _delete(self, key: tuple[str, str]) -> None:
        namespace, name = key
        try:
            self._discovery.delete_namespaced_endpoint_slice(name, namespace)
        except ApiException as error:
            if error.status != 404:
                log.warning("EndpointSlice %s/%s not deleted: %s", namespace, name, error.reason)
