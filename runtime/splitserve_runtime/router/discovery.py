"""Where the router learns which pods back each role.

Static discovery takes address lists from flags (tests, bare-metal). Kubernetes discovery
watches the EndpointSlices of the InferenceService's Services (`<isvc>-prefill`,
`<isvc>-decode`, `<isvc>-engine`) and feeds the ready endpoints to the PodSet; a watch that
expires (410 Gone) or breaks is re-listed, so the router never keeps routing to a stale set.
The kubernetes client is synchronous, so the watch runs in a thread and hands results to the
event loop.

Loopback pods: the API server rejects 127.0.0.0/8 addresses in EndpointSlices ("may not be in
the loopback range"), so pods of the e2e harness's local node (which runs pods as processes
on 127.x.y.z) never appear in a slice. For those only, the Ready pods labelled with the role
and the InferenceService are polled every :data:`LOOPBACK_POLL_SECONDS` and merged in; on a
real cluster no pod has a loopback IP, so this adds nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, cast

from splitserve_contract import HTTP_PORT, HTTP_PORT_NAME, LABEL_INSTANCE, LABEL_ROLE, Role

from .pods import PodSet, Target

log = logging.getLogger(__name__)

SERVICE_SUFFIX = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.AGGREGATED: "engine"}
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
LOOPBACK_POLL_SECONDS = 2.0


def parse_static(*, role: Role, endpoints: str) -> list[Target]:
    """`host:port,host:port` → targets; a bad entry is a startup error with its text."""
    targets = []
    for raw in (e.strip() for e in endpoints.split(",")):
        if not raw:
            continue
        host, sep, port = raw.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bad {role.value} endpoint {raw!r}: expected host:port")
        url = raw if raw.startswith("http") else f"http://{raw}"
        targets.append(Target(name=raw, url=url, role=role))
    return targets


def targets_from_slices(*, slices: Iterable[dict[str, Any]], service_roles: dict[str, Role]) -> dict[Role, list[Target]]:
    """Ready endpoints of EndpointSlice objects (as dicts) grouped by role."""
    found: dict[Role, list[Target]] = {role: [] for role in service_roles.values()}
    for eps in slices:
        service = (eps.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL, "")
        role = service_roles.get(service)
        if role is None:
            continue
        port = next(
            (p.get("port") for p in eps.get("ports") or [] if p.get("name") == HTTP_PORT_NAME), HTTP_PORT,
        )
        for endpoint in eps.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            ref = endpoint.get("targetRef") or {}
            address = addresses[0]
            host = f"[{address}]" if ":" in address else address
            name = ref.get("name") or f"{host}:{port}"
            found[role].append(Target(name=name, url=f"http://{host}:{port}", role=role))
    return found


def loopback_targets_from_pods(*, pods: Iterable[dict[str, Any]], inference_service: str) -> dict[Role, list[Target]]:
    """Ready, non-terminating pods of ``inference_service`` with a loopback pod IP, by role
    label (pods as dicts). See the module docstring for why."""
    found: dict[Role, list[Target]] = {role: [] for role in SERVICE_SUFFIX}
    for pod in pods:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        status = pod.get("status") or {}
        ip = str(status.get("podIP") or "")
        if labels.get(LABEL_INSTANCE) != inference_service or not ip.startswith("127."):
            continue
        if metadata.get("deletionTimestamp"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        try:
            role = Role(labels.get(LABEL_ROLE, ""))
        except ValueError:
            continue
        if not ready or role not in found:
            continue
        found[role].append(Target(name=str(metadata.get("name") or ip), url=f"http://{ip}:{HTTP_PORT}", role=role))
    return found


class KubernetesDiscovery:
    """Watches EndpointSlices in `namespace` for the InferenceService's role Services."""

    def __init__(self, *, namespace: str, inference_service: str, pods: PodSet) -> None:
        if not namespace or not inference_service:
            raise ValueError("kubernetes discovery needs --namespace and --inference-service")
        self._namespace = namespace
        self._pods = pods
        self._service_roles = {f"{inference_service}-{suffix}": role for role, suffix in SERVICE_SUFFIX.items()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inference_service = inference_service
        self._slices: dict[str, dict[str, Any]] = {}
        self._loopback: dict[Role, list[Target]] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._thread.start()
        threading.Thread(target=self._poll_loopback_pods, name="loopback-pods", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self, slices: dict[str, dict[str, Any]] | None = None) -> None:
        with self._lock:
            if slices is not None:
                self._slices = dict(slices)
            found = targets_from_slices(slices=self._slices.values(), service_roles=self._service_roles)
            for role, extra in self._loopback.items():
                known = {t.url for t in found.get(role, [])}
                found.setdefault(role, []).extend(t for t in extra if t.url not in known)
        if self._loop is None:
            return
        for role, targets in found.items():
            self._loop.call_soon_threadsafe(functools.partial(self._pods.set_targets, role=role, targets=targets))

    def _poll_loopback_pods(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        to_dict = _load_kube_config()
        api = client.CoreV1Api()
        selector = f"{LABEL_INSTANCE}={self._inference_service}"
        while not self._stop.is_set():
            try:
                listed: dict[str, Any] = to_dict(api.list_namespaced_pod(self._namespace, label_selector=selector))
                found = loopback_targets_from_pods(pods=listed.get("items", []),
                                                   inference_service=self._inference_service)
                if found != self._loopback:
                    with self._lock:
                        self._loopback = found
                    self._publish()
            except ApiException as exc:
                log.warning("Listing pods failed (%s)", exc.status)
            except Exception as exc:  # a broken connection must not end discovery
                log.warning("Listing pods broke (%s)", exc)
            self._stop.wait(LOOPBACK_POLL_SECONDS)

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        to_dict = _load_kube_config()
        api = client.DiscoveryV1Api()
        selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(self._service_roles))})"
        while not self._stop.is_set():
            try:
                listed: dict[str, Any] = to_dict(api.list_namespaced_endpoint_slice(self._namespace, label_selector=selector))
                slices: dict[str, dict[str, Any]] = {s["metadata"]["name"]: s for s in listed.get("items", [])}
                self._publish(slices)
                stream = watch.Watch().stream(
                    api.list_namespaced_endpoint_slice, self._namespace, label_selector=selector,
                    resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=60,
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    obj: dict[str, Any] = to_dict(event["object"])
                    name = obj["metadata"]["name"]
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    self._publish(slices)
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("EndpointSlice watch failed (%s); relisting", exc.status)
                    self._stop.wait(2.0)
            except Exception as exc:  # a broken connection must not end discovery
                log.warning("EndpointSlice watch broke (%s); relisting", exc)
                self._stop.wait(2.0)


def _load_kube_config() -> Callable[[object], Any]:
    """Load the in-cluster config (or ``$KUBECONFIG`` outside a pod) and return the client's
    converter from API objects to plain dicts."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api_client: Any = client.ApiClient()
    return cast(Callable[[object], Any], api_client.sanitize_for_serialization)
