"""`splitserve router`: the OpenAI-compatible front of an InferenceService.

Wires discovery (static flags or Kubernetes EndpointSlices), health polling, the prefill/decode
selection policy and the proxy into one FastAPI app. The router tokenizes only to hash prompt
prefixes for affinity (with the model's own tokenizer when `--model` is given, else fixed byte
chunks); the pods tokenize for real. It never holds KV and never generates.

A large request body is decoded off the event loop (:mod:`.bodies`). Affinity tokenizing
runs on the event loop, so it reads at most ``AFFINITY_PREFIX_CHARS`` of a
prompt (and ``AFFINITY_MESSAGES`` of a chat): affinity hashes only the leading blocks, and a prompt cut there is long whatever the
short-prompt threshold. A multi-megabyte prompt used to hold the router's loop for seconds.

The proxied routes skip FastAPI's own layers (:mod:`.hot_path`), and uvicorn runs on uvloop with
httptools' parser when they are installed (the ``runtime`` extra): each took a share of the
router's added latency (bench/router_overhead.py).

The pods run one engine (``--engine``): the bundled runtime, or vLLM. The router polls each
engine on its own paths and gauges (:mod:`.pods`) and sends both the same OpenAI requests,
disaggregated ones included: a vLLM prefill pod answers its NixlConnector's handoff parameters
where the bundled runtime answers its signed ones (:mod:`..disagg.vllm_handoff`), and the
decode pod gets them as they were written.

``/metrics`` adds two gauges to the router's counters, so a stuck request shows:
``splitserve_router_requests_in_flight`` (client requests inside the router, streams until
their last byte) and ``splitserve_router_upstream_requests_in_flight{pod}`` (the router's calls
to each pod, the load figure its policy uses).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve_contract import (
    ENV_MODEL_CACHE,
    Role,
    RouterArgs,
    RoutingPolicy,
    add_router_arguments,
    router_args_from_namespace,
)
from splitserve_contract.engines import Engine

from ..auth import ROUTER_OPEN_PATHS, APIKeyMiddleware, api_key_from_env
from ..body_limit import BodySizeLimit
from ..json_bodies import BodyDecoder
from ..read_timeouts import http_protocol
from . import metrics
from .aiohttp_transport import AiohttpTransport
from .discovery import SERVICE_SUFFIX, KubernetesDiscovery, parse_static
from .hot_path import ProxyEndpoint, RouterApp
from .pod_client import PodClient
from .pods import HealthPoller, PodSet
from .policy import PrefillSelector
from .proxy import Router, RouterConfig, Tokenize, error_response

log = logging.getLogger("splitserve.router")

OPEN_PATHS = ROUTER_OPEN_PATHS
PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")

AFFINITY_PREFIX_CHARS = 65_536
"""The most prompt (or rendered chat) characters the router tokenizes for affinity: far more
than the leading blocks it hashes, and about 50 ms of tokenizing at worst."""
AFFINITY_MESSAGES = 64
"""The leading chat messages rendered for affinity (rendering 150k messages took seconds)."""


def byte_chunk_tokens(text: str) -> list[int]:
    """Fallback 'tokens' without a tokenizer: 4-byte chunks of the UTF-8 text (≈ 1 token each)."""
    data = text.encode()
    return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]


def make_tokenize(*, model: str) -> Tokenize:
    tokenizer = None
    if model:
        from ..model.tokenizer import Tokenizer
        from ..model.uri import resolve_model_uri

        cache = os.environ.get(ENV_MODEL_CACHE)
        # the tokenizer is all the router reads: a download skips the weights
        model_dir = resolve_model_uri(model, cache_dir=Path(cache) if cache else None, weights=False)
        tokenizer = Tokenizer.from_dir(model_dir=model_dir)

    def tokenize(path: str, body: dict[str, Any]) -> list[int]:
        cut = AFFINITY_PREFIX_CHARS
        if path.endswith("/chat/completions"):
            messages = body.get("messages") or []
            if isinstance(messages, list):
                messages = messages[:AFFINITY_MESSAGES]
            if tokenizer is not None:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                return tokenizer.encode(text[:cut], add_special_tokens=False)
            return byte_chunk_tokens(json.dumps(messages, sort_keys=True)[:cut])
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
        if not isinstance(prompt, str):
            return []
        prompt = prompt[:cut]
        return tokenizer.encode(prompt) if tokenizer is not None else byte_chunk_tokens(prompt)

    return tokenize


def _engine(args: RouterArgs) -> Engine:
    """The pods' engine; an unknown one is refused here, at start, where the operator's pod
    shows the message."""
    try:
        return Engine(args.engine)
    except ValueError:
        raise ValueError(f"unknown --engine {args.engine!r}: one of {', '.join(e.value for e in Engine)}") from None


def _static_pods(args: RouterArgs) -> PodSet:
    """The pod set, filled from the static endpoint flags when discovery is static."""
    pods = PodSet()
    static = {
        Role.PREFILL: args.prefill_endpoints,
        Role.DECODE: args.decode_endpoints,
        Role.AGGREGATED: args.aggregated_endpoints,
    }
    if args.discovery == "static":
        for role, endpoints in static.items():
            pods.set_targets(role=role, targets=parse_static(role=role, endpoints=endpoints))
    return pods


def _make_lifespan(
    *,
    args: RouterArgs,
    engine: Engine,
    api_key: str | None,
    pods: PodSet,
    selector: PrefillSelector,
    tokenize: Tokenize | None,
    model_label: str,
    state: dict[str, Any],
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the HTTP client, health polling, discovery and the Router in ``state``."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        pod_client = PodClient(max_connections=1024)  # the proxied requests
        async with httpx.AsyncClient(transport=AiohttpTransport(max_connections=1024)) as client:  # polls, model list
            poller = HealthPoller(
                pods=pods,
                client=client,
                interval_seconds=args.health_interval_seconds,
                engine=engine,
                api_key=api_key,
            )
            discovery = None
            if args.discovery == "kubernetes":
                discovery = KubernetesDiscovery(
                    namespace=args.namespace,
                    inference_service=args.inference_service,
                    pods=pods,
                    roles=tuple(SERVICE_SUFFIX),
                )
                discovery.start()
            await poller.poll_once()
            poller.start()
            state["router"] = Router(
                pods=pods,
                selector=selector,
                pod_client=pod_client,
                recheck=poller.recheck,
                tokenize=tokenize or make_tokenize(model=args.model),
                config=RouterConfig(
                    served_model_name=args.served_model_name,
                    block_size=args.block_size,
                    short_prompt_threshold=args.short_prompt_threshold,
                    session_header=args.session_header,
                    request_timeout_seconds=args.request_timeout_seconds,
                    model_label=model_label,
                    prefill_timeout_seconds=args.prefill_timeout_seconds,
                    prefill_overflow_tokens=args.prefill_overflow_tokens,
                    engine=engine,
                ),
            )
            state["client"] = client
            state["decoder"] = BodyDecoder()
            try:
                yield
            finally:
                await pod_client.aclose()
                state["decoder"].shutdown()
                if discovery is not None:
                    discovery.stop()
                await poller.stop()

    return lifespan


class CatchAllErrors:
    """Turns an unexpected exception into a 500 in the OpenAI error shape, with the traceback logged.

    Starlette's own fallback answers plain text and re-raises, and uvicorn closes the
    keep-alive connection of a request whose application raised. Catching here (outermost
    user middleware, pure ASGI) answers JSON and keeps the connection. An exception after the
    response started cannot be answered any more and is re-raised after logging.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method", ""), scope.get("path", ""))
            if started:
                raise
            response = error_response(status=500, message="internal router error", type_="server_error")
            await response(scope, receive, send)


def _add_health_routes(app: FastAPI, *, pods: PodSet, gauges: CollectorRegistry) -> None:
    """/health, /ready and /metrics (open even with an API key)."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        servable = pods.serving(Role.DECODE) or pods.serving(Role.AGGREGATED)
        if not servable:
            return JSONResponse(status_code=503, content={"status": "no healthy decode or aggregated pod"})
        return JSONResponse(content={"status": "ready"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.REGISTRY) + generate_latest(gauges), media_type=CONTENT_TYPE_LATEST)


def _add_openai_routes(app: FastAPI, *, pods: PodSet, state: dict[str, Any]) -> None:
    """/v1/models (from a healthy pod) and the proxied completion routes."""

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        pool = pods.serving(Role.DECODE) or pods.serving(Role.AGGREGATED) or pods.healthy(Role.PREFILL)
        if not pool:
            return error_response(status=503, message="no healthy pod to list models", type_="service_unavailable")
        client: httpx.AsyncClient = state["client"]
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            upstream = await client.get(f"{pool[0].url}/v1/models", headers=headers, timeout=5.0)
        except httpx.HTTPError as exc:
            return error_response(
                status=502, message=f"model listing failed: {type(exc).__name__}", type_="upstream_error"
            )
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    # The proxied routes are plain ASGI (:mod:`.hot_path`); registered here as well so another
    # method on them is a 405, and RouterApp sends their POSTs past FastAPI's stack.
    for path in PROXIED_PATHS:
        app.router.routes.append(Route(path, ProxyEndpoint(path=path, state=state), methods=["POST"]))


def _add_layers(
    app: RouterApp,
    *,
    args: RouterArgs,
    api_key: str | None,
    counter: dict[str, int],
    state: dict[str, Any],
    model_label: str,
) -> None:
    """The pure-ASGI layers, innermost first: body limit, in-flight count, API key (when one is
    set), errors (so it covers the key check too), the answer count (outermost, so it counts
    the errors' 500s). FastAPI adds them around its stack, and the same layers wrap each
    proxied endpoint that RouterApp calls directly."""
    layers: list[tuple[Any, dict[str, Any]]] = [
        (BodySizeLimit, {"max_bytes": args.max_request_body_bytes}),
        (metrics.InFlight, {"counter": counter}),
    ]
    if api_key:  # the pods' own key check (splitserve_runtime.auth), with the router's open paths
        layers.append((APIKeyMiddleware, {"api_key": api_key, "open_paths": ROUTER_OPEN_PATHS}))
    layers.append((CatchAllErrors, {}))
    layers.append((metrics.CountAnswers, {"model_label": model_label}))
    proxied: dict[str, ASGIApp] = {}
    for path in PROXIED_PATHS:
        endpoint: ASGIApp = ProxyEndpoint(path=path, state=state)
        for layer, options in layers:
            endpoint = layer(endpoint, **options)
        proxied[path] = endpoint
    for layer, options in layers:
        app.add_middleware(layer, **options)
    app.proxy_posts(proxied)


def build_app(*, args: RouterArgs, api_key: str | None = None, tokenize: Tokenize | None = None) -> RouterApp:
    engine = _engine(args)
    pods = _static_pods(args)
    selector = PrefillSelector(policy=RoutingPolicy(args.policy))
    pods.on_removed.append(selector.forget)
    model_label = args.served_model_name or args.model or "unknown"
    state: dict[str, Any] = {}
    lifespan = _make_lifespan(
        args=args,
        engine=engine,
        api_key=api_key,
        pods=pods,
        selector=selector,
        tokenize=tokenize,
        model_label=model_label,
        state=state,
    )
    app = RouterApp(title="splitserve router", lifespan=lifespan)
    app.state.pods = pods
    app.state.selector = selector
    counter = {"in_flight": 0}
    gauges = CollectorRegistry(auto_describe=True)
    gauges.register(metrics.InFlightCollector(pods=pods, counter=counter, model_label=model_label))
    _add_health_routes(app, pods=pods, gauges=gauges)
    _add_openai_routes(app, pods=pods, state=state)
    _add_layers(app, args=args, api_key=api_key, counter=counter, state=state, model_label=model_label)
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="splitserve router", description=__doc__, allow_abbrev=False
    )  # only a flag's full spelling sets it
    add_router_arguments(parser)
    args = router_args_from_namespace(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(args=args, api_key=api_key_from_env())
    except ValueError as exc:  # an unusable flag, or an API key set but empty (APIKeyConfigError)
        parser.error(str(exc))
    import uvicorn

    # What the imports built (FastAPI, pydantic, aiohttp: ~70k objects) lives as long as the
    # process: out of the collector's full scans, each of which cost ~50 ms of CPU (a 2-core
    # dev machine) in the middle of some request.
    gc.collect()
    gc.freeze()
    # loop "auto": uvloop where installed; the HTTP parser is httptools', with the read
    # deadlines of splitserve_runtime.read_timeouts
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(args.request_timeout_seconds),
        http=http_protocol(
            header_timeout_seconds=args.header_timeout_seconds, body_idle_timeout_seconds=args.body_idle_timeout_seconds
        ),
    )
    return 0
