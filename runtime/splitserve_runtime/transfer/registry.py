"""Prefill-side registry of KV exported for a decode pod to pull.

After the prefill pass the engine pins the request's blocks (one extra reference each) and
registers an :class:`ExportedKV`. The KV server reads blocks through it; the decode pod's
RELEASE, or the lease running out (an unclaimed request, a decode pod that died), calls
`release` exactly once so the blocks return to the pool. Thread-safe: the engine thread adds,
the server's event loop reads and releases.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ExportedKV:
    request_id: str
    num_tokens: int
    num_blocks: int
    read_block: Callable[[int], memoryview]
    """Bytes of block `i` (0-based within the request) in the connector's KVLayout."""
    release: Callable[[], None]
    """Unpin the blocks. Called exactly once by the registry."""
    expires_at: float = field(default=0.0)


class KVExportRegistry:
    def __init__(self, *, ttl_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_seconds = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._exports: dict[str, ExportedKV] = {}
        self.num_expired = 0

    def add(self, exported: ExportedKV) -> None:
        exported.expires_at = self._clock() + self._ttl_seconds
        with self._lock:
            previous = self._exports.pop(exported.request_id, None)
            self._exports[exported.request_id] = exported
        if previous is not None:
            previous.release()

    def get(self, request_id: str) -> ExportedKV | None:
        with self._lock:
            return self._exports.get(request_id)

    def release(self, request_id: str) -> bool:
        with self._lock:
            exported = self._exports.pop(request_id, None)
        if exported is None:
            return False
        exported.release()
        return True

    def expire(self) -> int:
        """Release every export whose lease ran out; returns how many."""
        now = self._clock()
        with self._lock:
            stale = [rid for rid, e in self._exports.items() if e.expires_at <= now]
            expired = [self._exports.pop(rid) for rid in stale]
        for exported in expired:
            exported.release()
        self.num_expired += len(expired)
        return len(expired)

    def release_all(self) -> None:
        with self._lock:
            exports = list(self._exports.values())
            self._exports.clear()
        for exported in exports:
            exported.release()

    def __len__(self) -> int:
        with self._lock:
            return len(self._exports)
