"""Every test takes its loopback ports from one place, :func:`splitserve_e2e.net.free_port`,
which never hands one out twice and stays off the ephemeral range. Four helpers of their own
once bound port 0 instead; two calls in a row could return the same port (a prefill pod's KV
listener failed with EADDRINUSE beside its HTTP one: 15 errors in one CI run)."""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

from splitserve_e2e import net

REPO = Path(__file__).resolve().parents[2]


def ephemeral_range() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


def test_free_ports_are_distinct_bindable_and_off_the_ephemeral_range() -> None:
    ports = [net.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert not set(ports) & set(ephemeral_range())
    for port in ports[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((net.LOOPBACK, port))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        taken = next(port for port in net.PORT_RANGE if port not in net._handed_out and net._binds(net.LOOPBACK, port))
        held.bind((net.LOOPBACK, taken))
        other = taken + 1 if taken + 1 in net.PORT_RANGE else taken - 1
        picks = iter([taken, taken, other])
        monkeypatch.setattr(net._rng, "choice", lambda _seq: next(picks))
        assert net.free_port() == other


def test_no_test_helper_defines_its_own_free_port() -> None:
    own = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for root in ("tests", "e2e")
        for path in sorted((REPO / root).rglob("*.py"))
        if path != REPO / "e2e/splitserve_e2e/net.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "free_port"
    ]
    assert own == []
