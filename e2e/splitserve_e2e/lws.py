"""The LeaderWorkerSet (LWS) controller in the local cluster, built from its Go module.

A splitserve pool whose replica spans several nodes renders as a LeaderWorkerSet
(``leaderworkerset.x-k8s.io/v1``, ``sigs.k8s.io/lws``): per replica ("group") its controller
creates a leader pod and ``size - 1`` worker pods, and its *pod webhook* injects
``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` into each of them, which the
runtime's multi-node rendezvous reads. To test that against the real controller, without access
to its image (registry.k8s.io), everything comes from the pinned module ``sigs.k8s.io/lws@v0.7.0``:

* :func:`ensure_lws`: the controller (``cmd/main.go``, upstream's ``bin/manager``) built as
  upstream's Makefile builds it, ``CGO_ENABLED=0 go build`` inside a writable copy of the module
  (its own go.mod/go.sum; ``go install module@version`` asks the proxy for the version list,
  which is refused), plus its CRD (``config/crd/bases``) and webhook manifests
  (``config/webhook``: the generated configurations and the kustomize patches that give the
  pod webhooks their ``objectSelector``). Cached in ``~/.cache/splitserve/bin/lws-v0.7.0/``
  with the stamp, lock and heartbeat of :mod:`splitserve_e2e.build`.
* :func:`start_lws`: the controller as a host process against a cluster's API server, as the
  cluster admin (the harness's admin kubeconfig, not upstream's ``manager-role``), without
  leader election, its metrics and health probes on free loopback ports and its webhook server
  on ``127.0.0.1`` with a serving certificate from a throw-away CA made here (upstream's
  internal cert rotator, which wants a Secret and a Service in ``lws-system``, is off:
  ``internalCertManagement.enable: false`` in its ``--config`` file). The CRD is applied
  server-side and waited for (Established); the Mutating/ValidatingWebhookConfigurations are
  upstream's, with ``clientConfig.url`` pointing at the host process (the API server runs on
  the host too) and the CA bundle. Upstream's pod webhooks fail closed, but only for pods
  labelled ``leaderworkerset.sigs.k8s.io/name``; still, :meth:`LwsController.stop` removes the
  configurations *before* it stops the process, so that a stopped controller never blocks an
  API request.

LWS makes StatefulSets (one for the leaders, one per group for its workers), so the cluster must
run kube-controller-manager's ``statefulset-controller``; when the harness's controller manager
does not (:data:`splitserve_e2e.controllers.CONTROLLERS`), :func:`start_lws` runs a second one
with only that controller, and stops it with the LWS controller.

``python -m splitserve_e2e.lws`` builds everything (idempotent; quick when cached).
"""

from __future__ import annotations

import atexit
import base64
import copy
import dataclasses
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from kubernetes import client as k8s

from .build import (
    STAMP_NAME,
    BuildError,
    _is_complete,
    _log,
    _run_go,
    _ToolGroup,
    cache_root,
    download_module,
    ensure_binaries,
    exclusive,
    writable_module_copy,
)
from .controllers import CONTROLLERS
from .net import LOOPBACK, free_port
from .pki import _builder, _name, _new_key, _write_key
from .process import ManagedProcess, start_process, wait_until

if TYPE_CHECKING:
    from .cluster import LocalCluster

LWS_MODULE: Final = "sigs.k8s.io/lws"
LWS_VERSION: Final = "v0.7.0"
CONTROLLER_BINARY: Final = "lws-controller"
CRD_FILE: Final = "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
API_GROUP: Final = "leaderworkerset.x-k8s.io"
API_VERSION: Final = "v1"
PLURAL: Final = "leaderworkersets"
CRD_NAME: Final = f"{PLURAL}.{API_GROUP}"
FIELD_MANAGER: Final = "splitserve-e2e-lws"
WEBHOOK_FILES: Final = ("webhook-manifests.yaml", "webhook-mutating-patch.yaml", "webhook-validating-patch.yaml")
_MODULE_FILES: Final = {  # cache name -> path in the module
    CRD_FILE: f"config/crd/bases/{CRD_FILE}",
    "webhook-manifests.yaml": "config/webhook/manifests.yaml",
    "webhook-mutating-patch.yaml": "config/webhook/mutating-patch.yaml",
    "webhook-validating-patch.yaml": "config/webhook/validating-patch.yaml",
}
_PATCH_TARGETS: Final = {  # upstream's config/webhook/kustomization.yaml
    "MutatingWebhookConfiguration": "webhook-mutating-patch.yaml",
    "ValidatingWebhookConfiguration": "webhook-validating-patch.yaml",
}
NAME_PREFIX: Final = "lws-"  # config/default's namePrefix
STATEFULSET_CONTROLLER: Final = "statefulset-controller"

# the labels and env the controller and its pod webhook set (api/leaderworkerset/v1)
SET_NAME_LABEL: Final = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_ADDRESS_ENV: Final = "LWS_LEADER_ADDRESS"
GROUP_SIZE_ENV: Final = "LWS_GROUP_SIZE"
WORKER_INDEX_ENV: Final = "LWS_WORKER_INDEX"

_LDFLAGS: Final = (
    f"-ldflags=-s -w -X {LWS_MODULE}/pkg/version.GitVersion={LWS_VERSION} "
    f"-X {LWS_MODULE}/pkg/version.GitCommit=splitserve-e2e"
)
_BUILD_ARGS: Final = ("build", "-trimpath", _LDFLAGS, "-o", f"{{out}}/{CONTROLLER_BINARY}", "./cmd")


@dataclasses.dataclass(frozen=True)
class LwsArtifacts:
    """What :func:`ensure_lws` provides: the controller and upstream's manifests."""

    controller: Path
    crd: Path
    webhook_manifests: Path
    webhook_patches: Mapping[str, Path]
    """Kind (``MutatingWebhookConfiguration``, ...) -> its kustomize JSON-patch file."""


# --------------------------------------------------------------------------- build
def module_dir() -> Path:
    """The module's directory in the Go module cache (downloaded when missing)."""
    return download_module(LWS_MODULE, LWS_VERSION)


def _group() -> _ToolGroup:
    return _ToolGroup(
        name="lws",
        version=LWS_VERSION,
        binaries=(CONTROLLER_BINARY,),
        go_args=_BUILD_ARGS,
        workdir=None,
        extra_files=tuple(_MODULE_FILES),
    )


def _directory() -> Path:
    return cache_root() / "bin" / f"lws-{LWS_VERSION}"


def _artifacts(directory: Path) -> LwsArtifacts:
    return LwsArtifacts(
        controller=directory / CONTROLLER_BINARY,
        crd=directory / CRD_FILE,
        webhook_manifests=directory / "webhook-manifests.yaml",
        webhook_patches={kind: directory / name for kind, name in _PATCH_TARGETS.items()},
    )


def ensure_lws() -> LwsArtifacts:
    """Build the controller and copy its manifests once (cached; a cross-process lock makes
    concurrent callers wait for one build)."""
    group, directory = _group(), _directory()
    if _is_complete(group, directory):
        return _artifacts(directory)
    with exclusive(directory.with_name(directory.name + ".lock")):
        if _is_complete(group, directory):
            return _artifacts(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _log(f"building the LWS controller {LWS_VERSION} into {directory} (Go is quiet for minutes on a cold cache)")
        started = time.monotonic()
        source = module_dir()
        env = dict(os.environ, CGO_ENABLED="0")
        env.setdefault("GOFLAGS", "-buildvcs=false")
        args = [arg.replace("{out}", str(directory)) for arg in _BUILD_ARGS]
        _run_go(
            args=args,
            workdir=writable_module_copy(source, name=f"lws-{LWS_VERSION}"),
            env=env,
            label=f"lws-{LWS_VERSION}",
        )
        for name, relative in _MODULE_FILES.items():
            shutil.copyfile(source / relative, directory / name)
            (directory / name).chmod(0o644)
        elapsed = time.monotonic() - started
        if not os.access(directory / CONTROLLER_BINARY, os.X_OK):
            raise BuildError(f"go finished but {CONTROLLER_BINARY} is missing in {directory}")
        (directory / STAMP_NAME).write_text(
            json.dumps(
                {
                    "version": group.version,
                    "recipe": list(group.go_args),
                    "binaries": list(group.binaries),
                    "build_seconds": round(elapsed, 1),
                    "built_at": time.time(),
                }
            )
        )
        _log(f"built the LWS controller {LWS_VERSION} in {elapsed:.0f}s")
    return _artifacts(directory)


def recorded_build_seconds() -> float | None:
    """The recorded build duration (None when not built yet)."""
    stamp = _directory() / STAMP_NAME
    if not stamp.is_file():
        return None
    return float(json.loads(stamp.read_text()).get("build_seconds", 0.0))


# --------------------------------------------------------------------------- webhook manifests
def _apply_json_patch(document: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """The subset of RFC 6902 upstream's webhook patches use: ``replace`` (and ``add``) at
    ``/webhooks/<index>``."""
    out = copy.deepcopy(document)
    for operation in patch:
        op, path = operation.get("op"), str(operation.get("path", ""))
        parts = path.strip("/").split("/")
        if op not in ("replace", "add") or len(parts) != 2 or parts[0] != "webhooks":
            raise ValueError(f"unsupported webhook patch {operation!r} (only replace/add at /webhooks/<index>)")
        webhooks = out.setdefault("webhooks", [])
        index = len(webhooks) if parts[1] == "-" else int(parts[1])
        if op == "replace":
            webhooks[index] = copy.deepcopy(operation["value"])
        else:
            webhooks.insert(index, copy.deepcopy(operation["value"]))
    return out


def webhook_configurations(artifacts: LwsArtifacts, *, base_url: str, ca_bundle: bytes) -> list[dict[str, Any]]:
    """Upstream's Mutating/ValidatingWebhookConfigurations as its kustomization makes them (the
    pod webhooks' ``objectSelector`` patches, the ``lws-`` name prefix), but calling
    ``base_url`` + each webhook's path directly (``clientConfig.url``) and trusting
    ``ca_bundle`` (PEM) instead of a Service that cert-manager or the rotator fills in."""
    documents = [d for d in yaml.safe_load_all(artifacts.webhook_manifests.read_text()) if d]
    out: list[dict[str, Any]] = []
    for document in documents:
        kind = document["kind"]
        patch_file = artifacts.webhook_patches.get(kind)
        if patch_file is not None:
            document = _apply_json_patch(document, yaml.safe_load(patch_file.read_text()))
        document["metadata"]["name"] = NAME_PREFIX + document["metadata"]["name"]
        document["metadata"].setdefault("labels", {})["app.kubernetes.io/part-of"] = "lws"
        for webhook in document["webhooks"]:
            service = webhook["clientConfig"].get("service")
            if service is None or "path" not in service:
                raise ValueError(f"webhook {webhook.get('name')} names no service path")
            webhook["clientConfig"] = {
                "url": base_url.rstrip("/") + service["path"],
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
        out.append(document)
    return out


# --------------------------------------------------------------------------- serving certificate
@dataclasses.dataclass(frozen=True)
class WebhookCertificate:
    """A serving certificate for the webhook server (``tls.crt``/``tls.key`` in ``cert_dir``,
    the names controller-runtime reads) and the PEM of the CA that signed it."""

    cert_dir: Path
    ca_pem: bytes


def make_webhook_certificate(*, directory: Path, host: str) -> WebhookCertificate:
    """A throw-away CA and a serving certificate for ``host`` (an IP or DNS name) signed by it
    (the key and name helpers of :mod:`.pki`); a fresh pair per start: the API server learns
    the CA from the webhook configurations."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, key = _new_key(), _new_key()
    ca_name = _name("splitserve-e2e-lws-webhook-ca")
    usage = {
        name: False
        for name in (
            "digital_signature",
            "key_encipherment",
            "content_commitment",
            "data_encipherment",
            "key_agreement",
            "key_cert_sign",
            "crl_sign",
            "encipher_only",
            "decipher_only",
        )
    }
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(**(usage | {"digital_signature": True, "key_cert_sign": True, "crl_sign": True})),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        san = x509.DNSName(host)
    cert = (
        _builder(_name("lws-webhook"), ca_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(**(usage | {"digital_signature": True})), critical=True)
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(directory / "tls.key", key)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    (directory / "ca.crt").write_bytes(ca_pem)
    return WebhookCertificate(cert_dir=directory, ca_pem=ca_pem)


# --------------------------------------------------------------------------- the controller
def controller_configuration(
    *, webhook_host: str, webhook_port: int, cert_dir: Path, metrics_address: str, health_address: str
) -> dict[str, Any]:
    """The controller's component config (``--config``): no leader election, no internal cert
    management (the harness made the certificate), its listeners where the harness says."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": webhook_host, "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": metrics_address},
        "health": {"healthProbeBindAddress": health_address},
    }


@dataclasses.dataclass
class LwsController:
    """A running LWS controller (:func:`start_lws`); :meth:`stop` (idempotent) removes its
    webhook configurations first, then ends the process (and the StatefulSet controller it
    brought along, if any)."""

    process: ManagedProcess
    webhook_url: str
    """``https://HOST:PORT``, where the API server calls the webhooks."""
    metrics_url: str
    """``https://127.0.0.1:PORT/metrics`` (authenticated: a bearer token with RBAC for it)."""
    health_url: str
    webhook_configurations: tuple[tuple[str, str], ...]
    """(kind, name) of each webhook configuration registered."""
    kubectl: Callable[..., subprocess.CompletedProcess[str]]
    """``LocalCluster.kubectl`` of the cluster it runs against."""
    api_server_url: str = ""
    statefulset_controller: ManagedProcess | None = None
    start_seconds: float = 0.0
    _stopped: bool = False

    def remove_webhooks(self) -> None:
        """Delete the webhook configurations (missing ones are fine)."""
        for kind, name in self.webhook_configurations:
            self.kubectl("delete", kind.lower(), name, "--ignore-not-found", "--wait=false", check=False)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        if _RUNNING.get(self.api_server_url) is self:
            del _RUNNING[self.api_server_url]
        try:
            self.remove_webhooks()
        finally:
            self.process.stop(grace_seconds=5.0)
            if self.statefulset_controller is not None:
                self.statefulset_controller.stop(grace_seconds=5.0)

    def __enter__(self) -> LwsController:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


_RUNNING: dict[str, LwsController] = {}
"""API server URL -> the controller this process runs against it."""


def _needs_statefulset_controller(cluster: LocalCluster) -> bool:
    """The harness's controller manager (on loopback) lacks the StatefulSet controller."""
    host = urllib.parse.urlparse(cluster.api_server_url).hostname or ""
    try:
        on_host = ipaddress.ip_address(host).is_loopback
    except ValueError:
        on_host = host == "localhost"
    return on_host and STATEFULSET_CONTROLLER not in CONTROLLERS


def start_statefulset_controller(cluster: LocalCluster) -> ManagedProcess:
    """kube-controller-manager with only ``statefulset-controller`` (LWS's pods come from
    StatefulSets), the cluster's kubeconfig, each controller under its own ServiceAccount."""
    binary = ensure_binaries().kube_controller_manager
    argv = [
        str(binary),
        f"--kubeconfig={cluster.kubeconfig}",
        f"--controllers={STATEFULSET_CONTROLLER}",
        "--use-service-account-credentials=true",
        "--leader-elect=false",
        "--secure-port=0",
        "--profiling=false",
        "--v=1",
    ]
    return start_process(
        name="kube-controller-manager-statefulset",
        argv=argv,
        log_path=cluster.log_dir / "kube-controller-manager-statefulset.log",
        pid_dir=cluster.pid_dir,
    )


def _crd_established(cluster: LocalCluster) -> bool:
    crd: Any = k8s.ApiextensionsV1Api(cluster.api_client()).read_custom_resource_definition(CRD_NAME)
    return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))


def install_crd(cluster: LocalCluster, artifacts: LwsArtifacts, *, timeout_seconds: float = 60.0) -> None:
    """Apply upstream's CRD server-side (1.2 MB: too big for client-side apply's annotation)
    and wait until it is Established."""
    cluster.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        f"--field-manager={FIELD_MANAGER}",
        "-f",
        str(artifacts.crd),
        timeout_seconds=120.0,
    )
    wait_until(
        lambda: _crd_established(cluster),
        timeout_seconds=timeout_seconds,
        what=f"CRD {CRD_NAME} Established",
        interval_seconds=0.3,
    )


def probe_lws(namespace: str = "default") -> dict[str, Any]:
    """A minimal LeaderWorkerSet for a server-side dry run, which runs both LWS webhooks."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "splitserve-webhook-probe", "namespace": namespace},
        "spec": {
            "replicas": 0,
            "leaderWorkerTemplate": {
                "size": 1,
                "workerTemplate": {"spec": {"containers": [{"name": "probe", "image": "probe"}]}},
            },
        },
    }


def _webhooks_answer(cluster: LocalCluster) -> bool:
    """A dry-run create passes the validating webhook and shows the mutating one's defaults
    (``networkConfig.subdomainPolicy``: no CRD default sets it)."""
    created: Any = cluster.custom().create_namespaced_custom_object(
        API_GROUP, API_VERSION, "default", PLURAL, probe_lws(), dry_run="All"
    )
    return bool(created.get("spec", {}).get("networkConfig", {}).get("subdomainPolicy"))


def start_lws(
    cluster: LocalCluster,
    *,
    webhook_host: str = LOOPBACK,
    statefulset_controller: bool | None = None,
    verbosity: int = 2,
    start_timeout_seconds: float = 90.0,
) -> LwsController:
    """Run the LWS controller on the host against ``cluster`` (as its admin; see the module
    docstring) and register its webhooks at ``https://webhook_host:<free port>``, an address
    the API server reaches (loopback: the harness's API server runs on the host).
    ``statefulset_controller`` None: start one when the harness's controller manager lacks it.
    Returns once the CRD is Established and a server-side dry run passes both LWS webhooks."""
    running = _RUNNING.get(cluster.api_server_url)
    if running is not None:
        raise RuntimeError(
            f"an LWS controller (pid {running.process.pid}) already runs against "
            f"{cluster.api_server_url}; two would both reconcile every "
            "LeaderWorkerSet and fight over the webhook configurations: reuse "
            "it or stop it first"
        )
    started = time.monotonic()
    artifacts = ensure_lws()
    install_crd(cluster, artifacts)
    directory = Path(tempfile.mkdtemp(prefix="lws-", dir=_state_dir(cluster)))
    certificate = make_webhook_certificate(directory=directory / "certs", host=webhook_host)
    webhook_port, metrics_port, health_port = free_port(), free_port(), free_port()
    config_path = directory / "config.yaml"
    config_path.write_text(
        yaml.safe_dump(
            controller_configuration(
                webhook_host=webhook_host,
                webhook_port=webhook_port,
                cert_dir=certificate.cert_dir,
                metrics_address=f"{LOOPBACK}:{metrics_port}",
                health_address=f"{LOOPBACK}:{health_port}",
            )
        )
    )
    if statefulset_controller is None:
        statefulset_controller = _needs_statefulset_controller(cluster)
    sts_process = start_statefulset_controller(cluster) if statefulset_controller else None
    argv = (
        str(artifacts.controller),
        f"--config={config_path}",
        "--leader-elect=false",
        f"--zap-log-level={verbosity}",
        "--zap-devel=false",
    )
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    process = start_process(
        name="lws-controller",
        argv=argv,
        env=env,
        log_path=cluster.log_dir / "lws-controller.log",
        pid_dir=cluster.pid_dir,
    )
    webhook_url = f"https://{_url_host(webhook_host)}:{webhook_port}"
    configurations = webhook_configurations(artifacts, base_url=webhook_url, ca_bundle=certificate.ca_pem)
    controller = LwsController(
        process=process,
        webhook_url=webhook_url,
        metrics_url=f"https://{LOOPBACK}:{metrics_port}/metrics",
        health_url=f"http://{LOOPBACK}:{health_port}",
        webhook_configurations=tuple((c["kind"], c["metadata"]["name"]) for c in configurations),
        kubectl=cluster.kubectl,
        api_server_url=cluster.api_server_url,
        statefulset_controller=sts_process,
    )
    _RUNNING[cluster.api_server_url] = controller
    atexit.register(controller.stop)
    try:
        health = controller.health_url
        wait_until(
            lambda: httpx.get(f"{health}/readyz", timeout=2.0).status_code == 200,
            alive=process,
            timeout_seconds=start_timeout_seconds,
            what="the LWS controller's /readyz",
        )
        trust = ssl.create_default_context(cadata=certificate.ca_pem.decode())
        wait_until(
            lambda: httpx.get(f"{webhook_url}/", verify=trust, timeout=2.0).status_code == 404,
            alive=process,
            timeout_seconds=start_timeout_seconds,
            what="the LWS webhook server (TLS with the harness's certificate)",
        )
        cluster.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={FIELD_MANAGER}",
            "-f",
            "-",
            input_text="\n---\n".join(json.dumps(c) for c in configurations),
        )
        wait_until(
            lambda: _webhooks_answer(cluster),
            alive=process,
            timeout_seconds=start_timeout_seconds,
            what="a dry-run LeaderWorkerSet through the LWS webhooks",
        )
    except BaseException:
        controller.stop()
        raise
    controller.start_seconds = time.monotonic() - started
    return controller


def _state_dir(cluster: LocalCluster) -> Path:
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    return cluster.state_dir


def _url_host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def main() -> int:
    started = time.monotonic()
    try:
        artifacts = ensure_lws()
    except BuildError as error:
        _log(f"FAILED: {error}")
        return 1
    print(f"{'controller':24} {artifacts.controller}")
    print(f"{'crd':24} {artifacts.crd}")
    print(f"{'webhook manifests':24} {artifacts.webhook_manifests}")
    seconds = recorded_build_seconds()
    if seconds is not None:
        print(f"build time lws-{LWS_VERSION:17} {seconds:.0f}s")
    print(f"ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
