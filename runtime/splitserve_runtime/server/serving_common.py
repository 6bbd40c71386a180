"""Helpers both OpenAI endpoints share: request checks, token budgets, usage and logprobs.

Kept free of HTTP plumbing: each function turns one piece of a request or an engine output
into a piece of the answer, or raises the APIError that says why it cannot.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Literal

from starlette.requests import Request

from splitserve_contract import HEADER_REQUEST_ID
from splitserve_runtime.disagg.prefiller import Prefilled, Prefiller, prefill_endpoints
from splitserve_runtime.disagg.routes import HandoffRouteError, RoutedEngine, route_handoff
from splitserve_runtime.engine.outputs import FINISH_LENGTH, RequestOutput, TokenLogprob
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.server.engine_client import EngineClient, TokenizerLike
from splitserve_runtime.server.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    APIError,
    bad_request,
    model_not_found,
)
from splitserve_runtime.server.generation import Generation
from splitserve_runtime.server.metrics import ServerMetrics
from splitserve_runtime.server.prompt_length import resolve_max_tokens
from splitserve_runtime.server.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    Usage,
)
from splitserve_runtime.server.state import ServerState

PickedPrefill = tuple[Prefiller, Prefilled, str]
"""What a decode pod's named prefill pods answered (:mod:`splitserve_runtime.disagg.prefiller`),
and the request's id."""


def handoff_api_error(exc: HandoffRouteError) -> APIError:
    """A handoff refusal (:mod:`splitserve_runtime.disagg.routes`) in the server's error shape:
    403, the OpenAI client's PermissionDeniedError, for parameters not from a prefill pod of this
    pool; 400 for the caller's other mistakes; 501 for a pod built without the handoff."""
    return APIError(
        status_code=exc.status_code,
        type=SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST,
        code=exc.code,
        param=exc.param,
        message=exc.message,
    )


def start_generation(
    *,
    state: ServerState,
    metrics: ServerMetrics,
    engine: EngineClient,
    body: SamplingFields,
    prompt_token_ids: list[int],
    logprobs: int | None,
    requested_max_tokens: int | None,
    id_prefix: str,
    prompt_param: str,
    picked: PickedPrefill | None = None,
) -> tuple[RoutedEngine, Generation]:
    """The part of a request both endpoints share once the prompt is tokens: the token budget,
    the sampling parameters, the prefill/decode handoff route and the :class:`Generation`.
    ``picked``: the handoff a named prefill pod gave (:func:`prefill_if_named`), in place of the
    request's own ``kv_transfer_params``."""
    params = build_sampling_params(
        body=body,
        logprobs=logprobs,
        max_tokens=resolve_max_tokens(
            requested=requested_max_tokens, num_prompt_tokens=len(prompt_token_ids), max_model_len=_room(engine)
        ),
    )
    try:
        if picked is None:
            routed = route_handoff(
                engine=engine,
                role=state.role,
                params=body.kv_transfer_params,
                stream=bool(body.stream),
                prompt_token_ids=prompt_token_ids,
            )
        else:
            prefiller, prefilled, request_id = picked
            routed = prefiller.route(
                engine=engine,
                role=state.role,
                prefilled=prefilled,
                stream=bool(body.stream),
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
            )
    except HandoffRouteError as exc:
        raise handoff_api_error(exc) from None
    generation = Generation(
        state=state,
        metrics=metrics,
        engine=routed,
        request_id=new_request_id(prefix=id_prefix),
        prompt_token_ids=prompt_token_ids,
        params=params,
        prompt_param=prompt_param,
    )
    return routed, generation


def _room(engine: EngineClient) -> int:
    """The longest request this engine can finish: ``max_model_len``, or less when the whole
    KV cache is smaller (a request of ``n`` tokens caches ``n - 1``), so that an omitted
    ``max_tokens`` fills the room there is instead of being refused for the cache's size."""
    stats = engine.stats()
    capacity = stats.kv_cache_blocks_total * stats.kv_cache_block_size
    if capacity <= 0:  # an engine that reports no cache (nothing to bound by)
        return engine.max_model_len
    return min(engine.max_model_len, capacity + 1)


def new_request_id(*, prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def named_prefill_endpoints(*, state: ServerState, request: Request, body: SamplingFields) -> tuple[str, ...]:
    """The prefill pods an endpoint picker named in the request's headers (decode pods only;
    a malformed header is a 400 before any work): :func:`~splitserve_runtime.disagg.prefiller.prefill_endpoints`. Only
    on pods started with ``--prefill-headers``: elsewhere the headers mean nothing, so a client
    cannot make a pod send its request to an address of the client's choosing."""
    if not state.prefill_headers:
        return ()
    try:
        return prefill_endpoints(
            request.headers, role=state.role, has_kv_transfer_params=body.kv_transfer_params is not None
        )
    except HandoffRouteError as exc:
        raise handoff_api_error(exc) from None


async def prefill_if_named(
    *, prefiller: Prefiller, request: Request, body: SamplingFields, endpoints: Sequence[str], engine: EngineClient
) -> PickedPrefill | None:
    """Have the named prefill pods prefill this request (None when none is named); each must
    first prove it is a prefill pod of this InferenceService (``engine``'s handoff key)."""
    if not endpoints:
        return None
    request_id = request.headers.get(HEADER_REQUEST_ID) or new_request_id(prefix="prefill")
    prefilled = await prefiller.prefill(
        path=request.url.path,
        body=body.model_dump(mode="json", exclude_unset=True),
        endpoints=endpoints,
        headers=request.headers,
        request_id=request_id,
        auth=getattr(engine, "auth", None),
    )
    return prefiller, prefilled, request_id


def reject_unsupported(problems: Sequence[tuple[str, str]]) -> None:
    if problems:
        param, message = problems[0]
        raise bad_request(message, param=param)


def check_model(*, state: ServerState, model: str) -> None:
    if model != state.served_model_name:
        raise model_not_found(model)


def usage(*, num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        total_tokens=num_prompt_tokens + num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def build_sampling_params(*, body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for a request; its ValueError becomes a 400 naming the
    field (the message starts with the field name)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            min_tokens=body.min_tokens or 0,
            speculative=body.speculative is not False,
        )
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        raise bad_request(message, param=field if field in SamplingFields.model_fields else None) from None


def output_usage(output: RequestOutput) -> Usage:
    return usage(
        num_prompt_tokens=output.num_prompt_tokens,
        num_output_tokens=output.num_output_tokens,
        num_cached_tokens=output.num_cached_tokens,
    )


def finish_reason(output: RequestOutput) -> Literal["stop", "length"] | None:
    """OpenAI's finish_reason: eos, stop token and stop string are all "stop"."""
    if not output.finished:
        return None
    return "length" if output.finish_reason == FINISH_LENGTH else "stop"


def token_text(*, tokenizer: TokenizerLike, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    *, logprobs: Sequence[TokenLogprob], tokenizer: TokenizerLike, text_offset: int
) -> CompletionLogprobs:
    """Legacy completions format; `text_offset` is where the first token starts."""
    out = CompletionLogprobs()
    offset = text_offset
    for entry in logprobs:
        text = token_text(tokenizer=tokenizer, token_id=entry.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append({token_text(tokenizer=tokenizer, token_id=t): lp for t, lp in entry.top_logprobs})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(
    *, logprobs: Sequence[TokenLogprob], tokenizer: TokenizerLike, num_top: int
) -> list[ChatTokenLogprob]:
    content: list[ChatTokenLogprob] = []
    for entry in logprobs:
        text = token_text(tokenizer=tokenizer, token_id=entry.token_id)
        top = [
            TopLogprob(token=(alt := token_text(tokenizer=tokenizer, token_id=t)), logprob=lp, bytes=list(alt.encode()))
            for t, lp in entry.top_logprobs[:num_top]
        ]
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top))
    return content
