"""Unit tests of the local node's pod-spec semantics (no cluster needed, milliseconds)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from splitserve_e2e import podspec


def _pod(**container: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1",
                         "labels": {"app.kubernetes.io/instance": "demo"}},
            "spec": {"nodeName": "splitserve-local", "serviceAccountName": "sa",
                     "containers": [{"name": "c", "image": "i", "command": ["run"], **container}]}}


def _lookup(objects: Mapping[tuple[str, str], Mapping[str, str]]) -> podspec.ObjectLookup:
    def lookup(kind: str, namespace: str, name: str) -> Mapping[str, str] | None:
        assert namespace == "ns"
        return objects.get((kind, name))
    return lookup


@pytest.mark.parametrize(("text", "expected"), [
    ("$(A)", "1"),
    ("x$(A)y$(B)", "x1y2"),
    ("$$(A)", "$(A)"),
    ("$(MISSING)", "$(MISSING)"),
    ("$A and $", "$A and $"),
    ("$(unterminated", "$(unterminated"),
    ("$$$(A)", "$1"),
])
def test_expand_references_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert podspec.expand_references(text, {"A": "1", "B": "2"}) == expected


def test_environment_precedence_sources_and_expansion() -> None:
    pod = _pod(
        envFrom=[{"configMapRef": {"name": "cm"}, "prefix": "CFG_"}],
        env=[{"name": "CFG_X", "value": "explicit wins"},
             {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
             {"name": "INST", "valueFrom": {"fieldRef": {
                 "fieldPath": "metadata.labels['app.kubernetes.io/instance']"}}},
             {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
             {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k",
                                                                "optional": True}}},
             {"name": "URL", "value": "http://$(IP):8000/$(LATER)"},
             {"name": "LATER", "value": "late"}])
    env = podspec.container_environment(
        pod=pod, pod_ip="127.3.4.5", host_ip="127.0.0.1",
        lookup=_lookup({("ConfigMap", "cm"): {"X": "from cm", "Y": "y"},
                        ("Secret", "s"): {"k": "secret"}}))
    assert env == {"CFG_X": "explicit wins", "CFG_Y": "y", "IP": "127.3.4.5", "INST": "demo",
                   "KEY": "secret", "URL": "http://127.3.4.5:8000/$(LATER)", "LATER": "late"}


def test_missing_reference_is_a_config_error_naming_it() -> None:
    pod = _pod(env=[{"name": "M", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "nope"}}}])
    with pytest.raises(podspec.PodConfigError, match="nope"):
        podspec.container_environment(pod=pod, pod_ip="", host_ip="",
                                      lookup=_lookup({("ConfigMap", "cm"): {"a": "b"}}))


def test_argv_expands_against_env() -> None:
    pod = _pod(command=["python", "-m", "http.server"], args=["--bind", "$(POD_IP)", "$$(X)"])
    assert podspec.container_argv(pod=pod, env={"POD_IP": "127.9.9.9"}) == [
        "python", "-m", "http.server", "--bind", "127.9.9.9", "$(X)"]


def test_supported_pod_has_no_problems() -> None:
    pod = _pod(readinessProbe={"httpGet": {"path": "/ready", "port": 8000}},
               livenessProbe={"tcpSocket": {"port": 8000}},
               volumeMounts=[{"name": "cache", "mountPath": "/cache"}],
               lifecycle={"preStop": {"sleep": {"seconds": 1}}})
    pod["spec"]["volumes"] = [
        {"name": "cache", "emptyDir": {}},
        {"name": "kube-api-access-x1y2z", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token"}}]}}]
    assert podspec.unsupported_features(pod) == []


def test_every_unsupported_feature_is_named() -> None:
    pod = _pod(readinessProbe={"exec": {"command": ["true"]}},
               env=[{"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}],
               ports=[{"containerPort": 80, "hostPort": 80}],
               volumeMounts=[{"name": "data", "mountPath": "/d", "subPath": "x"}])
    pod["spec"]["containers"].append({"name": "sidecar", "image": "i"})
    pod["spec"]["initContainers"] = [{"name": "init", "image": "i"}]
    pod["spec"]["hostNetwork"] = True
    pod["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]
    problems = " | ".join(podspec.unsupported_features(pod))
    for expected in ("2 containers", "spec.initContainers", "spec.hostNetwork",
                     "persistentVolumeClaim", "readinessProbe.exec", "resourceFieldRef",
                     "hostPort", "subPath"):
        assert expected in problems, (expected, problems)


def test_container_without_command_or_args_is_unsupported() -> None:
    pod = _pod()
    del pod["spec"]["containers"][0]["command"]
    assert any("command" in p for p in podspec.unsupported_features(pod))


def test_args_alone_run_without_the_image_entrypoint() -> None:
    pod = _pod(args=["splitserve", "serve", "--host", "$(POD_IP)"])
    del pod["spec"]["containers"][0]["command"]
    assert not any("command" in p for p in podspec.unsupported_features(pod))
    assert podspec.container_argv(pod=pod, env={"POD_IP": "127.0.0.9"}) == [
        "splitserve", "serve", "--host", "127.0.0.9"]
