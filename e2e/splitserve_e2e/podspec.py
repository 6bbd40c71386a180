"""What the local node can run, and how a pod spec becomes a local process.

The local node runs a pod's single container as a plain process. Everything it cannot honour
is listed by :func:`unsupported_features` so the agent can refuse the pod with a message naming
exactly what is missing, instead of running something that silently differs from the spec.
The rest is Kubernetes semantics done faithfully: ``$(VAR)`` expansion (``$$`` escapes,
unknown references stay as written), env precedence (``envFrom`` first, then ``env`` in order),
and the downward-API field paths kubelet supports.

Pods are handled as the API's JSON dicts (camelCase keys), which keeps these functions pure and
easy to test.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from typing import Any

Pod = dict[str, Any]
# lookup(kind, namespace, name) -> the object's string data, or None when it does not exist;
# kind is "ConfigMap" or "Secret" (Secret values already base64-decoded)
ObjectLookup = Callable[[str, str, str], Mapping[str, str] | None]

SUPPORTED_VOLUME_TYPES = ("emptyDir", "configMap", "secret")
SUPPORTED_FIELD_PATHS = (
    "metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName",
    "spec.serviceAccountName", "status.podIP", "status.hostIP",
)
_LABEL_PATH = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
SERVICE_ACCOUNT_VOLUME_PREFIX = "kube-api-access-"


class PodConfigError(ValueError):
    """A referenced ConfigMap/Secret/key is missing (kubelet: CreateContainerConfigError)."""


def expand_references(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: ``$$`` -> ``$``; ``$(NAME)`` -> its value when NAME is
    defined, else left unchanged; every other ``$`` is literal."""
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char == "$" and index + 1 < len(text):
            following = text[index + 1]
            if following == "$":
                out.append("$")
                index += 2
                continue
            if following == "(":
                end = text.find(")", index + 2)
                if end != -1:
                    name = text[index + 2:end]
                    out.append(variables[name] if name in variables else text[index:end + 1])
                    index = end + 1
                    continue
        out.append(char)
        index += 1
    return "".join(out)


def is_service_account_volume(volume: Mapping[str, Any]) -> bool:
    """The projected volume the ServiceAccount admission plugin adds for token automount."""
    projected = volume.get("projected")
    if not projected or not str(volume.get("name", "")).startswith(SERVICE_ACCOUNT_VOLUME_PREFIX):
        return False
    return any("serviceAccountToken" in source for source in projected.get("sources") or [])


def _probe_problems(container: Mapping[str, Any]) -> list[str]:
    problems = []
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = container.get(kind)
        if not probe:
            continue
        for handler in ("exec", "grpc"):
            if handler in probe:
                problems.append(f"{kind}.{handler} (only httpGet and tcpSocket probes run)")
    return problems


def _env_problems(container: Mapping[str, Any]) -> list[str]:
    problems = []
    for entry in container.get("env") or []:
        source = entry.get("valueFrom")
        if not source:
            continue
        if "resourceFieldRef" in source:
            problems.append(f"env {entry['name']}: valueFrom.resourceFieldRef")
        elif "fieldRef" in source:
            path = source["fieldRef"].get("fieldPath", "")
            if path not in SUPPORTED_FIELD_PATHS and not _LABEL_PATH.match(path):
                problems.append(f"env {entry['name']}: fieldRef {path}")
    return problems


def unsupported_features(pod: Pod) -> list[str]:
    """Everything in ``pod`` that the local node cannot honour; empty when it can run it."""
    spec = pod.get("spec") or {}
    problems: list[str] = []
    containers = spec.get("containers") or []
    if len(containers) != 1:
        problems.append(f"{len(containers)} containers (the local node runs exactly one)")
    for field in ("initContainers", "ephemeralContainers"):
        if spec.get(field):
            problems.append(f"spec.{field} ({len(spec[field])})")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            problems.append(f"spec.{field}")
    for volume in spec.get("volumes") or []:
        if is_service_account_volume(volume):
            continue
        kinds = [key for key in volume if key != "name"]
        if not any(kind in SUPPORTED_VOLUME_TYPES for kind in kinds):
            problems.append(f"volume {volume.get('name')}: {'/'.join(kinds) or 'no source'} "
                            f"(supported: {', '.join(SUPPORTED_VOLUME_TYPES)})")
    for container in containers[:1]:
        if not container.get("command") and not container.get("args"):
            problems.append("container without `command` or `args` (image entrypoints and "
                            "commands cannot run locally)")
        problems += _probe_problems(container)
        problems += _env_problems(container)
        for mount in container.get("volumeMounts") or []:
            if mount.get("subPath") or mount.get("subPathExpr"):
                problems.append(f"volumeMount {mount.get('name')}: subPath")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"port {port.get('containerPort')}: hostPort")
        lifecycle = container.get("lifecycle") or {}
        if lifecycle.get("postStart"):
            problems.append("lifecycle.postStart")
        pre_stop = lifecycle.get("preStop") or {}
        if pre_stop and "sleep" not in pre_stop:
            problems.append("lifecycle.preStop other than sleep")
    return problems


def _field_value(pod: Pod, path: str, *, pod_ip: str, host_ip: str) -> str:
    metadata, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {
        "metadata.name": metadata.get("name", ""),
        "metadata.namespace": metadata.get("namespace", ""),
        "metadata.uid": metadata.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.hostIP": host_ip,
    }
    if path in simple:
        return str(simple[path])
    match = _LABEL_PATH.match(path)
    if match:
        return str((metadata.get(match.group(1)) or {}).get(match.group(2), ""))
    raise PodConfigError(f"unsupported fieldRef {path}")


def _key_ref(*, kind: str, ref: Mapping[str, Any], namespace: str,
             lookup: ObjectLookup) -> str | None:
    data = lookup(kind, namespace, ref["name"])
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise PodConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    if ref["key"] not in data:
        if optional:
            return None
        raise PodConfigError(f'couldn\'t find key {ref["key"]} in {kind} {namespace}/{ref["name"]}')
    return data[ref["key"]]


def container_environment(*, pod: Pod, pod_ip: str, host_ip: str,
                          lookup: ObjectLookup) -> dict[str, str]:
    """The container's environment exactly as kubelet would compute it (without the
    Service-link variables). Raises :class:`PodConfigError` for missing references."""
    namespace = pod["metadata"]["namespace"]
    container = pod["spec"]["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key not in source:
                continue
            ref = source[key]
            data = lookup(kind, namespace, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise PodConfigError(f'{kind.lower()} "{ref["name"]}" not found')
            for data_key, data_value in data.items():
                env[prefix + data_key] = data_value
    for entry in container.get("env") or []:
        name = entry["name"]
        source = entry.get("valueFrom")
        if source is None:
            env[name] = expand_references(entry.get("value", ""), env)
            continue
        value: str | None
        if "fieldRef" in source:
            value = _field_value(pod, source["fieldRef"]["fieldPath"], pod_ip=pod_ip,
                                 host_ip=host_ip)
        elif "configMapKeyRef" in source:
            value = _key_ref(kind="ConfigMap", ref=source["configMapKeyRef"],
                             namespace=namespace, lookup=lookup)
        elif "secretKeyRef" in source:
            value = _key_ref(kind="Secret", ref=source["secretKeyRef"], namespace=namespace,
                             lookup=lookup)
        else:
            raise PodConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def container_argv(*, pod: Pod, env: Mapping[str, str]) -> list[str]:
    """command + args with ``$(VAR)`` references expanded against ``env``. A container with
    only ``args`` (the image's ENTRYPOINT, e.g. tini, stays PID 1 on a real node) runs its
    ``args`` alone: there is no image here, so no entrypoint to put in front of them."""
    container = pod["spec"]["containers"][0]
    words = list(container.get("command") or []) + list(container.get("args") or [])
    return [expand_references(word, env) for word in words]


def decode_secret_data(data: Mapping[str, str] | None) -> dict[str, str]:
    """Secret ``data`` values are base64 in the API; processes see the decoded text."""
    return {key: base64.b64decode(value).decode() for key, value in (data or {}).items()}
