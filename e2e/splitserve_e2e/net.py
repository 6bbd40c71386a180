"""Loopback ports for the control-plane components.

Everything listens on 127.0.0.0/8 only. Ports are taken from the kernel's ephemeral range by
binding port 0 and releasing it; the tiny race with another process is acceptable for a test
harness and far better than fixed ports that collide with a second cluster.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(*, host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(*, host: str, port: int, timeout_seconds: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds):
            return True
    except OSError:
        return False
