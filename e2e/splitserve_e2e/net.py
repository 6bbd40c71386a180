"""Loopback ports for the control-plane components.

Everything listens on 127.0.0.0/8 only. :func:`free_port` picks a port at random below the
kernel's ephemeral range (:data:`PORT_RANGE`), checks that it binds, and never hands the same
port out twice in one process. Binding port 0 instead, as this did, raced twice over: two
calls in a row could return the same port (the kernel hands out again the one just released:
a prefill pod's KV listener then failed with EADDRINUSE next to its HTTP one), and a port from
the ephemeral range can be taken as the source port of any outgoing connection before its
server binds it (a TCPStore rendezvous port failed so). Every test helper takes its ports here.
"""

from __future__ import annotations

import random
import socket
import threading

LOOPBACK = "127.0.0.1"
PORT_RANGE = range(20_000, 30_000)
"""Below Linux's default ephemeral range (32768-60999), so no outgoing connection takes one as
its source port, and below Kubernetes' NodePort range (30000-32767)."""
PICK_ATTEMPTS = 200

_handed_out: set[int] = set()
_rng = random.Random()
_lock = threading.Lock()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago and that this process has not handed
    out before (see the module docstring); bind-to-0 only if the range is exhausted."""
    with _lock:
        for _attempt in range(PICK_ATTEMPTS):
            port = _rng.choice(PORT_RANGE)
            if port not in _handed_out and _binds(host, port):
                _handed_out.add(port)
                return port
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def port_open(*, host: str, port: int, timeout_seconds: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds):
            return True
    except OSError:
        return False
