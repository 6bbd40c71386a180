"""Where the router learns which pods back each role.

Static discovery takes address lists from flags (tests, bare-metal). Kubernetes discovery
watches the EndpointSlices of the InferenceService's Services (`<isvc>-prefill`,
`<isvc>-decode`, `<isvc>-engine`) and feeds the ready endpoints to the PodSet; a watch that
expires (410 Gone) or breaks is re-listed, so the router never keeps routing to a stale set.
The kubernetes client is synchronous, so the watch runs in a thread and hands results to the
event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, cast

from splitserve_contract import HTTP_PORT, HTTP_PORT_NAME, Role

from .pods import PodSet, Target

log = logging.getLogger(__name__)

SERVICE_SUFFIX = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.AGGREGATED: "engine"}
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


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


def targets_from_slices(
    *, slices: Iterable[dict[str, Any]], service_roles: dict[str, Role]
) -> dict[Role, list[Target]]:
    """Ready endpoints of EndpointSlice objects (as dicts) grouped by role."""
    found: dict[Role, list[Target]] = {role: [] for role in service_roles.values()}
    for eps in slices:
        service = (eps.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL, "")
        role = service_roles.get(service)
        if role is None:
            continue
        port = next(
            (p.get("port") for p in eps.get("ports") or [] if p.get("name") == HTTP_PORT_NAME),
            HTTP_PORT,
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


class KubernetesDiscovery:
    """Watches EndpointSlices in `namespace` for the InferenceService's role Services."""

    def __init__(
        self,
        *,
        namespace: str,
        inference_service: str,
        pods: PodSet,
        roles: Iterable[Role] = tuple(SERVICE_SUFFIX),
    ) -> None:
        """``roles``: the Services watched; an engine that serves aggregated pools only (vLLM)
        watches the aggregated one, so a prefill or decode pod left over from another engine's
        pools never gets requests this router cannot hand over."""
        if not namespace or not inference_service:
            raise ValueError("kubernetes discovery needs --namespace and --inference-service")
        self._namespace = namespace
        self._pods = pods
        self._service_roles = {f"{inference_service}-{SERVICE_SUFFIX[role]}": role for role in roles}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slices: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self, slices: dict[str, dict[str, Any]] | None = None) -> None:
        with self._lock:
            if slices is not None:
                self._slices = dict(slices)
            found = targets_from_slices(slices=self._slices.values(), service_roles=self._service_roles)
        if self._loop is None:
            return
        for role, targets in found.items():
            self._loop.call_soon_threadsafe(functools.partial(self._pods.set_targets, role=role, targets=targets))

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        to_dict = _load_kube_config()
        api = client.DiscoveryV1Api()
        selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(self._service_roles))})"
        while not self._stop.is_set():
            try:
                listed: dict[str, Any] = to_dict(
                    api.list_namespaced_endpoint_slice(self._namespace, label_selector=selector)
                )
                slices: dict[str, dict[str, Any]] = {s["metadata"]["name"]: s for s in listed.get("items", [])}
                self._publish(slices)
                stream = watch.Watch().stream(
                    api.list_namespaced_endpoint_slice,
                    self._namespace,
                    label_selector=selector,
                    resource_version=listed["metadata"]["resourceVersion"],
                    timeout_seconds=60,
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
