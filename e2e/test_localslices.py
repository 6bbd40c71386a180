"""Unit tests of the EndpointSlices the local node publishes (no cluster needed)."""

from __future__ import annotations

from typing import Any

from splitserve_e2e.localslices import MANAGED_BY_LABEL, desired_slice, slice_name


def _pod(name: str, *, ip: str, ready: bool, namespace: str = "ns", deleting: bool = False,
         app: str = "web") -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                                "labels": {"app": app}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata,
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


SERVICE: dict[str, Any] = {"metadata": {"name": "web", "namespace": "ns", "uid": "svc-uid"},
           "spec": {"selector": {"app": "web"},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


def test_slice_follows_endpointslice_controller_rules() -> None:
    pods = [_pod("a", ip="127.1.1.2", ready=True), _pod("b", ip="127.1.1.3", ready=False),
            _pod("c", ip="127.1.1.4", ready=True, deleting=True),
            _pod("other-ns", ip="127.1.1.5", ready=True, namespace="elsewhere"),
            _pod("other-app", ip="127.1.1.6", ready=True, app="db")]
    endpoint_slice = desired_slice(service=SERVICE, pods=pods, node_name="splitserve-local")
    assert endpoint_slice is not None
    assert endpoint_slice["addressType"] == "FQDN"
    assert endpoint_slice["metadata"]["name"] == "web-local"
    assert endpoint_slice["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
    assert MANAGED_BY_LABEL in endpoint_slice["metadata"]["labels"]
    assert endpoint_slice["metadata"]["ownerReferences"][0]["uid"] == "svc-uid"
    assert endpoint_slice["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP"}]
    conditions = {e["targetRef"]["name"]: e["conditions"] for e in endpoint_slice["endpoints"]}
    assert conditions == {
        "a": {"ready": True, "serving": True, "terminating": False},
        "b": {"ready": False, "serving": False, "terminating": False},
        "c": {"ready": False, "serving": True, "terminating": True},
    }


def test_no_slice_without_selected_local_pods_or_selector() -> None:
    assert desired_slice(service=SERVICE, pods=[_pod("x", ip="127.1.1.2", ready=True, app="db")],
                         node_name="n") is None
    headless = {**SERVICE, "spec": {"ports": SERVICE["spec"]["ports"]}}
    assert desired_slice(service=headless, pods=[_pod("a", ip="127.1.1.2", ready=True)],
                         node_name="n") is None


def test_slice_name_stays_within_63_characters() -> None:
    name = slice_name("s" * 63)
    assert len(name) == 63 and name.endswith("-local")
