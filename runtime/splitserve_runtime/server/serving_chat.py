"""POST /v1/chat/completions: messages -> chat template -> one assistant message.

The prompt is built by the model's own chat template (``tokenizer.apply_chat_template`` with
``add_generation_prompt=True``, off the event loop when large: :mod:`.prompts`); message
content given as text parts is joined into one string first. Streaming follows OpenAI's chunk
sequence: a first chunk with the role, then content deltas, then a chunk carrying only
``finish_reason``, then (if ``stream_options.include_usage``) a chunk with empty ``choices``
and the usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from splitserve_runtime.disagg.prefiller import Prefiller
from splitserve_runtime.disagg.routes import RoutedEngine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.server.engine_client import EngineClient
from splitserve_runtime.server.generation import Generation
from splitserve_runtime.server.metrics import ServerMetrics
from splitserve_runtime.server.prompts import PromptReader
from splitserve_runtime.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    now_seconds,
)
from splitserve_runtime.server.serving_common import (
    chat_logprobs,
    check_model,
    finish_reason,
    named_prefill_endpoints,
    output_usage,
    prefill_if_named,
    reject_unsupported,
    start_generation,
)
from splitserve_runtime.server.state import ServerState
from splitserve_runtime.server.streaming import respond, sse_event


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text content; OpenAI's "developer" role
    is the newer name of "system", which is the only one model templates know."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]


class ChatService:
    """Renders the chat prompt, runs it through a Generation, formats the answer."""

    def __init__(
        self, *, state: ServerState, metrics: ServerMetrics, prompts: PromptReader, prefiller: Prefiller
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._prompts = prompts
        self._prefiller = prefiller

    async def create(self, *, body: ChatCompletionRequest, request: Request) -> Response:
        reject_unsupported(body.unsupported_fields())
        check_model(state=self._state, model=body.model)
        endpoints = named_prefill_endpoints(state=self._state, request=request, body=body)
        engine = self._state.admit()
        with self._state.preparing():  # a drain waits for a prompt being tokenized
            prompt_token_ids = await self._prompts.chat(
                engine=engine,
                messages=template_messages(body),
                requested_max_tokens=body.requested_max_tokens(),
                param="messages",
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
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                requested_max_tokens=body.requested_max_tokens(),
                id_prefix="chatcmpl",
                prompt_param="messages",
                picked=picked,
            )
        return await respond(
            request=request,
            generation=generation,
            stream=bool(body.stream),
            events=lambda: self._events(body=body, engine=engine, generation=generation),
            whole=lambda: self._whole(body=body, engine=engine, generation=generation, routed=routed),
        )

    def _logprobs(
        self, *, body: ChatCompletionRequest, engine: EngineClient, output: RequestOutput
    ) -> list[ChatTokenLogprob] | None:
        if not body.logprobs or not output.new_logprobs:
            return None
        return chat_logprobs(logprobs=output.new_logprobs, tokenizer=engine.tokenizer, num_top=body.top_logprobs or 0)

    async def _whole(
        self, *, body: ChatCompletionRequest, engine: EngineClient, generation: Generation, routed: RoutedEngine
    ) -> Response:
        try:
            await generation.admit()
            text: list[str] = []
            content: list[ChatTokenLogprob] = []
            last: RequestOutput | None = None
            async for output in generation.outputs():
                last = output
                text.append(output.new_text)
                content += self._logprobs(body=body, engine=engine, output=output) or []
        finally:
            await generation.close()
        if last is None:
            raise RuntimeError("outputs() ended without a finished output")
        answer = ChatCompletionResponse(
            id=generation.request_id,
            model=body.model,
            choices=[
                ChatChoice(
                    message=ChatResponseMessage(content="".join(text)),
                    logprobs=ChatLogprobs(content=content) if body.logprobs else None,
                    finish_reason=finish_reason(last),
                )
            ],
            usage=output_usage(last),
        )
        return JSONResponse(routed.decorate(answer.model_dump(mode="json")))

    async def _events(
        self, *, body: ChatCompletionRequest, engine: EngineClient, generation: Generation
    ) -> AsyncIterator[str]:
        created = now_seconds()
        include_usage, continuous = body.wants_usage()

        def chunk(choice: ChatChunkChoice | None, output: RequestOutput | None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=generation.request_id,
                created=created,
                model=body.model,
                choices=[] if choice is None else [choice],
                usage=output_usage(output) if output is not None else None,
            )

        yield sse_event(chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content="")), None))
        last: RequestOutput | None = None
        async for output in generation.outputs():
            last = output
            logprobs = self._logprobs(body=body, engine=engine, output=output)
            if output.new_text or logprobs:
                yield sse_event(
                    chunk(
                        ChatChunkChoice(
                            delta=ChatDelta(content=output.new_text),
                            logprobs=ChatLogprobs(content=logprobs) if logprobs else None,
                        ),
                        output if continuous else None,
                    )
                )
            if output.finished:
                yield sse_event(
                    chunk(
                        ChatChunkChoice(delta=ChatDelta(), finish_reason=finish_reason(output)),
                        output if continuous else None,
                    )
                )
        if include_usage and last is not None:
            yield sse_event(chunk(None, last))
