"""The router's own metrics (every series has role="router" and model, like the runtime's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve_contract import Role

from .pods import PodSet

REGISTRY = CollectorRegistry()
_LABELS = ("role", "model")


class _Bound:
    """Pre-binds role="router" so call sites only name the model (and extra labels), and keeps
    each label set's child: prometheus_client's ``labels()`` (checks and a lock) on every
    count cost about 3% of the router's CPU per request. The label values are few (model,
    outcome, route, role, status), never pod names."""

    def __init__(self, metric: Counter | Histogram) -> None:
        self._metric = metric
        self._children: dict[tuple[tuple[str, str], ...], Any] = {}

    def labels(self, **labels: str):  # type: ignore[no-untyped-def]
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metric.labels(role="router", **labels)
        return child


REQUESTS = _Bound(
    Counter(
        "splitserve_router_requests_total",
        "Client requests (/v1/ routes) the router answered, by outcome: success, client_error, "
        "upstream_error, unavailable, or internal_error (the router's own failure, a 500)",
        (*_LABELS, "outcome"),
        registry=REGISTRY,
    )
)
"""Every answer counts once: the :class:`~.proxy.Router` counts the requests it took (it knows
outcomes the status does not show, as a stream a pod cut off); :class:`CountAnswers` counts
every other answer (the router's refusals and its own 500s) by its status."""
COUNTED_BY_ROUTER = "splitserve.router.counted"
"""ASGI scope key the proxied endpoint sets once the Router has answered: it counted the answer."""
ROUTES = _Bound(
    Counter(
        "splitserve_router_routes_total",
        "Requests by route: disaggregated (prefill then decode), direct (a short prompt), fallback (prefill failed) or overflow (the prefill pool is full)",
        (*_LABELS, "route"),
        registry=REGISTRY,
    )
)
UPSTREAM_ERRORS = _Bound(
    Counter(
        "splitserve_router_upstream_errors_total",
        "Failed calls to runtime pods, by upstream role",
        (*_LABELS, "upstream"),
        registry=REGISTRY,
    )
)
PREFILL_RETRIES = _Bound(
    Counter(
        "splitserve_router_prefill_retries_total",
        "Prefill attempts repeated on another pod",
        _LABELS,
        registry=REGISTRY,
    )
)
FORWARD_RETRIES = _Bound(
    Counter(
        "splitserve_router_forward_retries_total",
        "Decode/aggregated sends repeated on another pod after a 503 (draining), a 429 (queue full), or a server error from a pod that then failed its health poll",
        (*_LABELS, "status"),
        registry=REGISTRY,
    )
)
PREFIX_QUERIED_BLOCKS = _Bound(
    Counter(
        "splitserve_router_prefix_queried_blocks_total",
        "Leading prompt blocks considered for affinity",
        _LABELS,
        registry=REGISTRY,
    )
)
PREFIX_MATCHED_BLOCKS = _Bound(
    Counter(
        "splitserve_router_prefix_matched_blocks_total",
        "Leading prompt blocks already routed to the chosen pod (affinity hits)",
        _LABELS,
        registry=REGISTRY,
    )
)
REQUEST_SECONDS = _Bound(
    Histogram(
        "splitserve_router_request_seconds",
        "Time from request to the upstream's response headers or stream end",
        _LABELS,
        registry=REGISTRY,
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    )
)


def outcome_of(status: int) -> str:
    """The ``outcome`` label of an answer the router made itself, from its status."""
    if status < 400:
        return "success"
    if status < 500:
        return "client_error"
    if status == 500:
        return "internal_error"
    if status == 503:
        return "unavailable"
    return "upstream_error"


class CountAnswers:
    """Counts in :data:`REQUESTS` each answer to a client request (``/v1/`` routes) that the
    Router did not count itself (:data:`COUNTED_BY_ROUTER`): body, key and JSON refusals, a busy
    decoder, the model listing, and the 500 of an unexpected exception, which nothing counted
    before. Outermost, so it sees the status of what the inner layers answer."""

    def __init__(self, app: ASGIApp, *, model_label: str) -> None:
        self._app = app
        self._model = model_label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self._app(scope, receive, send)
            return
        status: int | None = None

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._app(scope, receive, tracking_send)
        finally:
            if status is not None and not scope.get(COUNTED_BY_ROUTER):
                REQUESTS.labels(model=self._model, outcome=outcome_of(status)).inc()


class InFlight:
    """Counts the client requests inside the router (OpenAI routes), each until its response
    has sent its last byte or the request ended otherwise (an error, a disconnect)."""

    def __init__(self, app: ASGIApp, *, counter: dict[str, int]) -> None:
        self._app = app
        self._counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self._app(scope, receive, send)
            return
        self._counter["in_flight"] += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self._counter["in_flight"] -= 1


class InFlightCollector(Collector):
    """The router's gauges of live state (requests in flight, healthy pods per role), read from
    the live objects at scrape time."""

    def __init__(self, *, pods: PodSet, counter: dict[str, int], model_label: str) -> None:
        self._pods = pods
        self._counter = counter
        self._model = model_label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        requests = GaugeMetricFamily(
            "splitserve_router_requests_in_flight",
            "Client requests inside the router (a stream until its last byte)",
            labels=["role", "model"],
        )
        requests.add_metric(["router", self._model], self._counter["in_flight"])
        yield requests
        upstream = GaugeMetricFamily(
            "splitserve_router_upstream_requests_in_flight",
            "The router's requests to each pod that have not finished",
            labels=["role", "model", "pod"],
        )
        for pod in self._pods.all():
            upstream.add_metric(["router", self._model, pod.name], pod.load.in_flight)
        yield upstream
        healthy = GaugeMetricFamily(
            "splitserve_router_healthy_pods",
            "The pods of each role the router sends to now (discovered and answering its health polls)",
            labels=["role", "model", "upstream"],
        )
        for upstream_role in (Role.PREFILL, Role.DECODE, Role.AGGREGATED):
            healthy.add_metric(["router", self._model, upstream_role.value], len(self._pods.healthy(upstream_role)))
        yield healthy
