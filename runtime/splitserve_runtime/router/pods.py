"""The router's view of the runtime pods: who exists (from discovery), who is healthy and how
loaded (from its own polling), and which pods may be paired.

Discovery only says which addresses back which role. Everything else the router learns from the
pods themselves: `GET /v1/splitserve/info` gives the compat hash and the KV endpoint, `/ready`
says whether the pod takes traffic, and four gauges of `/metrics` give its load. A pod that
fails `unhealthy_after` polls in a row (or a request) is skipped until it answers again, so a
dead pod costs at most one failed attempt per request, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contract import INFO_PATH, Metric, Role

from .policy import Candidate, PodLoad

log = logging.getLogger(__name__)

_IN_POLL: contextvars.ContextVar[bool] = contextvars.ContextVar("splitserve_router_in_poll", default=False)
"""True inside the health poller's requests (the poller runs each poll in its own task context)."""


class _QuietPollRequests(logging.Filter):
    """Drops httpx's per-request INFO line ("HTTP Request: GET .../ready 200 OK") for poll
    requests: with two pods and a 1 s interval that was 4 INFO lines a second. The poller logs
    each poll's result itself at DEBUG and state changes at INFO/WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_IN_POLL.get() and record.levelno <= logging.INFO)


_QUIET_POLL_FILTER = _QuietPollRequests()


def _install_quiet_poll_filter() -> None:
    httpx_logger = logging.getLogger("httpx")
    if _QUIET_POLL_FILTER not in httpx_logger.filters:
        httpx_logger.addFilter(_QUIET_POLL_FILTER)


@dataclass
class Pod:
    name: str
    url: str  # http://host:port
    role: Role
    compat_hash: str = ""
    kv_endpoint: str = ""
    max_model_len: int | None = None
    """The pod's context window (prompt + completion tokens), from its pod info; None: unknown."""
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
        self.on_removed: list[Callable[[str], None]] = []
        """Called with each pod name discovery removes: what is kept per pod elsewhere (the
        prefix affinity index, session pins) goes with it, so pod churn does not grow it."""

    def set_targets(self, *, role: Role, targets: Iterable[Target]) -> list[str]:
        """Replace the pods of `role`; returns the names that went away."""
        wanted = {t.name: t for t in targets if t.role is role}
        gone = [name for name, pod in self._pods.items() if pod.role is role and name not in wanted]
        for name in gone:
            removed = self._pods.pop(name)
            log.info("%s pod %s (%s) removed", role.value, name, removed.url)
            for forget in self.on_removed:
                forget(name)
        for name, target in wanted.items():
            pod = self._pods.get(name)
            if pod is None or pod.url != target.url:
                self._pods[name] = Pod(name=name, url=target.url, role=role)
                log.info("%s pod %s (%s) added", role.value, name, target.url)
        self.changed.set()
        return gone

    def get(self, name: str) -> Pod | None:
        return self._pods.get(name)

    def all(self) -> list[Pod]:
        return list(self._pods.values())

    def healthy(self, role: Role, *, compat_hash: str | None = None) -> list[Pod]:
        return [
            p
            for p in self._pods.values()
            if p.role is role
            and p.healthy
            and (compat_hash is None or not compat_hash or not p.compat_hash or p.compat_hash == compat_hash)
        ]

    def mark_failed(self, name: str) -> None:
        pod = self._pods.get(name)
        if pod is None:
            return
        pod.consecutive_failures += 1
        if pod.consecutive_failures >= self._unhealthy_after or pod.healthy:
            # A request-path failure takes the pod out at once; polling brings it back.
            if pod.healthy:
                log.warning(
                    "%s pod %s (%s) failed a request; out of rotation until it answers a poll",
                    pod.role.value,
                    pod.name,
                    pod.url,
                )
            pod.healthy = False

    def mark_ok(self, name: str) -> None:
        pod = self._pods.get(name)
        if pod is not None:
            pod.consecutive_failures = 0
            pod.healthy = True


def parse_load(text: str) -> PodLoad:
    """Sum the runtime's load gauges over all label sets of one pod's /metrics."""
    values = {
        Metric.REQUESTS_WAITING: 0.0,
        Metric.REQUESTS_RUNNING: 0.0,
        Metric.KV_CACHE_USAGE_RATIO: 0.0,
        Metric.PROMPT_TOKENS_WAITING: 0.0,
    }
    for family in text_string_to_metric_families(text):
        if family.name in values:
            for sample in family.samples:
                if sample.name == family.name:
                    values[family.name] += float(sample.value)
    return PodLoad(
        requests_waiting=values[Metric.REQUESTS_WAITING],
        requests_running=values[Metric.REQUESTS_RUNNING],
        kv_cache_usage_ratio=values[Metric.KV_CACHE_USAGE_RATIO],
        prompt_tokens_waiting=values[Metric.PROMPT_TOKENS_WAITING],
    )


class HealthPoller:
    """Polls every pod's info, readiness and load on a fixed period."""

    def __init__(
        self, *, pods: PodSet, client: httpx.AsyncClient, interval_seconds: float, timeout_seconds: float = 2.0
    ) -> None:
        self._pods = pods
        self._client = client
        self._interval_seconds = interval_seconds
        self._timeout_seconds = timeout_seconds
        self._task: asyncio.Task[None] | None = None
        _install_quiet_poll_filter()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def poll_once(self) -> None:
        # gather() runs each poll in a task with a copy of this context: the flag stays there.
        token = _IN_POLL.set(True)
        try:
            await asyncio.gather(*(self._poll(pod) for pod in self._pods.all()))
        finally:
            _IN_POLL.reset(token)

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
                limit = info.get("max_model_len")
                pod.max_model_len = (
                    limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
                )
            metrics = await self._client.get(f"{pod.url}/metrics", timeout=self._timeout_seconds)
            load = parse_load(metrics.text)
            load.in_flight = pod.load.in_flight
            load.in_flight_prompt_tokens = pod.load.in_flight_prompt_tokens
            pod.load = load
        except (httpx.HTTPError, ValueError) as exc:
            was_healthy = pod.healthy
            pod.consecutive_failures += 1
            pod.healthy = False
            if was_healthy:
                log.warning("%s pod %s (%s) is unhealthy: %s", pod.role.value, pod.name, pod.url, exc)
            else:
                log.debug(
                    "poll %s pod %s: still unhealthy (%d failures): %s",
                    pod.role.value,
                    pod.name,
                    pod.consecutive_failures,
                    exc,
                )
            return
        if not pod.healthy:
            log.info("%s pod %s (%s) is healthy", pod.role.value, pod.name, pod.url)
        log.debug(
            "poll %s pod %s: ready, waiting=%g running=%g kv_usage=%.3f",
            pod.role.value,
            pod.name,
            pod.load.requests_waiting,
            pod.load.requests_running,
            pod.load.kv_cache_usage_ratio,
        )
        pod.consecutive_failures = 0
        pod.healthy = True
