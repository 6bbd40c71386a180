"""The "local node": a minimal kubelet that runs pods as local processes.

Pods that must really serve (the runtime, the router, the operator) need a node that runs
them, and there is no container engine here. This agent registers Node ``splitserve-local``
and, for every pod bound to it, runs the single container's command as a process in its own
session, on its own loopback address 127.0.x.y published as the pod IP, with the pod's
environment, its readiness/liveness/startup probes, restarts counted in ``restartCount``, and
graceful deletion (SIGTERM, SIGKILL after the grace period, then the pod is removed), and
EndpointSlices for the Services that select them (:mod:`splitserve_e2e.localslices`). A pod
that asks for something a process cannot honour (see :mod:`splitserve_e2e.podspec`) gets a
Warning Event and a waiting reason naming it, and does not start.

The agent is one thread polling its pods (a list served from the API server's watch cache,
every ``SYNC_PERIOD_SECONDS``) and running due probes; that keeps the logic sequential and
easy to reason about. It uses admin credentials; pods with a ServiceAccount token get a
kubeconfig built from a TokenRequest for that ServiceAccount, so RBAC applies to them.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from splitserve_e2e import podspec
from splitserve_e2e.kubeconfig import write_token_kubeconfig
from splitserve_e2e.localslices import SliceMirror
from splitserve_e2e.net import LOOPBACK
from splitserve_e2e.process import ManagedProcess, is_alive, process_start_ticks, start_process

log = logging.getLogger(__name__)

NODE_NAME = "splitserve-local"
LOCAL_NODE_LABEL = "splitserve.dev/local-node"
GPU_RESOURCE = "nvidia.com/gpu"
COMPONENT = "splitserve-local-node"
SYNC_PERIOD_SECONDS = 0.3
LEASE_DURATION_SECONDS = 40
LEASE_RENEW_SECONDS = 10.0
NODE_STATUS_SECONDS = 30.0
TOKEN_SECONDS = 3600
SLICE_SYNC_SECONDS = 1.0
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 10.0)
UNSUPPORTED_CONDITION = "splitserve.dev/LocalNodeSupported"
TERMINATION_LOG_LINES = 80
TERMINATION_LOG_BYTES = 2048


def _body(document: dict[str, Any]) -> Any:
    """The client serialises plain dicts as they are; its stubs only name the model classes."""
    return document


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclasses.dataclass
class _Probe:
    """Runtime state of one probe of one container."""

    spec: dict[str, Any]
    next_due: float
    successes: int = 0
    failures: int = 0

    @property
    def period_seconds(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def success_threshold(self) -> int:
        return int(self.spec.get("successThreshold", 1))

    @property
    def failure_threshold(self) -> int:
        return int(self.spec.get("failureThreshold", 3))


@dataclasses.dataclass
class _PodRun:
    """Everything the agent tracks about one pod it runs."""

    uid: str
    namespace: str
    name: str
    ip: str
    directory: Path
    log_path: Path
    process: ManagedProcess | None = None
    started_at: str = ""
    pod_start_time: str = ""
    restart_count: int = 0
    last_termination: dict[str, Any] | None = None
    ready: bool = False
    started: bool = False  # startupProbe passed (or none)
    restart_not_before: float = 0.0
    waiting_reason: str = ""
    waiting_message: str = ""
    phase: str = "Pending"
    terminating_deadline: float | None = None
    kill_deadline: float | None = None  # liveness/startup failure: SIGKILL after this
    pre_stop_until: float | None = None
    probes: dict[str, _Probe] = dataclasses.field(default_factory=dict)
    last_status: dict[str, Any] | None = None
    refused: bool = False
    events_sent: set[str] = dataclasses.field(default_factory=set)



def _write_items(directory: Path, source: Mapping[str, Any], data: Mapping[str, bytes], *, mode: int) -> None:
    """The files of a configMap or secret volume: ``source.items`` (key -> path) or every key."""
    items = source.get("items") or [{"key": k, "path": k} for k in data]
    for item in items:
        if item["key"] in data:
            target = directory / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[item["key"]])
            target.chmod(mode)


class LocalNode:
    """The local node agent. ``start()`` registers the node and starts the sync thread;
    ``stop()`` ends every pod process and the thread."""

    def __init__(self, *, api_client_factory: Callable[[], k8s.ApiClient], server_url: str,
                 ca_cert: Path, state_dir: Path, pid_dir: Path, num_gpus: int = 4,
                 cpu_cores: int = 16, memory: str = "64Gi", max_pods: int = 110) -> None:
        if num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
        self._api = api_client_factory()
        self._core = k8s.CoreV1Api(self._api)
        self._coordination = k8s.CoordinationV1Api(self._api)
        self._server_url = server_url
        self._ca_cert = ca_cert
        self._pods_dir = state_dir / "pods"
        self._pid_dir = pid_dir
        self._capacity = {"cpu": str(cpu_cores), "memory": memory, "pods": str(max_pods),
                          GPU_RESOURCE: str(num_gpus)}
        self._runs: dict[str, _PodRun] = {}
        self._ips_in_use: set[str] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_lease = 0.0
        self._last_node_status = 0.0
        self._slices = SliceMirror(api=self._api, node_name=NODE_NAME)
        self._last_slice_sync = 0.0
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ public surface
    @property
    def name(self) -> str:
        return NODE_NAME

    def start(self) -> None:
        self._register_node()
        self._renew_lease()
        self._thread = threading.Thread(target=self._loop, name="splitserve-local-node",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop syncing and end every pod process (SIGTERM, then SIGKILL after 5 s)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        with self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
        for run in runs:
            if run.process is not None:
                run.process.stop(grace_seconds=5.0)

    def pod_log(self, *, namespace: str, pod: str) -> str:
        """stdout+stderr of the newest pod ``namespace/pod`` that ran here ('' if none)."""
        return read_pod_log(pods_dir=self._pods_dir, namespace=namespace, pod=pod)

    def pod_pid(self, *, namespace: str, pod: str) -> int | None:
        """pid of the running process of ``namespace/pod``, or None."""
        with self._lock:
            for run in self._runs.values():
                if run.namespace == namespace and run.name == pod and run.process is not None:
                    return run.process.pid if run.process.running() else None
        return None

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ------------------------------------------------------------------ node and lease
    def _register_node(self) -> None:
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE_NAME, "labels": {
                LOCAL_NODE_LABEL: "true", "kubernetes.io/hostname": NODE_NAME,
                "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
            "spec": {},
        }
        try:
            self._core.create_node(_body(node))
        except ApiException as error:
            if error.status != 409:
                raise
        self._patch_node_status()

    def _patch_node_status(self) -> None:
        now = _now()
        status = {
            "capacity": self._capacity, "allocatable": self._capacity,
            "addresses": [{"type": "InternalIP", "address": LOOPBACK},
                          {"type": "Hostname", "address": NODE_NAME}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "LocalNodeReady",
                            "message": "splitserve local node agent is syncing pods",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "nodeInfo": {"kubeletVersion": "v1.34.4-splitserve-local", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "local-process://1",
                         "kernelVersion": os.uname().release, "osImage": "local processes",
                         "machineID": "", "systemUUID": "", "bootID": "",
                         "kubeProxyVersion": ""},
        }
        self._core.patch_node_status(NODE_NAME, {"status": status})
        self._last_node_status = time.monotonic()

    def _renew_lease(self) -> None:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": NODE_NAME, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": NODE_NAME,
                         "leaseDurationSeconds": LEASE_DURATION_SECONDS,
                         "renewTime": _now_micro()}}
        try:
            self._coordination.patch_namespaced_lease(NODE_NAME, "kube-node-lease",
                                                      {"spec": body["spec"]})
        except ApiException as error:
            if error.status != 404:
                raise
            self._coordination.create_namespaced_lease("kube-node-lease", _body(body))
        self._last_lease = time.monotonic()

    # ------------------------------------------------------------------ main loop
    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if time.monotonic() - self._last_lease > LEASE_RENEW_SECONDS:
                    self._renew_lease()
                if time.monotonic() - self._last_node_status > NODE_STATUS_SECONDS:
                    self._patch_node_status()
                self._sync_once()
                self._error = None
            except Exception as error:  # noqa: BLE001 - keep the node alive, log and retry
                self._error = error
                log.exception("local node sync failed")
            self._stopping.wait(SYNC_PERIOD_SECONDS)

    def _list_pods(self) -> list[dict[str, Any]]:
        response: Any = self._core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={NODE_NAME}", resource_version="0",
            _preload_content=False)
        return list(json.loads(response.data)["items"])

    def _sync_once(self) -> None:
        pods = self._list_pods()
        seen: set[str] = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            try:
                self._sync_pod(pod)
            except ApiException as error:  # one pod's API trouble must not stall the others
                if error.status not in (404, 409):
                    log.warning("syncing pod %s/%s: %s %s", pod["metadata"]["namespace"],
                                pod["metadata"]["name"], error.status, error.reason)
        if time.monotonic() - self._last_slice_sync > SLICE_SYNC_SECONDS:
            self._slices.sync(pods=pods)
            self._last_slice_sync = time.monotonic()
        with self._lock:
            gone = [uid for uid in self._runs if uid not in seen]
        for uid in gone:  # deleted behind our back (force delete): end the process
            self._forget(uid, grace_seconds=2.0)

    def _forget(self, uid: str, *, grace_seconds: float) -> None:
        with self._lock:
            run = self._runs.pop(uid, None)
        if run is None:
            return
        if run.process is not None:
            run.process.stop(grace_seconds=grace_seconds)
        self._ips_in_use.discard(run.ip)

    # ------------------------------------------------------------------ one pod
    def _sync_pod(self, pod: dict[str, Any]) -> None:
        metadata = pod["metadata"]
        uid = metadata["uid"]
        phase = (pod.get("status") or {}).get("phase")
        with self._lock:
            run = self._runs.get(uid)
        if run is None:
            if phase in ("Succeeded", "Failed"):
                if metadata.get("deletionTimestamp"):
                    self._delete_pod(pod)
                return
            run = self._admit(pod)
        if metadata.get("deletionTimestamp"):
            self._terminate(pod, run)
            return
        if run.refused:
            self._publish_status(pod, run)
            return
        if (run.kill_deadline is not None and run.process is not None
                and time.monotonic() > run.kill_deadline):
            _signal_group(run.process.pid, signal.SIGKILL)
        if run.process is None or not run.process.running():
            run.kill_deadline = None
            self._handle_exit_and_start(pod, run)
        if run.process is not None and run.process.running():
            self._run_probes(pod, run)
        self._publish_status(pod, run)

    def _admit(self, pod: dict[str, Any]) -> _PodRun:
        metadata = pod["metadata"]
        uid, namespace, name = metadata["uid"], metadata["namespace"], metadata["name"]
        directory = self._pods_dir / namespace / f"{name}_{uid[:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        run = _PodRun(uid=uid, namespace=namespace, name=name, ip="", directory=directory,
                      log_path=directory / "container.log", pod_start_time=_now())
        problems = podspec.unsupported_features(pod)
        if problems:
            run.refused = True
            run.waiting_reason = "Unsupported"
            run.waiting_message = ("the splitserve local node cannot run this pod: "
                                   + "; ".join(problems))
            self._event(pod, run, reason="Unsupported", message=run.waiting_message,
                        warning=True)
        else:
            run.ip = self._allocate_ip(pod)
            volumes = [v["name"] for v in pod["spec"].get("volumes") or [] if "emptyDir" in v]
            if volumes:
                self._event(pod, run, reason="EmptyDirNotIsolated", warning=False, message=(
                    f"emptyDir volumes {volumes} are local directories under {directory}; "
                    "arguments and env values starting with their mountPath are rewritten to "
                    "them; they are not isolated from the host filesystem"))
        with self._lock:
            self._runs[uid] = run
        return run

    def _allocate_ip(self, pod: dict[str, Any]) -> str:
        """A loopback address 127.x.y.z (never 127.0.0.x) whose container ports are free.

        Addresses are drawn at random so that two clusters on one machine rarely collide; the
        bind check catches the rest."""
        ports = [int(p["containerPort"]) for p in pod["spec"]["containers"][0].get("ports") or []]
        for _ in range(200):
            candidate = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(2, 254)}"
            if candidate in self._ips_in_use:
                continue
            if all(_bindable(candidate, port) for port in ports or [8000]):
                self._ips_in_use.add(candidate)
                return candidate
        raise RuntimeError("no free loopback address for a pod after 200 tries")

    # ------------------------------------------------------------------ process lifecycle
    def _handle_exit_and_start(self, pod: dict[str, Any], run: _PodRun) -> None:
        now = time.monotonic()
        policy = pod["spec"].get("restartPolicy", "Always")
        if run.process is not None:  # it exited
            code = run.process.popen.returncode
            run.process.stop(grace_seconds=0.5)
            run.last_termination = {"terminated": {
                "exitCode": code if code is not None and code >= 0 else 128 + abs(code or 0),
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": run.started_at, "finishedAt": _now()}}
            container = pod["spec"]["containers"][0]
            if code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                # kubelet: no termination message file here, so the tail of the log
                message = log_tail(run.log_path)
                if message:
                    run.last_termination["terminated"]["message"] = message
            run.process = None
            run.ready = False
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                run.phase = "Succeeded" if code == 0 else "Failed"
                return
            delay = RESTART_BACKOFF_SECONDS[min(run.restart_count,
                                                len(RESTART_BACKOFF_SECONDS) - 1)]
            run.restart_not_before = now + delay
            run.restart_count += 1
            run.waiting_reason = "CrashLoopBackOff"
            run.waiting_message = f"back-off {delay:.0f}s restarting failed container"
        if run.phase in ("Succeeded", "Failed") or now < run.restart_not_before:
            return
        self._start_container(pod, run)

    def _start_container(self, pod: dict[str, Any], run: _PodRun) -> None:
        try:
            env = podspec.container_environment(pod=pod, pod_ip=run.ip, host_ip=LOOPBACK,
                                                lookup=self._lookup)
        except podspec.PodConfigError as error:
            run.waiting_reason = "CreateContainerConfigError"
            run.waiting_message = str(error)
            self._event(pod, run, reason="Failed", message=f"Error: {error}", warning=True)
            return
        env.setdefault("POD_IP", run.ip)
        env.setdefault("HOSTNAME", run.name)
        rewrites = self._prepare_volumes(pod, run)
        argv = [_rewrite(word, rewrites) for word in podspec.container_argv(pod=pod, env=env)]
        env = {key: _rewrite(value, rewrites) for key, value in env.items()}
        process_env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        kubeconfig = self._service_account_kubeconfig(pod, run)
        if kubeconfig is not None:
            process_env["KUBECONFIG"] = str(kubeconfig)
        process_env.update(env)
        executable = _resolve_executable(argv[0], process_env.get("PATH", ""))
        if executable is None:
            run.waiting_reason = "CreateContainerError"
            run.waiting_message = f"executable {argv[0]!r} not found on PATH"
            self._event(pod, run, reason="Failed", message=run.waiting_message, warning=True)
            return
        container = pod["spec"]["containers"][0]
        working_dir = Path(container["workingDir"]) if container.get("workingDir") else run.directory
        if not working_dir.is_dir():
            working_dir = run.directory
        run.process = start_process(
            name=f"pod-{run.namespace}-{run.name}-{run.uid[:8]}", argv=[executable, *argv[1:]],
            log_path=run.log_path, pid_dir=self._pid_dir, env=process_env, cwd=working_dir)
        run.started_at = _now()
        run.waiting_reason = run.waiting_message = ""
        run.phase = "Running"
        run.ready = "readinessProbe" not in container
        run.started = "startupProbe" not in container
        now = time.monotonic()
        run.probes = {kind: _Probe(spec=container[kind],
                                   next_due=now + float(container[kind].get("initialDelaySeconds", 0)))
                      for kind in ("startupProbe", "readinessProbe", "livenessProbe")
                      if kind in container}
        self._event(pod, run, reason="Started", warning=False, once=False,
                    message=f"Started process {run.process.pid} on {run.ip}: {' '.join(argv)[:300]}")

    def _prepare_volumes(self, pod: dict[str, Any], run: _PodRun) -> dict[str, str]:
        """Create emptyDir/configMap/secret volume directories; return mountPath -> local path."""
        container = pod["spec"]["containers"][0]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        rewrites: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            if podspec.is_service_account_volume(volume):
                continue
            local = run.directory / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                source = volume["configMap"]
                text = self._lookup("ConfigMap", run.namespace, source["name"]) or {}
                _write_items(local, source, {k: v.encode() for k, v in text.items()}, mode=0o644)
            if "secret" in volume:
                source = volume["secret"]
                _write_items(local, source, self._secret_bytes(run.namespace, source["secretName"]),
                             mode=0o400)
            rewrites[mount["mountPath"].rstrip("/")] = str(local)
        return rewrites

    def _service_account_kubeconfig(self, pod: dict[str, Any], run: _PodRun) -> Path | None:
        spec = pod["spec"]
        if not any(podspec.is_service_account_volume(v) for v in spec.get("volumes") or []):
            return None
        account = spec.get("serviceAccountName") or "default"
        token: Any = self._core.create_namespaced_service_account_token(
            account, run.namespace, _body({"spec": {
                "audiences": [], "expirationSeconds": TOKEN_SECONDS,
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": run.name,
                                   "uid": run.uid}}}))
        return write_token_kubeconfig(
            path=run.directory / "kubeconfig", server=self._server_url, ca_cert=self._ca_cert,
            token=token.status.token, user_name=f"system:serviceaccount:{run.namespace}:{account}",
            namespace=run.namespace)

    def _secret_bytes(self, namespace: str, name: str) -> dict[str, bytes]:
        """A Secret's data as bytes (a volume holds them as they are: keys need not be text);
        empty when it does not exist."""
        try:
            secret: Any = self._core.read_namespaced_secret(name, namespace)
        except ApiException as error:
            if error.status == 404:
                return {}
            raise
        return {key: base64.b64decode(value) for key, value in (secret.data or {}).items()}

    def _lookup(self, kind: str, namespace: str, name: str) -> Mapping[str, str] | None:
        try:
            if kind == "ConfigMap":
                return dict(self._core.read_namespaced_config_map(name, namespace).data or {})
            secret: Any = self._core.read_namespaced_secret(name, namespace)
            return podspec.decode_secret_data(secret.data)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    # ------------------------------------------------------------------ probes
    def _run_probes(self, pod: dict[str, Any], run: _PodRun) -> None:
        now = time.monotonic()
        container = pod["spec"]["containers"][0]
        for kind, probe in run.probes.items():
            if now < probe.next_due:
                continue
            if kind != "startupProbe" and not run.started:
                continue
            if kind == "startupProbe" and run.started:
                continue
            probe.next_due = now + probe.period_seconds
            ok = _probe(probe.spec, ip=run.ip, container=container)
            if ok:
                probe.successes, probe.failures = probe.successes + 1, 0
            else:
                probe.successes, probe.failures = 0, probe.failures + 1
            if kind == "readinessProbe":
                if ok and probe.successes >= probe.success_threshold:
                    run.ready = True
                elif not ok and probe.failures >= probe.failure_threshold:
                    run.ready = False
            elif kind == "startupProbe" and ok:
                run.started = True
            elif not ok and probe.failures >= probe.failure_threshold and run.process is not None:
                what = "Liveness" if kind == "livenessProbe" else "Startup"
                self._event(pod, run, reason="Unhealthy", warning=True, once=False,
                            message=f"{what} probe failed {probe.failures} times; restarting")
                # SIGTERM now, SIGKILL after the grace period; the exit is handled (restart
                # counted) by a later sync, so other pods are not held up meanwhile
                _signal_group(run.process.pid, signal.SIGTERM)
                run.kill_deadline = now + float(pod["spec"].get("terminationGracePeriodSeconds", 30))
                run.probes.clear()
                return

    # ------------------------------------------------------------------ deletion
    def _terminate(self, pod: dict[str, Any], run: _PodRun) -> None:
        now = time.monotonic()
        process = run.process
        if run.terminating_deadline is None:
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            run.terminating_deadline = now + float(grace)
            sleep = ((pod["spec"]["containers"][0].get("lifecycle") or {}).get("preStop") or {}
                     ).get("sleep") if pod["spec"].get("containers") else None
            run.pre_stop_until = now + float(sleep["seconds"]) if sleep else now
            run.ready = False
        if process is not None and process.running():
            if run.pre_stop_until is not None and now >= run.pre_stop_until:
                run.pre_stop_until = None
                _signal_group(process.pid, signal.SIGTERM)
            if now < run.terminating_deadline:
                return
            process.stop(grace_seconds=0.0)  # SIGKILL: the grace period is over
        elif process is not None:
            process.stop(grace_seconds=0.0)  # reap and clear the pid file
        self._delete_pod(pod)
        self._forget(run.uid, grace_seconds=0.0)

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        metadata = pod["metadata"]
        try:
            self._core.delete_namespaced_pod(
                metadata["name"], metadata["namespace"],
                body=k8s.V1DeleteOptions(grace_period_seconds=0,
                                         preconditions=k8s.V1Preconditions(uid=metadata["uid"])))
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    # ------------------------------------------------------------------ status and events
    def _publish_status(self, pod: dict[str, Any], run: _PodRun) -> None:
        container = pod["spec"]["containers"][0] if pod["spec"].get("containers") else {}
        state: dict[str, Any]
        running = run.process is not None and run.process.running()
        if running:
            state = {"running": {"startedAt": run.started_at}}
        elif run.phase in ("Succeeded", "Failed") and run.last_termination:
            state = run.last_termination
        else:
            state = {"waiting": {"reason": run.waiting_reason or "ContainerCreating",
                                 **({"message": run.waiting_message} if run.waiting_message else {})}}
        container_status: dict[str, Any] = {
            "name": container.get("name", "container"), "image": container.get("image", ""),
            "imageID": "", "ready": running and run.ready, "started": running and run.started,
            "restartCount": run.restart_count, "state": state,
            "lastState": run.last_termination or {},
        }
        if running and run.process is not None:
            container_status["containerID"] = f"local-process://{run.process.pid}"
        ready = "True" if running and run.ready else "False"
        conditions = [
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": ready},
            {"type": "Ready", "status": ready},
        ]
        if run.refused:
            conditions.append({"type": UNSUPPORTED_CONDITION, "status": "False",
                               "reason": "Unsupported", "message": run.waiting_message})
        status: dict[str, Any] = {
            "phase": run.phase, "hostIP": LOOPBACK, "hostIPs": [{"ip": LOOPBACK}],
            "startTime": run.pod_start_time, "containerStatuses": [container_status],
        }
        if run.ip:
            status["podIP"] = run.ip
            status["podIPs"] = [{"ip": run.ip}]
        comparable = {"status": status, "conditions": conditions}
        if comparable == run.last_status:
            return
        existing = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        now = _now()
        merged = []
        for condition in conditions:
            previous = existing.pop(condition["type"], None)
            transition = (previous.get("lastTransitionTime") if previous
                          and previous.get("status") == condition["status"] else now)
            merged.append({**condition, "lastProbeTime": None, "lastTransitionTime": transition})
        merged += existing.values()  # PodScheduled and others we do not own
        self._core.patch_namespaced_pod_status(
            run.name, run.namespace, {"status": {**status, "conditions": merged}})
        run.last_status = comparable

    def _event(self, pod: dict[str, Any], run: _PodRun, *, reason: str, message: str,
               warning: bool, once: bool = True) -> None:
        key = f"{reason}:{message}"
        if once and key in run.events_sent:
            return
        run.events_sent.add(key)
        now = _now()
        metadata = pod["metadata"]
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{run.name}.", "namespace": run.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": run.name,
                               "namespace": run.namespace, "uid": run.uid,
                               "resourceVersion": metadata.get("resourceVersion")},
            "reason": reason, "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, "host": NODE_NAME},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": COMPONENT, "reportingInstance": NODE_NAME,
        }
        try:
            self._core.create_namespaced_event(run.namespace, _body(body))
        except ApiException as error:  # events are best effort, as in kubelet
            log.warning("event %s for %s/%s not recorded: %s", reason, run.namespace, run.name,
                        error.reason)


def log_tail(path: Path, *, max_lines: int = TERMINATION_LOG_LINES,
             max_bytes: int = TERMINATION_LOG_BYTES) -> str:
    """The kubelet's FallbackToLogsOnError message: the last ``max_lines`` lines of the
    container's log or its last ``max_bytes`` bytes, whichever is smaller ('' if none)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    lines = data.splitlines(keepends=True)[-max_lines:]
    return b"".join(lines).decode("utf-8", "replace")


def read_pod_log(*, pods_dir: Path, namespace: str, pod: str) -> str:
    """The log file the agent wrote for the newest pod ``namespace/pod`` ('' if none); usable
    from another process, e.g. against the cluster of ``python -m splitserve_e2e up``."""
    directory = pods_dir / namespace
    candidates = sorted(directory.glob(f"{pod}_*/container.log"),
                        key=lambda path: path.stat().st_mtime) if directory.is_dir() else []
    return candidates[-1].read_text(errors="replace") if candidates else ""


def pod_pid_from_files(*, pid_dir: Path, namespace: str, pod: str) -> int | None:
    """pid of the live process of ``namespace/pod`` from the agent's pid files, or None."""
    prefix = f"pod-{namespace}-{pod}-"
    for pid_file in pid_dir.glob(f"{prefix}*.pid"):
        try:
            record = json.loads(pid_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        name, pid = str(record.get("name", "")), int(record.get("pid", 0))
        if len(name) == len(prefix) + 8 and is_alive(pid) and \
                process_start_ticks(pid) == record.get("start_ticks"):
            return pid
    return None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _bindable(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


def _rewrite(text: str, rewrites: Mapping[str, str]) -> str:
    for mount_path, local in rewrites.items():
        if text == mount_path or text.startswith(mount_path + "/"):
            return local + text[len(mount_path):]
        if "=" in text:  # --flag=/mount/path
            flag, _, value = text.partition("=")
            if value == mount_path or value.startswith(mount_path + "/"):
                return f"{flag}={local}{value[len(mount_path):]}"
    return text


def _resolve_executable(command: str, path: str) -> str | None:
    """``python``/``python3`` mean this interpreter (the project's environment); anything
    else is looked up on the pod's PATH, as a container runtime would."""
    if command in ("python", "python3", Path(sys.executable).name):
        return sys.executable
    if "/" in command:
        return command if os.access(command, os.X_OK) else None
    return shutil.which(command, path=path)


def _probe(spec: Mapping[str, Any], *, ip: str, container: Mapping[str, Any]) -> bool:
    timeout_seconds = float(spec.get("timeoutSeconds", 1))
    if "tcpSocket" in spec:
        try:
            port = _resolve_port(spec["tcpSocket"]["port"], container)
            with socket.create_connection((spec["tcpSocket"].get("host") or ip, port),
                                          timeout=timeout_seconds):
                return True
        except (OSError, ValueError):
            return False
    get = spec["httpGet"]
    try:
        port = _resolve_port(get["port"], container)
    except ValueError:
        return False
    scheme = str(get.get("scheme", "HTTP")).lower()
    host = get.get("host") or ip
    headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
    try:
        response = httpx.get(f"{scheme}://{host}:{port}{get.get('path', '/')}",
                             headers=headers, timeout=timeout_seconds, verify=False)
    except httpx.HTTPError:
        return False
    return 200 <= response.status_code < 400


def _resolve_port(port: int | str, container: Mapping[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for entry in container.get("ports") or []:
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ValueError(f"probe port {port!r} is not a named container port")
