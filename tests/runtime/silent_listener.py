"""A hub that accepts connections and never answers, for the tests that bound every hub call
(:mod:`test_hub_timeouts`, :mod:`test_startup_errors`)."""

from __future__ import annotations

import socket
import threading


class SilentListener:
    """A loopback socket that accepts every connection and never answers."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.accepted.append(conn)  # held open, never read from or written to

    def __enter__(self) -> SilentListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self._sock.close()
