"""Slow clients: the runtime server and the router close a request that does not arrive in time.

Found by a hostile review: neither server bounded the time to read a request's headers or
body, so connections that sent nothing, half a request line, or headers and then none of the
body were held forever (20,000 of them were all still open). Now both serve through
``splitserve_runtime.read_timeouts``: the line and headers must be complete within
``--header-timeout-seconds`` of the first byte (or of the connection), and a body may pause at
most ``--body-idle-timeout-seconds`` between bytes; past either the client gets a 408 (where
it sent something) and the connection is closed.

Real processes on loopback: ``splitserve serve`` (tiny model, CPU) and ``splitserve router`` in
front of it, both with 1 s bounds. Each slow client is a raw socket; its reads have a 10 s
timeout of their own, so a server that holds the connection fails the test instead of hanging
it. Normal requests, a body that pauses less than the bound, and a keep-alive connection idle
for longer than the header bound (the header clock starts at a request's first byte) still work.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL_NAME, serve_args, spawn_server, wait_until

from splitserve_contract import RouterArgs, router_argv
from splitserve_e2e.net import free_port

BOUND_S = 1.0
"""Both bounds, in both processes."""
CLIENT_TIMEOUT_S = 10.0
"""How long the test's own socket waits: far past the bound, far short of forever."""
COMPLETION = json.dumps({"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2}).encode()


@dataclasses.dataclass
class Endpoint:
    host: str
    port: int


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def endpoints(tiny_llama_dir: Path) -> Iterator[dict[str, Endpoint]]:
    """``splitserve serve`` and ``splitserve router`` (to that pod), both ready."""
    server_port, router_port = free_port(), free_port()
    server = spawn_server(
        args=serve_args(
            model_dir=tiny_llama_dir,
            port=server_port,
            max_model_len=64,
            num_kv_blocks=8,
            header_timeout_seconds=BOUND_S,
            body_idle_timeout_seconds=BOUND_S,
        )
    )
    router_args = RouterArgs(
        host="127.0.0.1",
        port=router_port,
        discovery="static",
        aggregated_endpoints=f"127.0.0.1:{server_port}",
        served_model_name=MODEL_NAME,
        health_interval_seconds=0.5,
        header_timeout_seconds=BOUND_S,
        body_idle_timeout_seconds=BOUND_S,
    )
    router = subprocess.Popen(
        [sys.executable, "-m", "splitserve_cli", "router", *router_argv(router_args)],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(
            lambda: _ready(server_port) and _ready(router_port),
            timeout_s=120,
            what="the server and the router to be ready",
        )
        yield {"server": Endpoint("127.0.0.1", server_port), "router": Endpoint("127.0.0.1", router_port)}
    finally:
        _stop(router)
        _stop(server)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _connect(endpoint: Endpoint) -> socket.socket:
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=CLIENT_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took; a socket.timeout
    (the server held the connection past CLIENT_TIMEOUT_S) fails the test."""
    started = time.monotonic()
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return received, time.monotonic() - started


def _assert_408(received: bytes) -> None:
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["message"], error


SERVERS = ["server", "router"]


@pytest.mark.parametrize("which", SERVERS)
def test_a_connection_that_sends_nothing_is_closed(endpoints: dict[str, Endpoint], which: str) -> None:
    with _connect(endpoints[which]) as sock:
        received, waited = _read_until_closed(sock)
    assert received == b""  # nothing was asked: nothing is answered
    print(f"{which}: an idle connection closed after {waited:.2f} s (bound {BOUND_S} s)")


@pytest.mark.parametrize("which", SERVERS)
def test_half_a_request_line_is_a_408_and_closed(endpoints: dict[str, Endpoint], which: str) -> None:
    with _connect(endpoints[which]) as sock:
        sock.sendall(b"POST /v1/completions HTT")
        received, waited = _read_until_closed(sock)
    _assert_408(received)
    print(f"{which}: half a request line closed after {waited:.2f} s")


@pytest.mark.parametrize("which", SERVERS)
def test_headers_trickled_a_byte_at_a_time_are_cut_off(endpoints: dict[str, Endpoint], which: str) -> None:
    """The header bound is on the whole head: bytes that keep coming do not extend it."""
    with _connect(endpoints[which]) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        received = b""
        while time.monotonic() - started < CLIENT_TIMEOUT_S:
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                received, _ = _read_until_closed(sock)
                break
            try:
                sock.sendall(b"X")  # one more byte of a header name, every 0.2 s
            except (BrokenPipeError, ConnectionResetError):
                break
        else:
            raise AssertionError("the server kept reading trickled headers past the client's timeout")
    _assert_408(received)


@pytest.mark.parametrize("which", SERVERS)
@pytest.mark.parametrize("body_sent", [0, 10])
def test_a_body_that_stops_coming_is_a_408_and_closed(
    endpoints: dict[str, Endpoint], which: str, body_sent: int
) -> None:
    with _connect(endpoints[which]) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(COMPLETION)}\r\n\r\n".encode()
            + COMPLETION[:body_sent]
        )
        received, waited = _read_until_closed(sock)
    _assert_408(received)
    print(f"{which}: a body stalled after {body_sent} bytes closed after {waited:.2f} s")


@pytest.mark.parametrize("which", SERVERS)
def test_a_body_that_keeps_moving_is_served(endpoints: dict[str, Endpoint], which: str) -> None:
    """Pauses shorter than the bound, longer than it in all: the body bound is an idle bound."""
    pieces = [COMPLETION[i : i + 16] for i in range(0, len(COMPLETION), 16)]
    assert len(pieces) * 0.4 > BOUND_S
    with _connect(endpoints[which]) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(COMPLETION)}\r\nconnection: close\r\n\r\n".encode()
        )
        for piece in pieces:
            time.sleep(0.4)
            sock.sendall(piece)
        received, _ = _read_until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), received
    assert json.loads(body)["choices"][0]["text"] is not None


@pytest.mark.parametrize("which", SERVERS)
def test_a_kept_connection_idle_past_the_header_bound_still_serves(endpoints: dict[str, Endpoint], which: str) -> None:
    """The header clock starts at a request's first byte, not at the answer before it (uvicorn's
    own keep-alive timeout, 5 s, bounds the idle time between requests)."""
    endpoint = endpoints[which]
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=CLIENT_TIMEOUT_S)
    try:
        for pause_s in (0.0, BOUND_S * 1.5):
            time.sleep(pause_s)
            conn.request("POST", "/v1/completions", body=COMPLETION, headers={"content-type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200, response.read()
            assert json.loads(response.read())["choices"]
            assert conn.sock is not None
            if pause_s == 0.0:
                first = conn.sock.getsockname()
        assert conn.sock.getsockname() == first  # the same connection both times
    finally:
        conn.close()
