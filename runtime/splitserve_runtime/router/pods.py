"""The router's view of the runtime pods: who exists (from discovery), who is healthy and how
loaded (from its own polling), and which pods may be paired.

Discovery only says which addresses back which role. Everything else the router learns from the
pods themselves: `GET /v1/splitserve/info` gives the compat hash and the KV endpoint, `/ready`
says whether the pod takes traffic, and three gauges of `/metrics` give its load. A pod that
fails `unhealthy_after` polls in a row (or a request) is skipped until it answers again, so a
dead pod costs at most one failed attempt per request, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contract import INFO_PATH, Metric, Role

from .policy import Candidate, PodLoad

log = logging.getLogger(__name__)


@dataclass
class Pod:
    name: str
    url: str  # http://host:port
    role: Role
    compat_hash: str = ""
    kv_endpoint: str = ""
    healthy: bool = False
    consecutive_failures: int = 0
    load: PodLoad = field(default_factory=PodLoad)

    def candidate(self) -> Candidate:
        return Candidate(name=self.name, load=self.load)


@dataclass(frozen=True)
class Target:
    """One address discovery found for a role."""

    name: str
    url: str
    role: Role


class PodSet:
    """All known pods by name; discovery replaces a role's targets, polling updates state."""

    def __init__(self, *, unhealthy_after: int = 2) -> None:
        self._pods: dict[str, Pod] = {}
        self._unhealthy_after = unhealthy_after
        self.changed = asyncio.Event()

    def set_targets(self, *, role: Role, targets: Iterable[Target]) -> list[str]:
        """Replace the pods of `role`; returns the names that went away."""
        wanted = {t.name: t for t in targets if t.role is role}
        gone = [name for name, pod in self._pods.items() if pod.role is role and name not in wanted]
        for name in gone:
            del self._pods[name]
        for name, target in wanted.items():
            pod = self._pods.get(name)
            if pod is None or pod.url != target.url:
                self._pods[name] = Pod(name=name, url=target.url, role=role)
        self.changed.set()
        return gone

    def get(self, name: str) -> Pod | None:
        return self._pods.get(name)

    def all(self) -> list[Pod]:
        return list(self._pods.values())

    def healthy(self, role: Role, *, compat_hash: str | None = None) -> list[Pod]:
        return [
            p for p in self._pods.values()
            if p.role is role and p.healthy
            and (compat_hash is None or not compat_hash or not p.compat_hash or p.compat_hash == compat_hash)
        ]

    def mark_failed(self, name: str) -> None:
        pod = self._pods.get(name)
        if pod is None:
            return
        pod.consecutive_failures += 1
        if pod.consecutive_failures >= self._unhealthy_after or pod.healthy:
            # A request-path failure takes the pod out at once; polling brings it back.
            pod.healthy = False

    def mark_ok(self, name: str) -> None:
        pod = self._pods.get(name)
        if pod is not None:
            pod.consecutive_failures = 0
            pod.healthy = True


def parse_load(text: str) -> PodLoad:
    """Sum the runtime's load gauges over all label sets of one pod's /metrics."""
    values = {Metric.REQUESTS_WAITING: 0.0, Metric.REQUESTS_RUNNING: 0.0, Metric.KV_CACHE_USAGE_RATIO: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in values:
            for sample in family.samples:
                if sample.name == family.name:
                    values[family.name] += float(sample.value)
    return PodLoad(
        requests_waiting=values[Metric.REQUESTS_WAITING],
        requests_running=values[Metric.REQUESTS_RUNNING],
        kv_cache_usage_ratio=values[Metric.KV_CACHE_USAGE_RATIO],
    )


class HealthPoller:
    """Polls every pod's info, readiness and load on a fixed period."""

    def __init__(self, *, pods: PodSet, client: httpx.AsyncClient, interval_seconds: float, timeout_seconds: float = 2.0) -> None:
        self._pods = pods
        self._client = client
        self._interval_seconds = interval_seconds
        self._timeout_seconds = timeout_seconds
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(pod) for pod in self._pods.all()))

    async def _run(self) -> None:
        while True:
            await self.poll_once()
            self._pods.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pods.changed.wait(), timeout=self._interval_seconds)

    async def _poll(self, pod: Pod) -> None:
        try:
            ready = await self._client.get(f"{pod.url}/ready", timeout=self._timeout_seconds)
            if ready.status_code != 200:
                raise httpx.HTTPStatusError("not ready", request=ready.request, response=ready)
            if not pod.compat_hash and not pod.kv_endpoint:
                info = (await self._client.get(f"{pod.url}{INFO_PATH}", timeout=self._timeout_seconds)).json()
                pod.compat_hash = str(info.get("compat_hash", ""))
                pod.kv_endpoint = str(info.get("kv_endpoint", ""))
            metrics = await self._client.get(f"{pod.url}/metrics", timeout=self._timeout_seconds)
            load = parse_load(metrics.text)
            load.in_flight = pod.load.in_flight
            pod.load = load
        except (httpx.HTTPError, ValueError) as exc:
            was_healthy = pod.healthy
            pod.consecutive_failures += 1
            pod.healthy = False
            if was_healthy:
                log.warning("%s pod %s (%s) is unhealthy: %s", pod.role.value, pod.name, pod.url, exc)
            return
        if not pod.healthy:
            log.info("%s pod %s (%s) is healthy", pod.role.value, pod.name, pod.url)
        pod.consecutive_failures = 0
        pod.healthy = True
