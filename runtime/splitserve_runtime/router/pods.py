"""The router's view of the runtime pods: who exists (from discovery), who is healthy and how
loaded (from its own polling), and which pods may be paired.

Discovery only says which addresses back which role. Everything else the router learns from the
pods themselves: `GET /v1/splitserve/info` gives the compat hash and the KV endpoint, `/ready`
says whether the pod takes traffic, and four gauges of `/metrics` give its load. A pod that
fails a poll or a request is skipped until it answers a poll again, so a dead pod costs at most
one failed attempt per request, never a hang. One exception: a pod out
only because its polls timed out (it took the connection but answered late: a pod starved of
CPU, or a stalled one) is still sent requests when no decode or aggregated pod is healthy, since
it may well be serving; refusing every request with 503 would be certain failure. A slow prefill
pod is not: the decode pod computes the prompt instead. The router also re-polls a
pod at once when a request's answer is a server error (:meth:`HealthPoller.recheck`), to tell
a dying pod from a request it cannot serve.

Which paths and gauges those are depends on the pods' engine (one per InferenceService), so the
poller asks :data:`~splitserve_contract.engines.ENGINE_PODS` and
:data:`~splitserve_contract.engine_metrics.ENGINE_METRICS` instead of naming them: a vLLM pod
says "ready" on `/health`, has no pod info (its compat hash stays empty, which pairs with
anything, and it serves aggregated pools only), tells its context window in its `/v1/models`
cards, and exports its queue under `vllm:*` names with no prompt-token backlog. The context
window is best effort there: `/v1/models` is behind a vLLM pod's API key, and a pod whose
window is unknown is still served (the window only keeps over-long prompts off a
disaggregated prefill).
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

from splitserve_contract import Role
from splitserve_contract.engine_metrics import ENGINE_METRICS, SPLITSERVE_METRICS, EngineMetricNames
from splitserve_contract.engines import DEFAULT_ENGINE, ENGINE_PODS, Engine

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
    """The pod's context window (prompt + completion tokens), from its pod info (vLLM: its
    model card); None: unknown."""
    model_cards_read: bool = False
    """An engine without pod info: whether the pod has answered for its model cards."""
    healthy: bool = False
    slow: bool = False
    """Out of rotation only because its polls timed out since it was last healthy (no
    refusal, no "not ready", no failed request): tried when no pod of its role is healthy."""
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
        """The healthy pods of ``role`` (with ``compat_hash``, those that pair with it)."""
        return [p for p in self._matching(role, compat_hash) if p.healthy]

    def serving(self, role: Role, *, compat_hash: str | None = None) -> list[Pod]:
        """The pods of ``role`` a request may go to: the healthy ones, or when there is none
        the slow ones (:attr:`Pod.slow`). For the pods that answer: a prefill pod has a way
        round it (the decode pod computes the prompt), so prefill picks use :meth:`healthy`."""
        matching = self._matching(role, compat_hash)
        return [p for p in matching if p.healthy] or [p for p in matching if p.slow]

    def _matching(self, role: Role, compat_hash: str | None) -> list[Pod]:
        return [
            p
            for p in self._pods.values()
            if p.role is role
            and (compat_hash is None or not compat_hash or not p.compat_hash or p.compat_hash == compat_hash)
        ]

    def mark_failed(self, name: str) -> None:
        pod = self._pods.get(name)
        if pod is None:
            return
        pod.consecutive_failures += 1
        pod.slow = False
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
            pod.slow = False


def parse_load(text: str, names: EngineMetricNames = SPLITSERVE_METRICS) -> PodLoad:
    """One pod's load from its /metrics page, under its engine's ``names``. The request counts
    are summed over label sets and the KV usage ratio averaged: an engine that labels them per
    engine core (vLLM's ``engine`` label, one per data-parallel rank in the pod) holds several
    queues but one cache budget split evenly, and a summed ratio above 1 would read as a full
    pod. A pod without a prompt-token gauge (``names.prompt_tokens_waiting`` None) has None
    there: unknown, not empty (:attr:`.policy.PodLoad.queued_prompt_tokens`)."""
    wanted = {
        names.requests_waiting: "requests_waiting",
        names.requests_running: "requests_running",
        names.kv_cache_usage_ratio: "kv_cache_usage_ratio",
    }
    if names.prompt_tokens_waiting is not None:
        wanted[names.prompt_tokens_waiting] = "prompt_tokens_waiting"
    sums = dict.fromkeys(wanted.values(), 0.0)
    counts = dict.fromkeys(wanted.values(), 0)
    for family in text_string_to_metric_families(text):
        signal = wanted.get(family.name)
        if signal is None:
            continue
        for sample in family.samples:
            if sample.name == family.name:
                sums[signal] += float(sample.value)
                counts[signal] += 1
    kv_sets = counts["kv_cache_usage_ratio"]
    return PodLoad(
        requests_waiting=sums["requests_waiting"],
        requests_running=sums["requests_running"],
        kv_cache_usage_ratio=sums["kv_cache_usage_ratio"] / kv_sets if kv_sets else 0.0,
        prompt_tokens_waiting=sums.get("prompt_tokens_waiting"),
    )


def model_card_max_model_len(listing: object) -> int | None:
    """The context window of an OpenAI model list whose cards carry ``max_model_len`` (vLLM's
    ``/v1/models``): the smallest over the cards, since the router cannot tell which one a
    request names (a vLLM pod serves one base model, each LoRA adapter a card of the same
    window); None when no card has a usable one."""
    data = listing.get("data") if isinstance(listing, dict) else None
    limits = [
        card["max_model_len"]
        for card in (data if isinstance(data, list) else [])
        if isinstance(card, dict) and _positive_int(card.get("max_model_len"))
    ]
    return min(limits) if limits else None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class HealthPoller:
    """Polls every pod's info, readiness and load on a fixed period, on its engine's paths
    (module docstring). ``api_key``: sent to the one polled path a pod may guard (vLLM's
    ``/v1/models``); the same key the router's clients send through to the pods."""

    def __init__(
        self,
        *,
        pods: PodSet,
        client: httpx.AsyncClient,
        interval_seconds: float,
        timeout_seconds: float = 2.0,
        engine: Engine = DEFAULT_ENGINE,
        api_key: str | None = None,
    ) -> None:
        self._pods = pods
        self._client = client
        self._interval_seconds = interval_seconds
        self._timeout_seconds = timeout_seconds
        self._paths = ENGINE_PODS[engine]
        self._metric_names = ENGINE_METRICS[engine]
        self._models_headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
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
            ready = await self._client.get(f"{pod.url}{self._paths.ready_path}", timeout=self._timeout_seconds)
            if ready.status_code != 200:
                raise httpx.HTTPStatusError("not ready", request=ready.request, response=ready)
            if self._paths.info_path is None:
                if not pod.model_cards_read:
                    await self._read_model_cards(pod)
            elif not pod.compat_hash and not pod.kv_endpoint:
                info = (
                    await self._client.get(f"{pod.url}{self._paths.info_path}", timeout=self._timeout_seconds)
                ).json()
                pod.compat_hash = str(info.get("compat_hash", ""))
                pod.kv_endpoint = str(info.get("kv_endpoint", ""))
                limit = info.get("max_model_len")
                pod.max_model_len = limit if _positive_int(limit) else None
            metrics = await self._client.get(f"{pod.url}{self._paths.metrics_path}", timeout=self._timeout_seconds)
            load = parse_load(metrics.text, self._metric_names)
            load.in_flight = pod.load.in_flight
            load.in_flight_prompt_tokens = pod.load.in_flight_prompt_tokens
            pod.load = load
        except (httpx.HTTPError, ValueError) as exc:
            was_healthy = pod.healthy
            pod.consecutive_failures += 1
            pod.slow = isinstance(exc, httpx.TimeoutException) and (pod.healthy or pod.slow)
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
        pod.slow = False

    async def recheck(self, pod: Pod) -> bool:
        """Poll ``pod`` now (readiness and load, as the periodic poll does); whether it is
        healthy. The router asks after a server error, before sending the request elsewhere."""
        token = _IN_POLL.set(True)
        try:
            await self._poll(pod)
        finally:
            _IN_POLL.reset(token)
        return pod.healthy

    async def _read_model_cards(self, pod: Pod) -> None:
        """``pod.max_model_len`` from its model cards. A pod that answers (even a refusal: a
        key this router lacks) is not asked again, its answer will not change while it lives
        at that address; one that fails is asked on the next poll. Either way the pod's health
        is its readiness alone (module docstring)."""
        try:
            answer = await self._client.get(
                f"{pod.url}{self._paths.models_path}", headers=self._models_headers, timeout=self._timeout_seconds
            )
            if answer.status_code >= 500:
                answer.raise_for_status()
            pod.model_cards_read = True
            answer.raise_for_status()
            pod.max_model_len = model_card_max_model_len(answer.json())
        except (httpx.HTTPError, ValueError) as exc:
            log.debug(
                "poll %s pod %s: no context window from %s: %s", pod.role.value, pod.name, self._paths.models_path, exc
            )
