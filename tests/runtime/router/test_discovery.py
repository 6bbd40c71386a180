"""EndpointSlice objects → router targets; static endpoint parsing; /metrics load parsing."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve_contract import Role
from splitserve_runtime.router.discovery import parse_static, targets_from_slices
from splitserve_runtime.router.pods import PodSet, parse_load


def _slice(service: str, endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{service}-abc", "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": 8000}, {"name": "kv", "port": 8100}],
        "endpoints": endpoints,
    }


def test_ready_endpoints_become_targets_by_role() -> None:
    slices = [
        _slice(
            "demo-prefill",
            [
                {"addresses": ["127.0.1.1"], "conditions": {"ready": True}, "targetRef": {"name": "demo-prefill-x"}},
                {"addresses": ["127.0.1.2"], "conditions": {"ready": False}, "targetRef": {"name": "demo-prefill-y"}},
            ],
        ),
        _slice(
            "demo-decode",
            [
                {"addresses": ["127.0.1.3"], "conditions": {"ready": True, "terminating": True}},
                {"addresses": ["127.0.1.4"], "conditions": {"ready": True}, "targetRef": {"name": "demo-decode-z"}},
            ],
        ),
        _slice("other-decode", [{"addresses": ["127.0.9.9"], "conditions": {"ready": True}}]),
    ]
    roles = {"demo-prefill": Role.PREFILL, "demo-decode": Role.DECODE, "demo-engine": Role.AGGREGATED}
    found = targets_from_slices(slices=slices, service_roles=roles)
    assert [(t.name, t.url) for t in found[Role.PREFILL]] == [("demo-prefill-x", "http://127.0.1.1:8000")]
    assert [(t.name, t.url) for t in found[Role.DECODE]] == [("demo-decode-z", "http://127.0.1.4:8000")]
    assert found[Role.AGGREGATED] == []


def test_static_endpoints_parse_and_reject_garbage() -> None:
    targets = parse_static(role=Role.DECODE, endpoints="127.0.0.2:8000, 127.0.0.3:8001")
    assert [t.url for t in targets] == ["http://127.0.0.2:8000", "http://127.0.0.3:8001"]
    with pytest.raises(ValueError, match="bad decode endpoint 'nonsense'"):
        parse_static(role=Role.DECODE, endpoints="nonsense")


def test_pod_set_replaces_targets_and_tracks_health() -> None:
    pods = PodSet()
    pods.set_targets(
        role=Role.DECODE, targets=parse_static(role=Role.DECODE, endpoints="127.0.0.2:8000,127.0.0.3:8000")
    )
    assert pods.healthy(Role.DECODE) == []  # unknown until polled
    pods.mark_ok("127.0.0.2:8000")
    assert [p.name for p in pods.healthy(Role.DECODE)] == ["127.0.0.2:8000"]
    pods.mark_failed("127.0.0.2:8000")
    assert pods.healthy(Role.DECODE) == []
    gone = pods.set_targets(role=Role.DECODE, targets=parse_static(role=Role.DECODE, endpoints="127.0.0.3:8000"))
    assert gone == ["127.0.0.2:8000"] and pods.get("127.0.0.2:8000") is None


def test_load_is_read_from_runtime_metrics_text() -> None:
    text = (
        "# TYPE splitserve_requests_waiting gauge\n"
        'splitserve_requests_waiting{role="decode",model="m"} 3.0\n'
        "# TYPE splitserve_requests_running gauge\n"
        'splitserve_requests_running{role="decode",model="m"} 7.0\n'
        "# TYPE splitserve_kv_cache_usage_ratio gauge\n"
        'splitserve_kv_cache_usage_ratio{role="decode",model="m"} 0.25\n'
    )
    load = parse_load(text)
    assert (load.requests_waiting, load.requests_running, load.kv_cache_usage_ratio) == (3.0, 7.0, 0.25)
