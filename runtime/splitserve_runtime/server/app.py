"""The OpenAI-compatible HTTP server of one runtime process (`splitserve serve`).

:func:`build_app` composes routes, the API-key middleware, exception handlers and metrics
around an engine; the routes only translate HTTP to the serving classes and back. Nothing a
request does blocks the event loop for long (a large body is decoded in a separate process:
:mod:`.request_bodies`; a large prompt is tokenized on worker threads: :mod:`.prompts`), so
``/health`` and ``/metrics`` answer at once whatever the load.
:func:`main` owns the process concerns (vLLM's launcher split):
- the listener starts before the model loads, so ``/health`` answers (alive) while
  ``/ready`` says 503 until the engine is up;
- SIGTERM / SIGINT flip ``/ready`` to 503 at once and make new generation requests 503,
  while in-flight requests run to completion for up to ``--drain-timeout-seconds``; then
  the process exits 0 (a second SIGINT forces the exit);
- if the engine dies, or fails to load, the process exits 1 so Kubernetes restarts it, once
  the requests in flight have sent their error (each stream its ``engine_dead`` error event
  and ``[DONE]``; at most :data:`FAILED_ENGINE_FLUSH_SECONDS`); a broken tensor/pipeline
  group (a rank killed) ends the process itself, after the same wait
  (:mod:`splitserve_runtime.engine.parallel.exit_hooks`).
``--role prefill|decode`` wraps the engine in :class:`~splitserve_runtime.disagg.engine.HandoffEngine`
(prefill: the KV server on ``--kv-port``; decode: the pulling connector); which path a request
takes is decided per request in :mod:`splitserve_runtime.disagg.routes`. A decode pod behind a
Gateway drives the prefill itself when an endpoint picker names the prefill pod in a header
(:mod:`splitserve_runtime.disagg.prefiller`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

import splitserve_contract as contract
from splitserve_runtime.auth import APIKeyConfigError, api_key_from_env
from splitserve_runtime.body_limit import BodySizeLimit
from splitserve_runtime.disagg.prefiller import IdentityProver, Prefiller
from splitserve_runtime.engine.parallel import exit_hooks
from splitserve_runtime.engine.parallel.placement import PlacementError, pin, resolve_placement
from splitserve_runtime.read_timeouts import http_protocol
from splitserve_runtime.server.auth import APIKeyMiddleware
from splitserve_runtime.server.engine_client import EngineClient
from splitserve_runtime.server.errors import install_exception_handlers, unavailable
from splitserve_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from splitserve_runtime.server.prompt_workers import PromptWorkers
from splitserve_runtime.server.prompts import PromptReader
from splitserve_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RuntimeInfo,
)
from splitserve_runtime.server.request_bodies import RequestReader
from splitserve_runtime.server.serving_chat import ChatService
from splitserve_runtime.server.serving_completions import CompletionsService
from splitserve_runtime.server.state import ServerState
from splitserve_runtime.termination import log_startup_failure, write_termination_message

logger = logging.getLogger("splitserve.server")

EngineLoader = Callable[[], Awaitable[EngineClient]]

ABORT_FLUSH_SECONDS = 1.0
"""After the drain timeout: how long aborted streams get to send their last event."""
FAILED_ENGINE_FLUSH_SECONDS = 3.0
"""After the engine failed: how long the requests in flight get to send their error before the
process exits."""
LAST_FRAMES_SECONDS = 0.5
"""A request stops counting in flight a few event-loop turns before its last bytes are written
(a stream's ``[DONE]`` and the end of its chunked body; a whole answer's JSON error, built by
the exception handler after the request closed): the margin a process that ends with
``os._exit`` gives them, also when every request closed before the exit hook ran."""


def build_app(
    *,
    engine: EngineClient | None,
    served_model_name: str,
    role: str,
    api_key: str | None,
    engine_loader: EngineLoader | None = None,
    compat_hash: str = "",
    kv_endpoint: str = "",
    block_size: int = contract.defaults.BLOCK_SIZE,
    max_request_body_bytes: int = contract.defaults.MAX_REQUEST_BODY_BYTES,
    prompt_workers: PromptWorkers | None = None,
    request_reader: RequestReader | None = None,
    prefill_headers: bool = False,
    http_endpoint: str = "",
    prefill_timeout_seconds: float = contract.defaults.PREFILL_TIMEOUT_SECONDS,
) -> FastAPI:
    """The ASGI app. Give either a constructed `engine` (started and shut down by the app's
    lifespan) or an `engine_loader` that builds one in the background after the listener is
    up. `api_key` empty or None disables authentication. `compat_hash`, `kv_endpoint` and
    `block_size` are reported at contract.INFO_PATH for the router. `prompt_workers` tokenize
    large prompts off the event loop (default: :class:`PromptWorkers` with its defaults);
    `request_reader` decodes large bodies off it (default: :class:`RequestReader`).
    `prefill_headers` (decode pods behind a Gateway endpoint picker): honour the picker's
    prefill headers (:mod:`.prefiller`); off, they are ignored like any unknown header.
    `http_endpoint`: the host:port other pods reach this one at, which the pod-info route's
    identity proof binds ("": no proof is given)."""
    if (engine is None) == (engine_loader is None):
        raise ValueError("give exactly one of engine and engine_loader")
    state = ServerState(served_model_name=served_model_name, role=role, prefill_headers=prefill_headers)
    metrics = ServerMetrics(
        role=role,
        model=served_model_name,
        stats_source=lambda: state.engine_or_none.stats() if state.engine_or_none is not None else None,
    )
    workers = prompt_workers if prompt_workers is not None else PromptWorkers()
    prompts = PromptReader(workers=workers, metrics=metrics)
    prefiller = Prefiller(metrics=metrics, budget_seconds=prefill_timeout_seconds)
    completions = CompletionsService(state=state, metrics=metrics, prompts=prompts, prefiller=prefiller)
    chat = ChatService(state=state, metrics=metrics, prompts=prompts, prefiller=prefiller)
    reader = request_reader if request_reader is not None else RequestReader()
    lifespan = _make_lifespan(
        state=state, engine=engine, engine_loader=engine_loader, workers=workers, reader=reader, prefiller=prefiller
    )
    app = FastAPI(title="splitserve", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.metrics = metrics
    install_exception_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)  # inside the key check
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    _add_health_routes(app, state=state, metrics=metrics)
    _add_info_route(
        app,
        state=state,
        role=role,
        served_model_name=served_model_name,
        compat_hash=compat_hash,
        kv_endpoint=kv_endpoint,
        block_size=block_size,
        http_endpoint=http_endpoint,
    )
    _add_openai_routes(
        app, state=state, served_model_name=served_model_name, completions=completions, chat=chat, reader=reader
    )
    return app


def _make_lifespan(
    *,
    state: ServerState,
    engine: EngineClient | None,
    engine_loader: EngineLoader | None,
    workers: PromptWorkers,
    reader: RequestReader,
    prefiller: Prefiller,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start the given engine (or load one in the background); shut it, the prompt workers,
    the body decoder and the prefill client down on exit."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading: asyncio.Task[None] | None = None
        remove_exit_hook = exit_hooks.add(
            _flush_before_exit(state=state, loop=asyncio.get_running_loop()), stage="flush"
        )
        if engine is not None:
            await engine.start()
            state.attach_engine(engine=engine)
        elif engine_loader is not None:
            loading = asyncio.create_task(_load(state=state, loader=engine_loader))
        try:
            yield
        finally:
            remove_exit_hook()
            if loading is not None and not loading.done():
                loading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loading
            workers.shutdown()
            reader.shutdown()
            await prefiller.aclose()
            running = state.engine_or_none
            if running is not None:
                await running.shutdown()

    return lifespan


def _flush_before_exit(*, state: ServerState, loop: asyncio.AbstractEventLoop) -> exit_hooks.Hook:
    """The exit hook that holds a dying process (a broken parallel group; the engine has just
    failed every stream) until the requests in flight have sent their error, at most
    FAILED_ENGINE_FLUSH_SECONDS. Runs on the thread that found the break."""
    loop_thread = threading.get_ident()

    async def flush() -> None:
        if state.num_in_flight:
            logger.warning(
                "the process is ending: %d request(s) in flight get up to %.0f s to send their error",
                state.num_in_flight,
                FAILED_ENGINE_FLUSH_SECONDS,
            )
            await state.wait_idle(timeout_seconds=FAILED_ENGINE_FLUSH_SECONDS)
        await asyncio.sleep(LAST_FRAMES_SECONDS)

    def hook(reason: str) -> None:
        if threading.get_ident() == loop_thread or loop.is_closed():
            return  # the loop cannot run while its own thread waits here
        future = asyncio.run_coroutine_threadsafe(flush(), loop)
        try:
            future.result(timeout=FAILED_ENGINE_FLUSH_SECONDS + 2 * LAST_FRAMES_SECONDS)
        except Exception:  # late, or the loop is closing: the exit goes ahead
            future.cancel()

    return hook


def _add_health_routes(app: FastAPI, *, state: ServerState, metrics: ServerMetrics) -> None:
    """/health (alive), /ready (engine up, not draining) and the Prometheus metrics."""

    @app.get("/health")
    async def health() -> Response:
        if not state.is_alive:
            raise unavailable("the inference engine is not healthy", code="unhealthy")
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.is_ready:
            return JSONResponse({"status": "ready"})
        reason = (
            "draining"
            if state.is_draining
            else ("loading" if state.engine_or_none is None and state.is_alive else "unhealthy")
        )
        raise unavailable(f"not ready: {reason}", code=reason)

    @app.get(contract.METRICS_PATH)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _add_info_route(
    app: FastAPI,
    *,
    state: ServerState,
    role: str,
    served_model_name: str,
    compat_hash: str,
    kv_endpoint: str,
    block_size: int,
    http_endpoint: str,
) -> None:
    """contract.INFO_PATH: what the router needs to pair prefill and decode pods; asked with a
    nonce, the proof a decode pod needs before it sends this pod a client's request
    (:meth:`splitserve_runtime.disagg.prefiller.Prefiller.identity_problem`), bound to ``http_endpoint``."""

    @app.get(contract.INFO_PATH)
    async def info(nonce: str | None = None) -> RuntimeInfo:
        running = state.engine_or_none
        auth = getattr(running, "auth", None)  # the handoff engine's key policy (prefill, decode)
        proof = (
            auth.identity_proof(nonce=nonce, role=role, endpoint=http_endpoint)
            if nonce is not None and isinstance(auth, IdentityProver)
            else None
        )
        return RuntimeInfo(
            role=role,
            model=served_model_name,
            compat_hash=compat_hash,
            kv_endpoint=kv_endpoint,
            block_size=block_size,
            max_model_len=running.max_model_len if running is not None else None,
            identity_proof=proof,
        )


def _add_openai_routes(
    app: FastAPI,
    *,
    state: ServerState,
    served_model_name: str,
    completions: CompletionsService,
    chat: ChatService,
    reader: RequestReader,
) -> None:
    """/v1/models, /v1/completions and /v1/chat/completions."""

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        running = state.engine_or_none
        return ModelList(
            data=[ModelCard(id=served_model_name, max_model_len=running.max_model_len if running is not None else None)]
        )

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await reader.read(request, CompletionRequest)
        return await completions.create(body=body, request=request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = await reader.read(request, ChatCompletionRequest)
        return await chat.create(body=body, request=request)


async def _load(*, state: ServerState, loader: EngineLoader) -> None:
    started = time.monotonic()
    try:
        engine = await loader()
        await engine.start()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # an expected failure (bad model, revision, hub) is one ERROR line, no traceback
        state.load_error = log_startup_failure(exc, log=logger, what="loading the model failed")
        return
    state.attach_engine(engine=engine)
    logger.info("ready: model %r loaded in %.1f s", state.served_model_name, time.monotonic() - started)


def _version() -> str:
    from splitserve_runtime import __version__

    return __version__


# ----------------------------------------------------------------------------- process


class DrainingServer(uvicorn.Server):
    """uvicorn with the process policy of `splitserve serve` (checked every 0.1 s tick):
    SIGTERM/SIGINT drain instead of closing the listener at once; a failed model load or
    a dead engine stops the server with `exit_code` 1."""

    def __init__(self, config: uvicorn.Config, *, state: ServerState, drain_timeout_seconds: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_seconds = drain_timeout_seconds
        self._drain_started: float | None = None
        self._engine_failed_at: float | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flip flags here; on_tick does the rest.
        if self._state.is_draining and sig == signal.SIGINT:
            self.force_exit = True
            self.should_exit = True
            return
        self._state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        state = self._state
        if state.load_error is not None:
            self.exit_code = 1
            return True
        running = state.engine_or_none
        if running is not None and not running.is_healthy:
            return await self._exit_after_failure(counter)
        if state.is_draining:
            now = time.monotonic()
            if self._drain_started is None:
                self._drain_started = now
                logger.info(
                    "draining: %d request(s) in flight, grace %.0f s", state.num_in_flight, self._drain_timeout_seconds
                )
            # A prefill pod also waits for decode pods to pull the KV it exported (their
            # requests are in flight elsewhere); the drain timeout still bounds it.
            unclaimed = int(getattr(running, "num_unclaimed_exports", 0))
            if state.num_in_flight == 0 and unclaimed == 0:
                logger.info("drained in %.1f s", now - self._drain_started)
                return True
            if now - self._drain_started >= self._drain_timeout_seconds:
                await self._abort_in_flight()
                return True
        return await super().on_tick(counter)

    async def _exit_after_failure(self, counter: int) -> bool:
        """The engine failed (its streams are ending with an error): exit 1 once no request is
        in flight, at most FAILED_ENGINE_FLUSH_SECONDS later (uvicorn's graceful shutdown then
        writes what is left). A broken parallel group ends the process itself, with its own
        status and termination message, after the same wait (exit hooks): leave it to that."""
        now = time.monotonic()
        if self._engine_failed_at is None:
            self._engine_failed_at = now
            logger.error(
                "the engine is no longer healthy; exiting once the %d request(s) in flight "
                "have sent their error (at most %.0f s)",
                self._state.num_in_flight,
                FAILED_ENGINE_FLUSH_SECONDS,
            )
        waited = now - self._engine_failed_at
        group_exit = exit_hooks.started() and waited < 2 * FAILED_ENGINE_FLUSH_SECONDS
        if not group_exit and (self._state.num_in_flight == 0 or waited >= FAILED_ENGINE_FLUSH_SECONDS):
            self.exit_code = 1
            return True
        return await super().on_tick(counter)

    async def _abort_in_flight(self) -> None:
        """Past the grace: abort what is left so each stream ends with an error event (not a
        cut connection), then give the responses a moment to flush."""
        state = self._state
        logger.warning("drain timeout: aborting %d request(s)", state.num_in_flight)
        running = state.engine_or_none
        if running is not None:
            for request_id in state.in_flight_request_ids:
                running.abort(request_id)
        await state.wait_idle(timeout_seconds=ABORT_FLUSH_SECONDS)


def _import_engine_class() -> Any:
    from splitserve_runtime.engine.async_engine import AsyncEngine

    return AsyncEngine


def _default_served_name(model: str) -> str:
    for prefix in ("hf://", "pvc://", "file://"):
        if model.startswith(prefix):
            rest = model[len(prefix) :]
            return rest if prefix == "hf://" else os.path.basename(rest.rstrip("/"))
    return os.path.basename(model.rstrip("/")) or model


def _advertised_host(args: contract.ServeArgs) -> str:
    """The host other pods reach this pod at: ``--host``, or the pod's own IP for a wildcard."""
    if args.host in ("0.0.0.0", "::", ""):  # a wildcard is no address
        return os.environ.get(contract.ENV_POD_IP) or "127.0.0.1"
    return args.host


def _kv_endpoint(args: contract.ServeArgs) -> str:
    """host:port other pods reach this pod's KV port at ("" when aggregated: no KV leaves)."""
    if args.role == contract.Role.AGGREGATED.value:
        return ""
    return f"{_advertised_host(args)}:{args.kv_port}"


def parse_args(argv: list[str]) -> contract.ServeArgs:
    parser = argparse.ArgumentParser(
        prog="splitserve serve",
        allow_abbrev=False,  # --rol must not quietly mean --role
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions)"
        f"; the API key, if any, comes from ${contract.ENV_API_KEY}.",
    )
    contract.add_serve_arguments(parser)
    namespace = parser.parse_args(argv)
    args = contract.serve_args_from_namespace(namespace)
    if not args.model:
        parser.error("--model is required")
    return args


def main(argv: list[str]) -> int:
    """`splitserve serve`: listen at once, load the engine, drain on SIGTERM (a worker pod of
    a multi-pod group runs its ranks instead: :mod:`.worker_node`)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        placement = resolve_placement(args)
    except PlacementError as exc:
        logger.error("%s", exc)
        write_termination_message(str(exc))
        return 2
    args = pin(args, placement)
    if not placement.is_leader:
        from splitserve_runtime.server.worker_node import serve_worker_node

        return serve_worker_node(args, placement)
    served_name = args.served_model_name or _default_served_name(args.model)
    try:
        api_key = api_key_from_env()
    except APIKeyConfigError as exc:
        logger.error("%s", exc)
        write_termination_message(str(exc))
        return 2

    async def load() -> EngineClient:
        # torch is imported off the event loop, after the listener is up: /health answers
        # meanwhile (and `serve --help` never imports it)
        engine_class = await asyncio.to_thread(_import_engine_class)
        engine: EngineClient = engine_class.from_args(args)  # loads the model in start()
        if args.role in (contract.Role.PREFILL.value, contract.Role.DECODE.value):
            from splitserve_runtime.disagg.routes import build_handoff_engine

            return build_handoff_engine(engine=engine, args=args, kv_endpoint=kv_endpoint, metrics=app.state.metrics)
        return engine

    kv_endpoint = _kv_endpoint(args)
    app = build_app(
        engine=None,
        engine_loader=load,
        served_model_name=served_name,
        role=args.role,
        api_key=api_key,
        compat_hash=args.compat_hash,
        kv_endpoint=kv_endpoint,
        block_size=args.block_size,
        max_request_body_bytes=args.max_request_body_bytes,
        prefill_headers=args.prefill_headers,
        prefill_timeout_seconds=args.prefill_timeout_seconds,
        http_endpoint=f"{_advertised_host(args)}:{args.port}",
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        access_log=False,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=1,
        http=http_protocol(
            header_timeout_seconds=args.header_timeout_seconds, body_idle_timeout_seconds=args.body_idle_timeout_seconds
        ),
    )
    server = DrainingServer(config, state=app.state.server, drain_timeout_seconds=args.drain_timeout_seconds)
    logger.info(
        "serving %r as %r (role %s) on %s:%d, auth %s",
        args.model,
        served_name,
        args.role,
        args.host,
        args.port,
        "on" if api_key else "off",
    )
    server.run()
    if app.state.server.load_error is not None:
        write_termination_message(app.state.server.load_error)
    return server.exit_code
