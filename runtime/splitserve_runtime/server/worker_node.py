"""`splitserve serve` on a worker pod of a multi-pod group: health endpoints around the pod's ranks.

A worker pod (node rank > 0, :mod:`splitserve_runtime.engine.parallel.placement`) serves no
API: the leader does. It still runs the pod template's probes, so this module answers them
on the HTTP port with a few lines of the standard library (no web framework, no torch before
the listener is up): ``/health`` 200 while the pod's ranks live (503 once it is going down),
``/ready`` 200 once every rank of the pod has joined the group and loaded its part (503 while
waiting for the leader, loading, or after SIGTERM). SIGTERM does not stop the ranks: the
leader drains its requests first and then stops the whole group, so this pod exits when its
ranks do (or the kubelet's grace period ends it); before the pod has joined, SIGTERM ends it at
once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import splitserve_contract as contract
from splitserve_runtime.termination import log_startup_failure, write_termination_message

if TYPE_CHECKING:
    from splitserve_runtime.engine.parallel.node import NodeStatus
    from splitserve_runtime.engine.parallel.placement import Placement

logger = logging.getLogger("splitserve.worker_node")


def _handler(status: NodeStatus) -> type[BaseHTTPRequestHandler]:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                ok, reason = status.alive, "unhealthy"
            elif path == "/ready":
                ok = status.alive and status.joined and not status.draining
                reason = "unhealthy" if not status.alive else "draining" if status.draining else "loading"
            else:
                self._answer(
                    404,
                    {
                        "error": {
                            "message": f"{path} is not served by a worker pod of a group "
                            "(the group's leader serves the API)",
                            "code": "not_found",
                        }
                    },
                )
                return
            if ok:
                self._answer(200, {"status": "ok" if path == "/health" else "ready"})
            else:
                self._answer(503, {"error": {"message": f"not ready: {reason} ({status.detail})", "code": reason}})

        def _answer(self, code: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the stdlib's name)
            pass  # probes every few seconds: not worth a log line each

    return Health


def start_health_server(host: str, port: int, status: NodeStatus) -> ThreadingHTTPServer:
    """Listen on ``host:port`` and answer the probes on a daemon thread."""
    server = ThreadingHTTPServer((host, port), _handler(status))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-server", daemon=True).start()
    return server


def serve_worker_node(args: contract.ServeArgs, placement: Placement) -> int:
    """This pod's whole life: probes up, model resolved, ranks run until the leader stops them."""
    from splitserve_runtime.engine.parallel.node import NodeStatus

    status = NodeStatus()
    server = start_health_server(args.host, args.port, status)
    logger.info(
        "worker pod: %s of a %d-pod group, probes on %s:%d",
        placement.describe_node(placement.node_rank),
        placement.nnodes,
        args.host,
        args.port,
    )

    def on_signal(sig: int, frame: FrameType | None) -> None:
        if not status.joined:  # nothing to drain: the group is going away before it formed
            logger.info("signal %d before this pod joined its group: exiting", sig)
            raise SystemExit(0)
        if not status.draining:
            logger.info("signal %d: waiting for the group's leader to drain and stop the ranks", sig)
        status.draining = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        from splitserve_runtime.engine.parallel.node import run_worker_node
        from splitserve_runtime.model.uri import resolve_model_uri

        cache = os.environ.get(contract.ENV_MODEL_CACHE)
        model_dir = resolve_model_uri(args.model, cache_dir=Path(cache) if cache else None, revision=args.revision)
        return run_worker_node(args, placement=placement, model_dir=model_dir, status=status)
    except Exception as exc:
        status.alive = False
        message = log_startup_failure(exc, log=logger, what="the worker pod failed")
        write_termination_message(message)
        return 1
    finally:
        server.shutdown()
