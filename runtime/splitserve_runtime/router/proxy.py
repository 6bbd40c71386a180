"""One client request through the router: pick pods, hand the prompt from prefill to decode,
stream the answer back, and fail cleanly.

Disaggregated flow (the pull protocol of contract.KV_TRANSFER_PARAMS_FIELD):
1. the prompt goes to a prefill pod chosen by prefix affinity, as the client's own request with
   `max_tokens=1`, `stream=false` and `kv_transfer_params={"do_remote_decode": true}`
   (:mod:`splitserve_runtime.disagg.prefill_request`, shared with decode pods that drive a prefill
   themselves behind a Gateway); the pod computes the KV, samples the first token and answers
   with the handoff parameters;
2. the original request plus those parameters goes to a decode pod with the same compat hash
   and the most KV headroom; it pulls the KV it lacks and streams the rest of the answer.

Handoff parameters come only from our prefill pods: a client's own `kv_transfer_params` are
dropped on every route (they would let a client steer a decode pod's KV connection), and a
prefill pod's answer must name that pod's own KV endpoint (as its `/v1/splitserve/info` says).
The decode pod checks the prefill pod's signature on them as well (`transfer.auth`).

A request whose connection the pod closed before answering (a pooled keep-alive connection the
pod dropped as idle just as the router reused it: both sides' idle timeouts are 5 s) is sent
once more to the same pod on a fresh connection before that pod counts as failed: under a
steady burst that race took the only decode pod out of rotation and failed every request
until the next health poll.

A prefill pod that fails (connection error or 5xx) is retried on another pod, and when every
attempt failed the decode pod computes the prompt itself (route "fallback"); a client error
(4xx) is returned as is. A decode pod that refuses the handoff parameters the router brought
it (a 4xx with the error code `kv_transfer_params_rejected` or `invalid_kv_transfer_params`:
parameters computed for another tokenization of the prompt, a first token outside its
vocabulary, a signature it cannot check) is the prefill pod's problem, not the client's: the
request goes on without them to a decode pod that computes the prompt itself (counted as route
"fallback" as well as "disaggregated"). Prompts shorter than `short_prompt_threshold` tokens
skip prefill.

With `prefill_overflow_tokens` set, a request also skips prefill when every prefill pod has that
many prompt tokens queued (the pod's `splitserve_prompt_tokens_waiting` as last polled, or the
tokens of this router's prefill requests in flight there, whichever is larger) and a decode pod
has fewer in its own queue and in overflow requests in flight: that pod computes the prompt
(route "overflow"; NVIDIA Dynamo's conditional disaggregation). A prefill pool saturated by a
burst or a shift to longer prompts then borrows the decode pods' compute for the minutes its new
pods take to start, instead of queueing every request behind the backlog; the bound on a decode
pod's share keeps its decoding streams' inter-token latency in check.

A pod that answers a server error (5xx other than 503) before sending any of its answer is polled
again at once: when it is no longer healthy (a vLLM pod whose engine died answers its in-flight
requests 500 "EngineCore encountered an issue" while it shuts down) the request goes to another
pod, as for a pod that could not be reached; when it is healthy, the error was the request's own
and is returned as is (a request that crashes pods is not sent to crash another).

A decode pod that dies before answering gives 502; one that dies mid-stream ends the stream with
an OpenAI-style error event, so a client never waits past the read timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi.responses import JSONResponse, Response

from splitserve_contract import HEADER_REQUEST_ID, KV_TRANSFER_PARAMS_FIELD, Role, defaults
from splitserve_contract.engines import DEFAULT_ENGINE, Engine
from splitserve_contract.handoff import HandoffParams
from splitserve_contract.wire import (
    KV_TRANSFER_PARAMS_INVALID_CODE,
    KV_TRANSFER_PARAMS_REJECTED_CODE,
)
from splitserve_runtime.disagg.prefill_request import (
    FORWARDED_HEADERS,
    handoff_params,
    prefill_request_body,
)
from splitserve_runtime.disagg.vllm_handoff import VllmHandoff, vllm_handoff

from . import metrics
from .pod_client import PodClient, PodResponse, PodTimeout
from .pods import Pod, PodSet
from .policy import PrefillSelector, choose_decode, prefix_block_hashes
from .relay import RelayResponse

log = logging.getLogger(__name__)

MAX_PREFILL_ATTEMPTS = 3
MAX_FORWARD_ATTEMPTS = 3
RETRYABLE_STATUSES = frozenset({429, 503})
STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""What a request on a pooled connection the pod has just closed fails with (before any
response byte); such a request is sent once more on a new connection."""
HANDOFF_REFUSAL_STATUSES = frozenset({400, 403})
HANDOFF_REFUSAL_CODES = frozenset({KV_TRANSFER_PARAMS_REJECTED_CODE, KV_TRANSFER_PARAMS_INVALID_CODE})
"""A decode pod's answer to handoff parameters it will not use (see the module docstring)."""

Tokenize = Callable[[str, dict[str, Any]], list[int]]
"""(path, body) -> prompt token ids, for prefix hashing only."""


def error_response(
    *, status: int, message: str, type_: str, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": None, "code": code}},
        headers=headers,
    )


def encode_body(body: dict[str, Any]) -> bytes:
    """A body the router changed, as JSON for a pod. NaN and Infinity, which Python's decoder
    took from the client, go on as they came, as they do in a body the router forwards
    unchanged: the pod judges them (refusing to encode them was a 500)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
    return f"data: {json.dumps(body)}\n\n".encode()


@dataclass
class RouterConfig:
    served_model_name: str
    block_size: int
    short_prompt_threshold: int
    session_header: str
    request_timeout_seconds: float
    model_label: str
    prefill_timeout_seconds: float = defaults.PREFILL_TIMEOUT_SECONDS
    """Total time the prefill stage of one request may take, every attempt together (a pod
    that accepts and never answers, or drips its answer, included); then a decode pod computes
    the prompt (route "fallback"). 0: only ``request_timeout_seconds`` per attempt."""
    prefill_overflow_tokens: int = 0
    """Conditional disaggregation: when every prefill pod has at least this many prompt tokens
    queued, a request prefills on a decode pod with fewer than this many in its own queue and in
    overflow requests in flight (route "overflow"). 0: never."""
    engine: Engine = DEFAULT_ENGINE
    """The pods' engine: which handoff parameters a prefill pod answers (:mod:`..disagg.vllm_handoff`)."""


class Router:
    """Sends to the pods with ``pod_client.post`` (:mod:`.pod_client`), not through an httpx
    client: its cookie jar, redirect and auth layers, request and response models, and
    aiohttp's below them, cost most of the router's CPU per request (bench/router_overhead.py)
    and do nothing for a proxy."""

    def __init__(
        self,
        *,
        pods: PodSet,
        selector: PrefillSelector,
        pod_client: PodClient,
        config: RouterConfig,
        tokenize: Tokenize,
        recheck: Callable[[Pod], Awaitable[bool]] | None = None,
    ) -> None:
        """``recheck``: polls a pod now and says whether it is healthy
        (:meth:`~.pods.HealthPoller.recheck`); None: a server error is returned as is."""
        self._pods = pods
        self._recheck = recheck
        self._selector = selector
        self._pod_client = pod_client
        self._config = config
        self._tokenize = tokenize
        self._timeout = PodTimeout(
            connect_seconds=3.0,
            read_seconds=config.request_timeout_seconds,
            pool_seconds=config.request_timeout_seconds,
        )

    # ------------------------------------------------------------------ helpers
    def _headers(self, incoming: dict[str, str], request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in incoming.items() if k.lower() in FORWARDED_HEADERS}
        headers[HEADER_REQUEST_ID] = request_id
        headers["content-type"] = "application/json"
        return headers

    async def _send(self, *, pod: Pod, url: str, content: bytes, headers: dict[str, str], stream: bool) -> PodResponse:
        """POST ``content`` (a JSON body) to ``url``; a stale pooled connection is retried once
        (see the module docstring). Raises httpx.HTTPError when the pod really cannot be reached."""
        for attempt in (1, 2):
            try:
                response = await self._pod_client.post(
                    url, content=content, headers=headers, timeout=self._timeout, fresh=attempt == 2
                )
                if not stream:
                    try:
                        await response.aread()
                    finally:
                        await response.aclose()
                return response
            except STALE_CONNECTION_ERRORS as exc:
                if attempt == 2:
                    raise
                log.info(
                    "%s pod %s closed the connection before answering (%s); sending again",
                    pod.role.value,
                    pod.name,
                    type(exc).__name__,
                )
        raise AssertionError("unreachable")

    def _prompt(self, path: str, body: dict[str, Any]) -> tuple[int | None, list[bytes]]:
        """(prompt length in tokens, leading block hashes); (None, []) when untokenizable."""
        try:
            token_ids = self._tokenize(path, body)
        except Exception as exc:  # a prompt the tokenizer rejects is the pod's to report
            log.debug("cannot tokenize for affinity: %s", exc)
            return None, []
        return len(token_ids), prefix_block_hashes(token_ids, block_size=self._config.block_size)

    # ------------------------------------------------------------------ entry
    async def handle(
        self, *, path: str, body: dict[str, Any], headers: dict[str, str], raw: bytes | None = None
    ) -> Response:
        """Answer one client request; ``raw`` is the body as the client sent it (``body``
        decoded), forwarded as is where the router sends the body unchanged."""
        started = time.perf_counter()
        request_id = (
            headers.get(HEADER_REQUEST_ID) or f"rt-{os.urandom(16).hex()}"
        )  # 128 random bits, as uuid4 but without the UUID object
        if KV_TRANSFER_PARAMS_FIELD in body:  # only our prefill pods hand requests over
            log.debug("dropped the client's %s of request %s", KV_TRANSFER_PARAMS_FIELD, request_id)
            body = {k: v for k, v in body.items() if k != KV_TRANSFER_PARAMS_FIELD}
            raw = None
        content = raw if raw is not None else encode_body(body)
        session = headers.get(self._config.session_header.lower())
        num_prompt_tokens, hashes = self._prompt(path, body)
        metrics.PREFIX_QUERIED_BLOCKS.labels(model=self._config.model_label).inc(len(hashes))
        fwd_headers = self._headers(headers, request_id)

        if self._pods.serving(Role.AGGREGATED):

            def pick_aggregated(exclude: frozenset[str]) -> Pod | None:
                choice = self._selector.choose(
                    candidates=[p.candidate() for p in self._pods.serving(Role.AGGREGATED)],
                    hashes=hashes,
                    session=session,
                    exclude=exclude,
                )
                if choice is None:
                    return None
                self._record(choice.pod, hashes, choice.matched_blocks)
                return self._pods.get(choice.pod)

            return await self._forward(
                pick=pick_aggregated,
                path=path,
                content=content,
                headers=fwd_headers,
                started=started,
                unavailable="no aggregated pod is healthy",
            )

        prefill_pods = self._pods.healthy(Role.PREFILL)
        short = num_prompt_tokens is not None and num_prompt_tokens < self._config.short_prompt_threshold
        if short or not prefill_pods:
            if not short and not prefill_pods:
                log.info("no prefill pod healthy; decode computes the prompt itself")
            metrics.ROUTES.labels(model=self._config.model_label, route="direct").inc()
            return await self._forward(
                pick=lambda exclude: self._pick_decode_computing(hashes, exclude=exclude),
                path=path,
                content=content,
                headers=fwd_headers,
                started=started,
                unavailable="no decode pod is healthy",
            )

        if self._cannot_fit(body, num_prompt_tokens):
            # The decode pods would refuse it after the prefill pod computed and pinned its KV:
            # a decode pod answers it without a handoff (its own 400, or the answer when the
            # router's count, an estimate without the pods' tokenizer, was too high).
            metrics.ROUTES.labels(model=self._config.model_label, route="direct").inc()
            return await self._forward(
                pick=lambda exclude: self._pick_decode_computing(hashes, exclude=exclude),
                path=path,
                content=content,
                headers=fwd_headers,
                started=started,
                unavailable="no decode pod is healthy",
            )

        overflow = self._overflow_exclusions(prefill_pods, num_prompt_tokens)
        if overflow is not None:
            metrics.ROUTES.labels(model=self._config.model_label, route="overflow").inc()
            tokens = num_prompt_tokens or 0
            return await self._forward(
                pick=lambda exclude: self._pick_decode_computing(hashes, exclude=exclude | overflow),
                path=path,
                content=content,
                headers=fwd_headers,
                started=started,
                unavailable="no decode pod is healthy",
                prompt_tokens=tokens,
            )

        handoff = await self._prefill(
            path=path,
            body=body,
            headers=fwd_headers,
            hashes=hashes,
            session=session,
            prompt_tokens=num_prompt_tokens or 0,
        )
        if isinstance(handoff, Response):
            if handoff.status_code < 500:
                return handoff
            if not self._pods.serving(Role.DECODE):
                metrics.REQUESTS.labels(model=self._config.model_label, outcome="upstream_error").inc()
                return handoff
            # Every prefill attempt failed on the server side: degrade to computing the prompt
            # on the decode pod rather than failing the client.
            log.warning("prefill failed (%d); the decode pod computes the prompt itself", handoff.status_code)
            metrics.ROUTES.labels(model=self._config.model_label, route="fallback").inc()
            return await self._forward(
                pick=lambda exclude: self._pick_decode_computing(hashes, exclude=exclude),
                path=path,
                content=content,
                headers=fwd_headers,
                started=started,
                unavailable="no decode pod is healthy",
            )
        prefill_pod, params = handoff
        metrics.ROUTES.labels(model=self._config.model_label, route="disaggregated").inc()

        async def compute_on_decode(reason: str) -> Response:
            log.warning("%s; a decode pod computes the prompt of request %s itself", reason, request_id)
            metrics.ROUTES.labels(model=self._config.model_label, route="fallback").inc()
            return await self._forward(
                pick=lambda exclude: self._pick_decode_computing(hashes, exclude=exclude),
                path=path,
                content=content,
                headers=fwd_headers,
                started=started,
                unavailable="no decode pod is healthy",
            )

        return await self._forward(
            pick=lambda exclude: self._pick_decode(compat_hash=prefill_pod.compat_hash or None, exclude=exclude),
            path=path,
            content=encode_body({**body, KV_TRANSFER_PARAMS_FIELD: params.to_json()}),
            headers=fwd_headers,
            started=started,
            unavailable=f"no healthy decode pod matches compat hash {prefill_pod.compat_hash!r}",
            on_refused_handoff=compute_on_decode,
        )

    def _record(self, pod: str, hashes: Sequence[bytes], matched_blocks: int) -> None:
        self._selector.record(pod=pod, hashes=hashes)
        metrics.PREFIX_MATCHED_BLOCKS.labels(model=self._config.model_label).inc(matched_blocks)

    def _prefill_pod_failed(self, pod: Pod, problem: str, *, then: str) -> None:
        """A prefill pod that could not be reached or answer: out of rotation until the health
        poll readmits it, out of the affinity index, counted as an upstream error."""
        log.warning("%s; %s", problem, then)
        self._pods.mark_failed(pod.name)
        self._selector.forget(pod.name)
        metrics.UPSTREAM_ERRORS.labels(model=self._config.model_label, upstream="prefill").inc()

    def _cannot_fit(self, body: dict[str, Any], num_prompt_tokens: int | None) -> bool:
        """Whether the prompt plus the completion (``max_tokens``, else one token, as the pods'
        own check) exceeds the context window of every healthy decode pod (as their pod info
        says; False while any is unknown)."""
        decode = self._pods.serving(Role.DECODE)
        limits = [p.max_model_len for p in decode]
        if num_prompt_tokens is None or not decode or any(limit is None for limit in limits):
            return False
        requested = body.get("max_tokens")
        if requested is None:
            requested = body.get("max_completion_tokens")
        completion = (
            requested if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0 else 1
        )
        return num_prompt_tokens + completion > max(limit or 0 for limit in limits)

    def _overflow_exclusions(self, prefill_pods: Sequence[Pod], num_prompt_tokens: int | None) -> frozenset[str] | None:
        """For a request that overflows to the decode pool, the decode pods already at the limit
        (not to be picked); None when it stays on the prefill pool: overflow off, an untokenized
        prompt, a prefill pod with fewer than the limit queued, or no decode pod under it
        (module docstring)."""
        limit = self._config.prefill_overflow_tokens
        if limit <= 0 or num_prompt_tokens is None or not prefill_pods:
            return None
        if min(p.load.queued_prompt_tokens for p in prefill_pods) < limit:
            return None
        decode = self._pods.serving(Role.DECODE)
        full = frozenset(p.name for p in decode if p.load.queued_prompt_tokens >= limit)
        return full if len(full) < len(decode) else None

    def _pick_decode(self, *, compat_hash: str | None, exclude: frozenset[str] = frozenset()) -> Pod | None:
        candidates = self._pods.serving(Role.DECODE, compat_hash=compat_hash)
        name = choose_decode(candidates=[p.candidate() for p in candidates], exclude=exclude)
        return self._pods.get(name) if name else None

    def _pick_decode_computing(self, hashes: Sequence[bytes], *, exclude: frozenset[str]) -> Pod | None:
        """A decode pod for a prompt it computes itself: prefix affinity within the KV-headroom
        slack (:func:`.policy.choose_decode`), recorded as the prefill pods' choices are, so an
        overflowed burst sharing a system prompt reuses one decode pod's prefix cache."""
        index = self._selector.index
        name = choose_decode(
            candidates=[p.candidate() for p in self._pods.serving(Role.DECODE)],
            exclude=exclude,
            matched_blocks=lambda pod: index.matched_blocks(pod=pod, hashes=hashes),
        )
        if name is None:
            return None
        self._record(name, hashes, index.matched_blocks(pod=name, hashes=hashes))
        return self._pods.get(name)

    def _unavailable(self, message: str) -> JSONResponse:
        metrics.REQUESTS.labels(model=self._config.model_label, outcome="unavailable").inc()
        return error_response(status=503, message=message, type_="service_unavailable", code="no_healthy_pod")

    # ------------------------------------------------------------------ prefill
    async def _prefill(
        self,
        *,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        hashes: list[bytes],
        session: str | None,
        prompt_tokens: int,
    ) -> tuple[Pod, HandoffParams | VllmHandoff] | Response:
        prefill_body = encode_body(prefill_request_body(body))
        tried: set[str] = set()
        last_error = "no prefill pod is healthy"
        budget = self._config.prefill_timeout_seconds
        deadline = asyncio.get_running_loop().time() + budget if budget > 0 else None
        for attempt in range(MAX_PREFILL_ATTEMPTS):
            choice = self._selector.choose(
                candidates=[p.candidate() for p in self._pods.healthy(Role.PREFILL)],
                hashes=hashes,
                session=session,
                exclude=frozenset(tried),
            )
            if choice is None:
                break
            pod = self._pods.get(choice.pod)
            if pod is None:
                tried.add(choice.pod)
                continue
            tried.add(pod.name)
            if attempt:
                metrics.PREFILL_RETRIES.labels(model=self._config.model_label).inc()
            uncached = max(0, prompt_tokens - choice.matched_blocks * self._config.block_size)
            _acquire(pod, uncached)
            try:
                async with asyncio.timeout_at(deadline):
                    response = await self._send(
                        pod=pod, url=f"{pod.url}{path}", content=prefill_body, headers=headers, stream=False
                    )
            except TimeoutError:
                # Stalled or dripping: the budget is spent, whatever is left of the attempts.
                last_error = f"prefill pod {pod.name} did not answer within the prefill budget of {budget:g} s"
                self._prefill_pod_failed(pod, last_error, then="a decode pod computes the prompt")
                break
            except httpx.HTTPError as exc:
                last_error = f"prefill pod {pod.name} failed: {type(exc).__name__}: {exc}"
                self._prefill_pod_failed(pod, last_error, then="retrying elsewhere")
                continue
            finally:
                _release(pod, uncached)
            if response.status_code >= 500:
                last_error = f"prefill pod {pod.name} answered {response.status_code}"
                log.warning("%s; retrying elsewhere", last_error)
                self._pods.mark_failed(pod.name)
                metrics.UPSTREAM_ERRORS.labels(model=self._config.model_label, upstream="prefill").inc()
                continue
            if response.status_code >= 400:
                metrics.REQUESTS.labels(model=self._config.model_label, outcome="client_error").inc()
                return Response(
                    content=response.content,
                    status_code=response.status_code,
                    media_type="application/json",
                    headers=_passthrough_headers(response),
                )
            try:
                params = self._handoff(response.json(), pod)
            except ValueError:
                params = None
            if params is None:
                last_error = f"prefill pod {pod.name} returned no {KV_TRANSFER_PARAMS_FIELD} for its own KV endpoint"
                log.warning("%s; retrying elsewhere", last_error)
                self._pods.mark_failed(pod.name)
                continue
            self._record(pod.name, hashes, choice.matched_blocks)
            return pod, params
        return error_response(
            status=502 if tried else 503, message=last_error, type_="upstream_error", code="prefill_failed"
        )

    def _handoff(self, answer: object, pod: Pod) -> HandoffParams | VllmHandoff | None:
        """The handoff parameters of a prefill pod's answer, in its engine's schema, when they
        name that pod's own KV (raises ValueError for malformed ones)."""
        if self._config.engine is Engine.VLLM:
            return vllm_handoff(answer, prefill_host=urlsplit(pod.url).hostname or "")
        params = handoff_params(answer)
        if params is not None and pod.kv_endpoint and params.remote_endpoint != pod.kv_endpoint:
            return None
        return params

    # ------------------------------------------------------------------ forward
    async def _forward(
        self,
        *,
        pick: Callable[[frozenset[str]], Pod | None],
        path: str,
        content: bytes,
        headers: dict[str, str],
        started: float,
        unavailable: str,
        prompt_tokens: int = 0,
        on_refused_handoff: Callable[[str], Awaitable[Response]] | None = None,
    ) -> Response:
        """Send to the pod `pick` chooses; a pod that cannot be reached, or answers 503
        (draining) or 429 (its queue is full) before sending anything, is skipped for another
        one while one is left, so a scale-down or a full pod loses no request. `prompt_tokens`
        count in the pod's ``in_flight_prompt_tokens`` until the answer ends (an overflow
        request's share of a decode pod). `on_refused_handoff`: the answer (given the reason)
        when the pod refuses the handoff parameters `content` carries (module docstring)."""
        tried: set[str] = set()
        last_error = unavailable
        for _attempt in range(MAX_FORWARD_ATTEMPTS):
            pod = pick(frozenset(tried))
            if pod is None:
                break
            tried.add(pod.name)
            _acquire(pod, prompt_tokens)
            try:
                upstream = await self._send(
                    pod=pod, url=f"{pod.url}{path}", content=content, headers=headers, stream=True
                )
            except httpx.HTTPError as exc:
                _release(pod, prompt_tokens)
                self._pods.mark_failed(pod.name)
                metrics.UPSTREAM_ERRORS.labels(model=self._config.model_label, upstream=pod.role.value).inc()
                last_error = f"{pod.role.value} pod {pod.name} failed: {type(exc).__name__}"
                continue
            if on_refused_handoff is not None and upstream.status_code in HANDOFF_REFUSAL_STATUSES:
                try:
                    answer = await upstream.aread()
                except httpx.HTTPError as exc:
                    self._pods.mark_failed(pod.name)
                    metrics.REQUESTS.labels(model=self._config.model_label, outcome="upstream_error").inc()
                    return error_response(
                        status=502,
                        message=f"{pod.role.value} pod {pod.name} died mid-response: {type(exc).__name__}",
                        type_="upstream_error",
                        code="decode_failed",
                    )
                finally:
                    _release(pod, prompt_tokens)
                    await upstream.aclose()
                refusal = _handoff_refusal(answer)
                if refusal is not None:
                    return await on_refused_handoff(f"decode pod {pod.name} refused the handoff: {refusal}")
                self._finish(upstream.status_code, started)
                return Response(
                    content=answer,
                    status_code=upstream.status_code,
                    media_type="application/json",
                    headers=_passthrough_headers(upstream),
                )
            if await self._pod_is_failing(pod, upstream.status_code):
                _release(pod, prompt_tokens)
                await upstream.aclose()
                metrics.UPSTREAM_ERRORS.labels(model=self._config.model_label, upstream=pod.role.value).inc()
                metrics.FORWARD_RETRIES.labels(model=self._config.model_label, status=str(upstream.status_code)).inc()
                last_error = f"{pod.role.value} pod {pod.name} failed: HTTP {upstream.status_code}"
                continue
            if upstream.status_code in RETRYABLE_STATUSES and pick(frozenset(tried)) is not None:
                _release(pod, prompt_tokens)
                await upstream.aclose()
                if upstream.status_code == 503:
                    self._pods.mark_failed(pod.name)  # draining: out until the poller sees /ready again
                metrics.FORWARD_RETRIES.labels(model=self._config.model_label, status=str(upstream.status_code)).inc()
                continue
            return await self._respond(pod=pod, upstream=upstream, started=started, prompt_tokens=prompt_tokens)
        if not tried:
            return self._unavailable(unavailable)
        metrics.REQUESTS.labels(model=self._config.model_label, outcome="upstream_error").inc()
        return error_response(status=502, message=last_error, type_="upstream_error", code="decode_failed")

    async def _pod_is_failing(self, pod: Pod, status: int) -> bool:
        """After a server error from ``pod``: whether the pod no longer passes its health poll,
        so the request goes to another pod, or fails as for a pod that could not be reached
        when none is left (module docstring)."""
        if status < 500 or status in RETRYABLE_STATUSES or self._recheck is None:
            return False
        if await self._recheck(pod):
            return False
        log.warning(
            "%s pod %s answered HTTP %d and fails its health poll: trying another pod", pod.role.value, pod.name, status
        )
        return True

    async def _respond(self, *, pod: Pod, upstream: PodResponse, started: float, prompt_tokens: int) -> Response:
        is_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if not is_stream:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                self._pods.mark_failed(pod.name)
                metrics.REQUESTS.labels(model=self._config.model_label, outcome="upstream_error").inc()
                return error_response(
                    status=502,
                    message=f"{pod.role.value} pod {pod.name} died mid-response: {type(exc).__name__}",
                    type_="upstream_error",
                    code="decode_failed",
                )
            finally:
                _release(pod, prompt_tokens)
                await upstream.aclose()
            self._finish(upstream.status_code, started)
            return Response(
                content=content,
                status_code=upstream.status_code,
                media_type="application/json",
                headers=_passthrough_headers(upstream),
            )

        closed = False

        async def close(*, ok: bool = True) -> None:
            """Release the pod's stream once: from the relay's finally, or from the response
            when the client left before the relay started (see :mod:`.relay`)."""
            nonlocal closed
            if closed:
                return
            closed = True
            _release(pod, prompt_tokens)
            await upstream.aclose()
            if ok:
                self._finish(upstream.status_code, started)
            else:
                metrics.REQUESTS.labels(model=self._config.model_label, outcome="upstream_error").inc()

        async def relay() -> AsyncIterator[bytes]:
            ok = True
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                ok = False
                self._pods.mark_failed(pod.name)
                metrics.UPSTREAM_ERRORS.labels(model=self._config.model_label, upstream=pod.role.value).inc()
                yield _sse_error(f"{pod.role.value} pod {pod.name} died mid-stream: {type(exc).__name__}")
            finally:
                await close(ok=ok)

        return RelayResponse(
            relay(),
            on_close=close,
            status_code=upstream.status_code,
            media_type="text/event-stream",
            headers=_passthrough_headers(upstream),
        )

    def _finish(self, status: int, started: float) -> None:
        outcome = "success" if status < 400 else ("client_error" if status < 500 else "upstream_error")
        metrics.REQUESTS.labels(model=self._config.model_label, outcome=outcome).inc()
        metrics.REQUEST_SECONDS.labels(model=self._config.model_label).observe(time.perf_counter() - started)


def _acquire(pod: Pod, prompt_tokens: int) -> None:
    """A request of ``prompt_tokens`` is in flight on ``pod`` (its load, until :func:`_release`)."""
    pod.load.in_flight += 1
    pod.load.in_flight_prompt_tokens += prompt_tokens


def _release(pod: Pod, prompt_tokens: int) -> None:
    pod.load.in_flight -= 1
    pod.load.in_flight_prompt_tokens -= prompt_tokens


def _handoff_refusal(answer: bytes) -> str | None:
    """The message of a pod's error answer that refuses handoff parameters; None for any
    other answer (an error of the client's, which goes back to the client as it is)."""
    try:
        error = json.loads(answer).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict) or error.get("code") not in HANDOFF_REFUSAL_CODES:
        return None
    return str(error.get("message", ""))[:300]


def _passthrough_headers(response: PodResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", HEADER_REQUEST_ID)}
