"""The one module that talks HTTP to the Kubernetes API server: the operator's gateway.

Only this module imports the ``kubernetes`` client (``.importlinter``, "Only the gateway
imports the Kubernetes client"): the login (:func:`load_credentials`), the requests, and the
error type a refused request raises (:class:`ApiException`, re-exported so callers catch it
as ``kube.ApiException`` and never import the client themselves). Every other controller
module (``apply``, ``status``, ``leader``, ``handlers``) goes through :class:`Kube`, which
works on plain ``dict`` objects, the shape of the YAML a human reads, rather than on the
client's generated model classes. Requests are built with the official
client's :class:`kubernetes.client.ApiClient` (so its authentication from a kubeconfig or the
in-cluster ServiceAccount token is reused) and sent with an explicit timeout: the client has no
default timeout, and a request that never returns would freeze a reconcile forever.

Only the kinds the operator manages are known (:data:`KINDS`); an object of any other kind is a
programming error, not a cluster condition, so it raises :class:`KeyError` at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Protocol
from urllib.parse import quote

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client import ApiClient as ApiClient
from kubernetes.client.exceptions import ApiException as ApiException

import splitserve_contract as contract

APPLY_PATCH: Final = "application/apply-patch+yaml"
MERGE_PATCH: Final = "application/merge-patch+json"
DEFAULT_TIMEOUT_SECONDS: Final = 15.0
METADATA_LIST: Final = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_ONLY: Final = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
"""Accept headers that make the API server answer with metadata alone (no ``data``, no ``spec``)."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """Where objects of one kind live in the REST API."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def collection_path(self, *, namespace: str | None) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            return f"{prefix}/namespaces/{quote(namespace)}/{self.plural}"
        return f"{prefix}/{self.plural}"

    def object_path(self, *, namespace: str | None, name: str) -> str:
        return f"{self.collection_path(namespace=namespace)}/{quote(name)}"


CONFIG_MAP: Final = Kind("v1", "ConfigMap", "configmaps")
SECRET: Final = Kind("v1", "Secret", "secrets")
"""Only ever created (the KV handoff key) and seen as metadata (:meth:`Kube.list_metadata`,
:meth:`Kube.watch_metadata`): the operator never asks for a Secret's data."""
SERVICE: Final = Kind("v1", "Service", "services")
POD: Final = Kind("v1", "Pod", "pods")
NODE: Final = Kind("v1", "Node", "nodes", namespaced=False)
DEPLOYMENT: Final = Kind("apps/v1", "Deployment", "deployments")
PDB: Final = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
NETWORK_POLICY: Final = Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
LEASE: Final = Kind("coordination.k8s.io/v1", "Lease", "leases")
EVENT: Final = Kind("v1", "Event", "events")
"""Only ever created (:class:`splitserve_operator.events.EventPoster`)."""
SERVICE_ACCOUNT: Final = Kind("v1", "ServiceAccount", "serviceaccounts")
ROLE: Final = Kind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING: Final = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
INFERENCE_POOL: Final = Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools")
"""The Gateway API Inference Extension's CRD (router.mode InferencePool): may be missing."""
LEADER_WORKER_SET: Final = Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets")
"""A pool whose replicas span several nodes (LWS's CRD): may be missing."""
INFERENCE_SERVICE: Final = Kind(f"{contract.API_GROUP}/{contract.API_VERSION}", contract.KIND, contract.PLURAL)

KINDS: Final[dict[tuple[str, str], Kind]] = {
    (k.api_version, k.kind): k
    for k in (
        CONFIG_MAP,
        SECRET,
        SERVICE,
        POD,
        NODE,
        DEPLOYMENT,
        PDB,
        NETWORK_POLICY,
        LEASE,
        INFERENCE_SERVICE,
        SERVICE_ACCOUNT,
        ROLE,
        ROLE_BINDING,
        INFERENCE_POOL,
        LEADER_WORKER_SET,
    )
}


def load_credentials(*, connection_pool_size: int) -> ApiClient:
    """An ApiClient for our own calls, logged in like kopf's default ``login_via_client``:
    ``$KUBECONFIG`` when set, else the in-cluster ServiceAccount, else ``~/.kube/config``.
    ``connection_pool_size``: HTTP connections kept open (reconciles apply children
    concurrently; too few and urllib3 keeps discarding and reopening them)."""
    if os.environ.get("KUBECONFIG"):
        k8s_config.load_kube_config()
    else:
        try:
            k8s_config.load_incluster_config()
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()
    configuration = k8s_client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = connection_pool_size
    return ApiClient(configuration)


def kind_of(obj: Mapping[str, Any]) -> Kind:
    return KINDS[(str(obj["apiVersion"]), str(obj["kind"]))]


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 404


def is_conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 409


def error_message(exc: BaseException) -> str:
    """The API server's own message for a failed request (its Status.message), else str()."""
    if isinstance(exc, ApiException) and exc.body:
        try:
            body = json.loads(exc.body)
        except (ValueError, TypeError):
            return f"{exc.status} {exc.reason}"
        if isinstance(body, dict) and body.get("message"):
            return f"{exc.status} {body.get('reason', exc.reason)}: {body['message']}"
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


class StatusAPI(Protocol):
    """The two calls a status writer needs (:func:`.status.patch_status`): read, merge-patch."""

    def get(self, *, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None: ...

    def merge_patch(
        self,
        *,
        kind: Kind,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]: ...


class KubeAPI(StatusAPI, Protocol):
    """What the reconciler (:mod:`.reconcile`, :mod:`.apply`, :mod:`.status`) uses of
    :class:`Kube`; tests pass fakes that implement just this."""

    def list(self, *, kind: Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]: ...

    def apply(self, *, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]: ...

    def create(
        self, *, kind: Kind, namespace: str | None, obj: Mapping[str, Any], field_manager: str | None = None
    ) -> dict[str, Any]: ...

    def list_metadata(
        self, *, kind: Kind, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> tuple[Sequence[dict[str, Any]], str]: ...


RequestObserver = Callable[[str, str], None]
"""Called once per request sent, with (verb, resource): ``get``/``list``/``create``/``update``/
``patch``/``apply`` and the plural, ``/status`` appended for the status subresource (the
operator's ``splitserve_operator_api_requests_total``)."""


class Kube:
    """Typed, dict-based access to the handful of API calls the operator makes."""

    def __init__(
        self,
        *,
        api_client: ApiClient,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        on_request: RequestObserver | None = None,
    ) -> None:
        self._api = api_client
        self._timeout = timeout_seconds
        self._on_request = on_request

    def _request(
        self,
        *,
        verb: str,
        resource: str,
        method: str,
        path: str,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str | None = None,
        accept: str = "application/json",
    ) -> dict[str, Any]:
        if self._on_request is not None:
            self._on_request(verb, resource)
        headers = {"Accept": accept}
        if content_type is not None:
            headers["Content-Type"] = content_type
        elif body is not None:
            headers["Content-Type"] = "application/json"
        serialized = self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list(query),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        http_method, url, header_params, request_body, _post = serialized
        response = self._api.call_api(
            http_method,
            url,
            header_params=header_params,
            body=request_body,
            _request_timeout=self._timeout,
        )
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiException(
                status=response.status, reason=response.reason, body=data.decode("utf-8", "replace") if data else None
            )
        if not data:
            return {}
        decoded = json.loads(data)
        return decoded if isinstance(decoded, dict) else {}

    # ------------------------------------------------------------------ reads
    def get(self, *, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self._request(
                verb="get", resource=kind.plural, method="GET", path=kind.object_path(namespace=namespace, name=name)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, *, kind: Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        result = self._request(
            verb="list", resource=kind.plural, method="GET", path=kind.collection_path(namespace=namespace), query=query
        )
        items = result.get("items") or []
        return [item for item in items if isinstance(item, dict)]

    def list_metadata(
        self, *, kind: Kind, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> tuple[Sequence[dict[str, Any]], str]:
        """The objects' metadata only (``PartialObjectMetadata``: the server sends no data) and
        the list's resourceVersion (where a watch resumes)."""
        query = [(k, v) for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v]
        result = self._request(
            verb="list",
            resource=kind.plural,
            method="GET",
            path=kind.collection_path(namespace=namespace),
            query=query,
            accept=METADATA_LIST,
        )
        items = [item for item in result.get("items") or [] if isinstance(item, dict)]
        return items, str((result.get("metadata") or {}).get("resourceVersion") or "")

    def watch_metadata(
        self, *, kind: Kind, namespace: str | None, label_selector: str, resource_version: str, timeout_seconds: int
    ) -> Iterator[dict[str, Any]]:
        """The watch events (``{"type", "object"}``, objects as metadata only) after
        ``resource_version``, until the server ends the watch (``timeout_seconds``); raises
        :class:`ApiException` for a refused watch. A 410 Gone arrives as an ``ERROR`` event."""
        if self._on_request is not None:
            self._on_request("watch", kind.plural)
        query = [
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_seconds)),
        ]
        if label_selector:
            query.append(("labelSelector", label_selector))
        method, url, headers, body, _post = self._api.param_serialize(
            method="GET",
            resource_path=kind.collection_path(namespace=namespace),
            query_params=query,
            header_params={"Accept": METADATA_ONLY},
            auth_settings=["BearerToken"],
        )
        response = self._api.call_api(
            method,
            url,
            header_params=headers,
            body=body,
            _request_timeout=(self._timeout, timeout_seconds + self._timeout),
        )
        raw = response.response
        try:
            if not 200 <= response.status < 300:
                data = response.read()
                raise ApiException(
                    status=response.status,
                    reason=response.reason,
                    body=data.decode("utf-8", "replace") if data else None,
                )
            buffer = b""
            for chunk in raw.stream(65536, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        event = json.loads(line)
                        if isinstance(event, dict):
                            yield event
        finally:
            raw.release_conn()

    # ------------------------------------------------------------------ writes
    def apply(self, *, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]:
        """Server-side apply of ``obj`` (its apiVersion/kind/metadata.name/namespace say where)."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        query = [("fieldManager", field_manager)]
        if force:
            query.append(("force", "true"))
        return self._request(
            verb="apply",
            resource=kind.plural,
            method="PATCH",
            path=kind.object_path(namespace=meta.get("namespace"), name=meta["name"]),
            query=query,
            body=dict(obj),
            content_type=APPLY_PATCH,
        )

    def merge_patch(
        self,
        *,
        kind: Kind,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        path = kind.object_path(namespace=namespace, name=name)
        if subresource:
            path = f"{path}/{subresource}"
        query = [("fieldManager", field_manager)] if field_manager else []
        resource = f"{kind.plural}/{subresource}" if subresource else kind.plural
        return self._request(
            verb="patch",
            resource=resource,
            method="PATCH",
            path=path,
            query=query,
            body=dict(patch),
            content_type=MERGE_PATCH,
        )

    def create(
        self, *, kind: Kind, namespace: str | None, obj: Mapping[str, Any], field_manager: str | None = None
    ) -> dict[str, Any]:
        query = [("fieldManager", field_manager)] if field_manager else []
        return self._request(
            verb="create",
            resource=kind.plural,
            method="POST",
            path=kind.collection_path(namespace=namespace),
            query=query,
            body=dict(obj),
        )

    def replace(
        self, *, kind: Kind, namespace: str | None, name: str, obj: Mapping[str, Any], field_manager: str | None = None
    ) -> dict[str, Any]:
        """PUT: fails with 409 when obj's metadata.resourceVersion is stale."""
        query = [("fieldManager", field_manager)] if field_manager else []
        return self._request(
            verb="update",
            resource=kind.plural,
            method="PUT",
            path=kind.object_path(namespace=namespace, name=name),
            query=query,
            body=dict(obj),
        )
