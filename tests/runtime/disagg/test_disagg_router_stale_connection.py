"""A pod that closes the router's connection before answering does not fail the request, nor
leave the pool (issue 12, defect 3: the longer disaggregated burst).

Under a steady burst, a pooled keep-alive connection the decode pod had just closed as idle
(uvicorn and httpx both expire idle connections after 5 s) failed a request with ReadError;
the router then took the only decode pod out of rotation and answered 503 to every request
until the next health poll (41 of 1,000 requests). The router now sends such a request once
more on a fresh connection. The fake pod here drops the first connection that carries a
completion, without a byte of answer, as the racing pod did.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi.testclient import TestClient

from splitserve_contract import RouterArgs


class _Pod(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    drops_left = 1
    completions: list[str] = []
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _answer(self, status: int, body: dict[str, Any] | str, content_type: str = "application/json") -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/splitserve/info":
            self._answer(200, {"role": "decode", "compat_hash": "h", "kv_endpoint": ""})
        elif self.path == "/metrics":
            self._answer(200, "", content_type="text/plain")
        else:
            self._answer(200, {"status": "ready"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        with _Pod.lock:
            drop = _Pod.drops_left > 0
            _Pod.drops_left -= 1
            _Pod.completions.append(str(body.get("prompt")))
        if drop:  # hang up without a byte of answer
            self.close_connection = True
            return
        self._answer(200, {"id": "c", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]})


@pytest.fixture
def pod_port() -> Iterator[int]:
    _Pod.drops_left, _Pod.completions = 1, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pod)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_connection_closed_before_the_answer_is_retried_and_the_pod_stays(pod_port: int) -> None:
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    args = RouterArgs(
        discovery="static",
        decode_endpoints=f"127.0.0.1:{pod_port}",
        health_interval_seconds=30,
        short_prompt_threshold=8,
    )
    app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
    with TestClient(app) as client:
        answers = [client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"}) for i in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert _Pod.completions == ["p0", "p0", "p1", "p2"]  # p0 sent again, once; the pod kept serving
