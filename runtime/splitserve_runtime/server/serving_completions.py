"""POST /v1/completions: prompt (text or token ids) -> one completion, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import JSONResponse, Response

from splitserve_runtime.disagg.prefiller import Prefiller
from splitserve_runtime.disagg.routes import RoutedEngine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.server.generation import Generation
from splitserve_runtime.server.metrics import ServerMetrics
from splitserve_runtime.server.prompts import PromptReader
from splitserve_runtime.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now_seconds,
)
from splitserve_runtime.server.serving_common import (
    check_model,
    completion_logprobs,
    finish_reason,
    named_prefill_endpoints,
    output_usage,
    prefill_if_named,
    reject_unsupported,
    start_generation,
)
from splitserve_runtime.server.state import ServerState
from splitserve_runtime.server.streaming import respond, sse_event


class CompletionsService:
    """Validates a completion request, runs it through a Generation, formats the answer."""

    def __init__(
        self, *, state: ServerState, metrics: ServerMetrics, prompts: PromptReader, prefiller: Prefiller
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._prompts = prompts
        self._prefiller = prefiller

    async def create(self, *, body: CompletionRequest, request: Request) -> Response:
        reject_unsupported(body.unsupported_fields())
        check_model(state=self._state, model=body.model)
        endpoints = named_prefill_endpoints(state=self._state, request=request, body=body)
        engine = self._state.admit()
        prompt = body.single_prompt()
        with self._state.preparing():  # a drain waits for a prompt being tokenized
            if isinstance(prompt, str):
                prompt_token_ids = await self._prompts.text(
                    engine=engine, text=prompt, requested_max_tokens=body.max_tokens, param="prompt"
                )
            else:
                prompt_token_ids = self._prompts.token_ids(
                    engine=engine, token_ids=list(prompt), requested_max_tokens=body.max_tokens, param="prompt"
                )
            picked = await prefill_if_named(
                prefiller=self._prefiller, request=request, body=body, endpoints=endpoints, engine=engine
            )
            routed, generation = start_generation(
                state=self._state,
                metrics=self._metrics,
                engine=engine,
                body=body,
                prompt_token_ids=prompt_token_ids,
                logprobs=body.logprobs,
                requested_max_tokens=body.max_tokens,
                id_prefix="cmpl",
                prompt_param="prompt",
                picked=picked,
            )
        return await respond(
            request=request,
            generation=generation,
            stream=bool(body.stream),
            events=lambda: self._events(body=body, generation=generation),
            whole=lambda: self._whole(body=body, generation=generation, routed=routed),
        )

    async def _whole(self, *, body: CompletionRequest, generation: Generation, routed: RoutedEngine) -> Response:
        try:
            await generation.admit()
            text: list[str] = []
            logprobs = CompletionLogprobs() if body.logprobs is not None else None
            last: RequestOutput | None = None
            async for output in generation.outputs():
                last = output
                if logprobs is not None and output.new_logprobs:
                    self._extend(logprobs, output, offset=_end_offset(logprobs))
                text.append(output.new_text)
        finally:
            await generation.close()
        if last is None:
            raise RuntimeError("outputs() ended without a finished output")
        answer = CompletionResponse(
            id=generation.request_id,
            model=body.model,
            choices=[CompletionChoice(text="".join(text), logprobs=logprobs, finish_reason=finish_reason(last))],
            usage=output_usage(last),
        )
        return JSONResponse(routed.decorate(answer.model_dump(mode="json")))

    def _extend(self, logprobs: CompletionLogprobs, output: RequestOutput, *, offset: int) -> None:
        engine = self._state.engine_or_none
        if engine is None or not output.new_logprobs:
            return
        part = completion_logprobs(logprobs=output.new_logprobs, tokenizer=engine.tokenizer, text_offset=offset)
        logprobs.tokens += part.tokens
        logprobs.token_logprobs += part.token_logprobs
        logprobs.top_logprobs += part.top_logprobs
        logprobs.text_offset += part.text_offset

    async def _events(self, *, body: CompletionRequest, generation: Generation) -> AsyncIterator[str]:
        created = now_seconds()
        include_usage, continuous = body.wants_usage()
        offset = 0
        last: RequestOutput | None = None
        async for output in generation.outputs():
            last = output
            logprobs: CompletionLogprobs | None = None
            if body.logprobs is not None and output.new_logprobs:
                logprobs = CompletionLogprobs()
                self._extend(logprobs, output, offset=offset)
            if logprobs is not None:
                offset = _end_offset(logprobs)
            if output.new_text or logprobs is not None or output.finished:
                chunk = CompletionResponse(
                    id=generation.request_id,
                    created=created,
                    model=body.model,
                    choices=[
                        CompletionChoice(text=output.new_text, logprobs=logprobs, finish_reason=finish_reason(output))
                    ],
                    usage=output_usage(output) if continuous else None,
                )
                yield sse_event(chunk)
        if include_usage and last is not None:
            yield sse_event(
                CompletionResponse(
                    id=generation.request_id, created=created, model=body.model, choices=[], usage=output_usage(last)
                )
            )


def _end_offset(logprobs: CompletionLogprobs) -> int:
    """Where the next token starts: offsets follow the token strings, not the detokenized
    text deltas (which may hold back an incomplete UTF-8 character)."""
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
