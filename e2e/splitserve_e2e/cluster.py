"""The facade: one object that is a running local Kubernetes cluster, or an existing one.

``LocalCluster`` starts (in order) etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok with fake GPU nodes, the kubelet node (kubelet, containerd, CNI bridge,
kube-proxy, and CoreDNS as the pods' cluster DNS on the bridge gateway:
:mod:`splitserve_e2e.kubeletnode`) and Prometheus, with logs and pid files in one
state directory; ``stop()`` ends them in reverse order and then kills anything still recorded
there. The control plane listens on loopback; with the kubelet node, the API server and
Prometheus also answer on the node's bridge gateway, where pods reach them.
``LocalCluster.from_existing(kubeconfig)`` wraps a cluster someone else runs: the same client
helpers, no process management, and :meth:`LocalCluster.container_pid` (which needs the node's
containerd) raises :class:`NodeUnavailable` saying why.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from splitserve_e2e import kubeconfig as kubeconfigs
from splitserve_e2e.apiserver import readyz_ok, start_apiserver
from splitserve_e2e.build import Binaries, cache_root, ensure_binaries
from splitserve_e2e.containerd import CtrClient, attached_containerd
from splitserve_e2e.controllers import start_controller_manager, start_scheduler
from splitserve_e2e.etcd import start_etcd
from splitserve_e2e.kubeletnode import KubeletNode
from splitserve_e2e.kwok import GpuNodeShape, create_gpu_nodes, node_ready, start_kwok
from splitserve_e2e.net import LOOPBACK
from splitserve_e2e.pki import ClusterPki, ensure_pki
from splitserve_e2e.process import ManagedProcess, kill_recorded, wait_until
from splitserve_e2e.prometheus import query as prometheus_query
from splitserve_e2e.prometheus import start_prometheus

T = TypeVar("T")
INFO_FILE = "cluster.json"
ENV_EXISTING_KUBECONFIG = "SPLITSERVE_E2E_KUBECONFIG"


class NodeUnavailable(RuntimeError):
    """A helper that needs this harness's kubelet node was used where there is none."""


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    num_gpu_nodes: int = 2
    gpu_product: str = "NVIDIA-H200"
    gpus_per_node: int = 8
    with_prometheus: bool = True
    scrape_interval_seconds: float = 2.0
    # the real node that runs the pods (kubelet, containerd, CNI bridge, kube-proxy; root
    # only; one per machine): see kubeletnode.py
    with_kubelet_node: bool = True
    kubelet_node_gpus: int = 4
    # NetworkPolicies enforced on the kubelet node (kube-router's policy controller: netpol.py)
    kubelet_node_network_policies: bool = True

    def __post_init__(self) -> None:
        if self.num_gpu_nodes < 0 or self.gpus_per_node < 0 or self.kubelet_node_gpus < 0:
            raise ValueError(f"node and GPU counts must be >= 0: {self}")
        if self.scrape_interval_seconds <= 0:
            raise ValueError("scrape_interval_seconds must be > 0")


def default_state_dir() -> Path:
    return cache_root() / "cluster"


class LocalCluster:
    """A local control plane (``start()``/``stop()``, or a context manager)."""

    def __init__(
        self,
        *,
        state_dir: Path | None = None,
        options: ClusterOptions | None = None,
        existing_kubeconfig: Path | None = None,
    ) -> None:
        self.options = options or ClusterOptions()
        self.managed = existing_kubeconfig is None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if state_dir is None and not self.managed:
            self._tmp = tempfile.TemporaryDirectory(prefix="splitserve-e2e-existing-")
            state_dir = Path(self._tmp.name)
        self.state_dir = (state_dir or default_state_dir()).resolve()
        self.kubeconfig: Path = existing_kubeconfig or self.state_dir / "admin.kubeconfig"
        self.prometheus_url: str | None = None
        self.pod_gateway: str | None = None
        """The kubelet node's bridge gateway: a host address its pods reach (None without)."""
        self.api_server_url: str = ""
        self.gpu_node_names: list[str] = []
        self.start_seconds: float = 0.0
        self._binaries: Binaries | None = None
        self._pki: ClusterPki | None = None
        self._processes: list[ManagedProcess] = []
        self.kubelet_node: KubeletNode | None = None
        self._stopped = False
        self._attached_containerd: CtrClient | None = None
        if not self.managed:
            self.api_server_url = kubeconfigs.server_of(kubeconfig=self.kubeconfig)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_existing(cls, *, kubeconfig: Path, prometheus_url: str | None = None) -> LocalCluster:
        """Wrap a running cluster; nothing is started or stopped."""
        if not kubeconfig.is_file():
            raise FileNotFoundError(f"kubeconfig {kubeconfig} does not exist")
        cluster = cls(existing_kubeconfig=kubeconfig.resolve())
        cluster.prometheus_url = prometheus_url
        return cluster

    @classmethod
    def attach(cls, *, state_dir: Path | None = None) -> LocalCluster:
        """Wrap the cluster that ``python -m splitserve_e2e up`` runs in ``state_dir``."""
        directory = (state_dir or default_state_dir()).resolve()
        info = read_info(state_dir=directory)
        cluster = cls.from_existing(kubeconfig=Path(info["kubeconfig"]), prometheus_url=info.get("prometheus_url"))
        cluster.pod_gateway = info.get("pod_gateway")
        if info.get("containerd_directory"):  # container pids through the node's containerd
            cluster._attached_containerd = attached_containerd(
                directory=Path(info["containerd_directory"]), root=Path(info["containerd_root"])
            )
        return cluster

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pid_dir(self) -> Path:
        return self.state_dir / "pids"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LocalCluster:
        if not self.managed:
            return self
        started = time.monotonic()
        self._binaries = ensure_binaries()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        leftovers = kill_recorded(pid_dir=self.pid_dir)
        if leftovers:
            _log(f"ended processes a previous run left behind: {leftovers}")
        for stale in ("etcd-data", "prometheus-data", "pods", "logs", INFO_FILE):
            path = self.state_dir / stale
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        atexit.register(self.stop)
        _install_sigterm_handler()
        try:
            self._start_components()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        self._write_info()
        return self

    def _start_components(self) -> None:
        binaries = self._binaries
        if binaries is None:
            raise RuntimeError("binaries missing")
        pki = self._pki = ensure_pki(directory=self.state_dir / "pki")
        etcd = start_etcd(
            binary=binaries.etcd, data_dir=self.state_dir / "etcd-data", log_dir=self.log_dir, pid_dir=self.pid_dir
        )
        self._processes.append(etcd.process)
        pod_reachable_address = None
        if self.options.with_kubelet_node:  # its bridge first: the API server advertises it
            self.kubelet_node = KubeletNode(
                directory=self.state_dir / "kn",
                pki=pki,
                api_client_factory=self.api_client,
                log_dir=self.log_dir,
                pid_dir=self.pid_dir,
                num_gpus=self.options.kubelet_node_gpus,
                network_policies=self.options.kubelet_node_network_policies,
            )
            self.kubelet_node.prepare()
            pod_reachable_address = self.pod_gateway = self.kubelet_node.network.gateway
        apiserver = start_apiserver(
            binary=binaries.kube_apiserver,
            etcd_url=etcd.client_url,
            pki=pki,
            log_dir=self.log_dir,
            pid_dir=self.pid_dir,
            pod_reachable_address=pod_reachable_address,
        )
        self._processes.append(apiserver.process)
        self.api_server_url = apiserver.url

        def write(name: str, pair: Any, user: str) -> Path:
            return kubeconfigs.write_cert_kubeconfig(
                path=self.state_dir / f"{name}.kubeconfig",
                server=apiserver.url,
                ca_cert=pki.ca_cert,
                client_cert=pair.cert,
                client_key=pair.key,
                user_name=user,
            )

        write("admin", pki.admin, "kubernetes-admin")
        kcm_config = write("controller-manager", pki.controller_manager, "system:kube-controller-manager")
        scheduler_config = write("scheduler", pki.scheduler, "system:kube-scheduler")
        self._processes.append(
            start_controller_manager(
                binary=binaries.kube_controller_manager,
                kubeconfig=kcm_config,
                pki=pki,
                log_dir=self.log_dir,
                pid_dir=self.pid_dir,
            )
        )
        self._processes.append(
            start_scheduler(
                binary=binaries.kube_scheduler, kubeconfig=scheduler_config, log_dir=self.log_dir, pid_dir=self.pid_dir
            )
        )
        core = self.core()
        wait_until(
            lambda: core.read_namespaced_service_account("default", "default") is not None,
            timeout_seconds=90,
            what="kube-controller-manager (default ServiceAccount)",
            alive=self._processes[-2],
        )
        if self.options.num_gpu_nodes:
            kwok = start_kwok(
                binary=binaries.kwok,
                stages=binaries.kwok_stages,
                kubeconfig=self.kubeconfig,
                log_dir=self.log_dir,
                pid_dir=self.pid_dir,
            )
            self._processes.append(kwok.process)
            shape = GpuNodeShape(gpus_per_node=self.options.gpus_per_node, gpu_product=self.options.gpu_product)
            self.gpu_node_names = create_gpu_nodes(core=core, count=self.options.num_gpu_nodes, shape=shape)
            wait_until(
                lambda: all(node_ready(core.read_node(n)) for n in self.gpu_node_names),
                timeout_seconds=60,
                what="kwok GPU nodes Ready",
                alive=kwok.process,
            )
        if self.kubelet_node is not None:
            self.kubelet_node.start(server_url=apiserver.url)
        if self.options.with_prometheus:
            prometheus = start_prometheus(
                binary=binaries.prometheus,
                api_server_url=apiserver.url,
                pki=pki,
                state_dir=self.state_dir,
                log_dir=self.log_dir,
                pid_dir=self.pid_dir,
                interval_seconds=self.options.scrape_interval_seconds,
                # with a kubelet node, on its bridge gateway: pods (the operator) reach it
                # there, the host too
                listen_host=pod_reachable_address or LOOPBACK,
            )
            self._processes.append(prometheus.process)
            self.prometheus_url = prometheus.url

    def stop(self) -> None:
        """End everything this object started (idempotent, safe from atexit)."""
        if not self.managed or self._stopped:
            return
        self._stopped = True
        if self.kubelet_node is not None:
            self.kubelet_node.stop()
        for process in reversed(self._processes):
            process.stop(grace_seconds=5.0)
        kill_recorded(pid_dir=self.pid_dir, grace_seconds=2.0)
        (self.state_dir / INFO_FILE).unlink(missing_ok=True)
        atexit.unregister(self.stop)

    def restart_component(self, name: str, *, timeout_seconds: float = 120.0) -> float:
        """Restart one control-plane process (``kube-apiserver``, ``prometheus``, ...) on the
        same address and wait until it answers again; returns the seconds it was away."""
        index = next((i for i, p in enumerate(self._processes) if p.name == name), None)
        if index is None:
            raise ValueError(f"no managed component {name!r} (have: {[p.name for p in self._processes]})")
        started = time.monotonic()
        process = self._processes[index] = self._processes[index].restart()
        pki = self._pki
        if name == "kube-apiserver" and pki is not None:
            wait_until(
                lambda: readyz_ok(url=self.api_server_url, pki=pki),
                timeout_seconds=timeout_seconds,
                what="kube-apiserver /readyz after restart",
                alive=process,
                interval_seconds=0.5,
            )
        elif name == "prometheus" and self.prometheus_url:
            url = self.prometheus_url
            wait_until(
                lambda: httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200,
                timeout_seconds=timeout_seconds,
                what="prometheus /-/ready after restart",
                alive=process,
            )
        return time.monotonic() - started

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _write_info(self) -> None:
        info = {
            "kubeconfig": str(self.kubeconfig),
            "api_server_url": self.api_server_url,
            "prometheus_url": self.prometheus_url,
            "gpu_nodes": self.gpu_node_names,
            "kubelet_node": self.kubelet_node.name if self.kubelet_node else None,
            "pod_network": str(self.kubelet_node.network.subnet) if self.kubelet_node else None,
            "pod_gateway": self.pod_gateway,
            "cluster_dns": (self.kubelet_node.dns.address if self.kubelet_node and self.kubelet_node.dns else None),
            "containerd_directory": (str(self.kubelet_node.containerd.layout.directory) if self.kubelet_node else None),
            "containerd_root": (str(self.kubelet_node.containerd.layout.root) if self.kubelet_node else None),
            "start_seconds": round(self.start_seconds, 1),
            "pid": os.getpid(),
        }
        # atomically: `up` polls for this file and reads it as soon as it exists (a plain
        # write_text let it read an empty file and fail with a JSONDecodeError)
        staging = self.state_dir / f".{INFO_FILE}.tmp"
        staging.write_text(json.dumps(info, indent=2))
        os.replace(staging, self.state_dir / INFO_FILE)

    # ------------------------------------------------------------------ clients
    def api_client(self) -> k8s.ApiClient:
        """A new Kubernetes API client authenticated as the admin."""
        if self.managed and self._pki is not None:
            configuration = k8s.Configuration()
            configuration.host = self.api_server_url
            configuration.ssl_ca_cert = str(self._pki.ca_cert)
            configuration.cert_file = str(self._pki.admin.cert)
            configuration.key_file = str(self._pki.admin.key)
            return k8s.ApiClient(configuration)
        client: k8s.ApiClient = k8s_config.new_client_from_config(config_file=str(self.kubeconfig))
        return client

    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api_client())

    def apps(self) -> k8s.AppsV1Api:
        return k8s.AppsV1Api(self.api_client())

    def custom(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api_client())

    def _binary(self, name: str) -> Path:
        if self._binaries is None:
            self._binaries = ensure_binaries()
        return Path(getattr(self._binaries, name))

    def kubectl(
        self, *args: str, input_text: str | None = None, check: bool = True, timeout_seconds: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster."""
        return self._run_tool("kubectl", list(args), input_text, check, timeout_seconds)

    def helm(
        self, *args: str, input_text: str | None = None, check: bool = True, timeout_seconds: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm against this cluster (its caches live in the state dir)."""
        return self._run_tool("helm", list(args), input_text, check, timeout_seconds)

    def _run_tool(
        self, tool: str, args: list[str], input_text: str | None, check: bool, timeout_seconds: float
    ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        if tool == "helm":
            for variable, sub in (
                ("HELM_CACHE_HOME", "cache"),
                ("HELM_CONFIG_HOME", "config"),
                ("HELM_DATA_HOME", "data"),
            ):
                env[variable] = str(self.state_dir / "helm" / sub)
        result = subprocess.run(
            [str(self._binary(tool)), *args],
            input=input_text,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_seconds,
            check=False,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, [tool, *args], result.stdout, result.stderr)
        return result

    def service_account_kubeconfig(
        self, *, namespace: str, service_account: str, expiration_seconds: int = 3600
    ) -> Path:
        """A kubeconfig authenticating as ``namespace/service_account`` (TokenRequest token),
        so that exactly that ServiceAccount's RBAC applies to its user."""
        request: Any = {"spec": {"audiences": [], "expirationSeconds": expiration_seconds}}
        token: Any = self.core().create_namespaced_service_account_token(service_account, namespace, request)
        if self._pki is not None:
            ca = self._pki.ca_cert
        else:  # the client library materialises inline CA data into a file for us
            ca_file = self.api_client().configuration.ssl_ca_cert
            if not ca_file:
                raise RuntimeError(f"{self.kubeconfig} names no certificate authority")
            ca = Path(ca_file)
        return kubeconfigs.write_token_kubeconfig(
            path=self.state_dir / "sa-kubeconfigs" / f"{namespace}.{service_account}.kubeconfig",
            server=self.api_server_url,
            ca_cert=ca,
            token=token.status.token,
            user_name=f"system:serviceaccount:{namespace}:{service_account}",
            namespace=namespace,
        )

    # ------------------------------------------------------------------ pods
    def pod_log(self, *, namespace: str, pod: str, container: str | None = None, previous: bool = False) -> str:
        """A pod's container log, through the API server (the kubelet serves it)."""
        core: Any = self.core()
        kwargs: dict[str, Any] = {"previous": previous}
        if container is not None:
            kwargs["container"] = container
        try:
            return str(core.read_namespaced_pod_log(pod, namespace, **kwargs))
        except ApiException as error:
            if error.status in (400, 404):  # not started yet, or gone
                return ""
            raise

    def container_pid(self, *, namespace: str, pod: str, container: str | None = None) -> int | None:
        """Host pid of the main process (tini, PID 1 in the container) of a running
        container of ``pod`` (its first container by default), or None when it does not run.
        SIGKILL to it ends the container as an OOM kill or a crash would."""
        containerd: CtrClient | None = (
            self.kubelet_node.containerd if self.kubelet_node is not None else self._attached_containerd
        )
        if containerd is None:
            why = (
                "this is an existing cluster not started by this harness (use "
                "LocalCluster.attach() for one started with `python -m splitserve_e2e up`)"
                if not self.managed
                else "it was started with with_kubelet_node=False"
            )
            raise NodeUnavailable(f"the kubelet node's containerd is not available: {why}")
        core: Any = self.core()
        try:
            status = core.read_namespaced_pod(pod, namespace).status
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        for found in status.container_statuses or []:
            if (
                (container is None or found.name == container)
                and found.container_id
                and found.state is not None
                and found.state.running is not None
            ):
                return containerd.tasks().get(found.container_id.removeprefix("containerd://"))
        return None

    # ------------------------------------------------------------------ helpers
    def endpoints_of(self, *, namespace: str, service: str, port_name: str | None = None) -> list[str]:
        """``ip:port`` of the ready endpoints of a Service, from its EndpointSlices (pod IPs
        on the kubelet node's bridge answer from the host)."""
        discovery: Any = k8s.DiscoveryV1Api(self.api_client())
        slices = discovery.list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={service}"
        )
        out: set[str] = set()
        for endpoint_slice in slices.items:
            ports = [p for p in endpoint_slice.ports or [] if port_name is None or p.name == port_name]
            for endpoint in endpoint_slice.endpoints or []:
                if endpoint.conditions is not None and endpoint.conditions.ready is False:
                    continue
                out.update(f"{a}:{p.port}" for a in endpoint.addresses for p in ports)
        return sorted(out)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Prometheus instant query (``data.result``)."""
        if not self.prometheus_url:
            raise RuntimeError("this cluster has no Prometheus (with_prometheus=False)")
        return prometheus_query(url=self.prometheus_url, promql=promql)

    @staticmethod
    def wait_for(
        predicate: Callable[[], T | None],
        *,
        timeout_seconds: float,
        interval_seconds: float = 0.25,
        what: str = "condition",
    ) -> T:
        """Poll until ``predicate()`` returns a truthy value and return it. API errors,
        connection errors (also httpx's) and missing keys count as "not yet"; the last error
        is in the TimeoutError."""
        deadline = time.monotonic() + timeout_seconds
        last_error: BaseException | None = None
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except (ApiException, OSError, httpx.TransportError, KeyError, IndexError) as error:
                last_error = error
            if time.monotonic() > deadline:
                detail = f" (last error: {last_error!r})" if last_error else ""
                raise TimeoutError(f"{what} not reached within {timeout_seconds:.0f}s{detail}")
            time.sleep(interval_seconds)


def read_info(*, state_dir: Path) -> dict[str, Any]:
    path = state_dir / INFO_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no running cluster in {state_dir} (no {INFO_FILE}); start one with `python -m splitserve_e2e up`"
        )
    return dict(json.loads(path.read_text()))


def _log(message: str) -> None:
    print(f"[splitserve-e2e] {message}", flush=True)


def _install_sigterm_handler() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so it ends a pytest session like Ctrl-C does
    (SystemExit inside a test only fails that test) and ``finally``/atexit stop the cluster."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
