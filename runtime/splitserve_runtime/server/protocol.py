"""Request and response models of the OpenAI-compatible endpoints (pydantic, plus the small
helpers that read a request: its stop list, its unsupported settings).

Requests follow the OpenAI API: unknown fields are rejected (OpenAI answers "Unrecognized
request argument"), so a typo never silently changes behaviour. OpenAI fields that we accept
but do not implement (penalties, logit_bias, tools, echo ...) pass only at their neutral
value; anything else is refused with a message naming the field (see `unsupported_fields`).
A few vLLM-style extensions that map straight onto the engine's sampling parameters
(`top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`) are accepted as well, and
`speculative` (a boolean, default true): false opts the request out of speculative decoding
on a server started with ``--speculative-method`` (its output is the same either way: greedy
token for token, sampled in distribution).

Responses mirror the OpenAI objects closely enough that the official `openai` client parses
them into its typed models.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# ----------------------------------------------------------------------------- requests


MAX_STOP_SEQUENCES = 16
"""OpenAI allows 4; a few more are harmless, thousands would slow every decode step."""


# Validation runs on the event loop and costs per JSON value. Unbounded, an 8 MiB body of a
# million small items held the loop for seconds: a million nulls as the prompt took 73 s
# (three errors per item, one per member of the prompt union), 180k one-word messages 1-3 s.
# So lists stop at their first bad item (fail_fast) and every collection but a prompt's token
# ids has a length bound far above any real request (a prompt's ids are bounded by the body
# size: about a million, validated in ~0.1 s).
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096
MAX_BATCHED_PROMPTS = 1024
"""More than one prompt is refused anyway; this only bounds the work of saying so."""
MAX_STOP_TOKEN_IDS = 4096
MAX_MAP_ENTRIES = 1024
"""logit_bias, metadata, tools, tool_choice, response_format, kv_transfer_params."""
MAX_UNKNOWN_FIELDS = 16
"""Unknown fields an object may have and still be answered field by field."""


SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
"""The seeds ``torch.Generator.manual_seed`` takes (it raises outside them); a negative seed
is the same generator state as ``seed + 2**64``, as in torch. Outside, the sampler's 64-bit
mask would alias them (2**64 behaving as 0), so they are refused instead."""


class _Request(BaseModel):
    # strict: "0.5" is not a number and true is not 1, as in the OpenAI API
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        """Every unknown field is an error of its own: refuse an object with far more fields
        than the model has before validating any (600k unknown fields took seconds)."""
        if isinstance(data, dict) and len(data) > len(cls.model_fields) + MAX_UNKNOWN_FIELDS:
            raise ValueError(f"the object has {len(data)} fields; {cls.__name__} has {len(cls.model_fields)}")
        return data


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    # optional fields also accept an explicit null, as the OpenAI API does
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_MAP_ENTRIES)] | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = 0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None  # only the neutral 1 (vLLM's client sends it)
    ignore_eos: bool | None = False
    speculative: bool | None = True  # false: never verify proposals for this request
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None
    ) = None
    # router <-> pool handoff (contract.KV_TRANSFER_PARAMS_FIELD); see disagg.routes
    kv_transfer_params: Annotated[dict[str, Any], Field(max_length=MAX_MAP_ENTRIES)] | None = None

    def wants_usage(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk) for a streamed answer."""
        if self.stream_options is None:
            return False, False
        return (bool(self.stream_options.include_usage), bool(self.stream_options.continuous_usage_stats))

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def common_unsupported(self) -> list[tuple[str, str]]:
        """(param, message) for every field set to a value we cannot honour."""
        problems: list[tuple[str, str]] = []
        if self.n not in (None, 1):
            problems.append(
                ("n", f"n={self.n} is not supported: this server returns exactly one choice per request (n must be 1)")
            )
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed when stream is true"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0.0):
                problems.append((name, f"{name} is not supported by this server (use 0)"))
        if self.logit_bias:
            problems.append(("logit_bias", "logit_bias is not supported by this server"))
        if self.repetition_penalty not in (None, 1.0):
            problems.append(("repetition_penalty", "repetition_penalty is not supported by this server (use 1)"))
        return problems


PromptTokens = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, fail_fast=True)]
BatchedPrompts = Annotated[list[str], Field(max_length=MAX_BATCHED_PROMPTS, fail_fast=True)]
BatchedTokenPrompts = Annotated[list[PromptTokens], Field(max_length=MAX_BATCHED_PROMPTS, fail_fast=True)]


class CompletionRequest(SamplingFields):
    """POST /v1/completions. The prompt is a string or a list of token ids (one prompt)."""

    prompt: str | PromptTokens | BatchedPrompts | BatchedTokenPrompts
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        problems = self.common_unsupported()
        if self.echo:
            problems.append(("echo", "echo is not supported by this server"))
        if self.suffix:
            problems.append(("suffix", "suffix is not supported by this server"))
        if self.best_of not in (None, 1):
            problems.append(("best_of", "best_of > 1 is not supported by this server"))
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and not isinstance(self.prompt[0], int):
            problems.append(
                (
                    "prompt",
                    "batched prompts are not supported: send one prompt (a string or a list of token ids) per request",
                )
            )
        if isinstance(self.prompt, list) and not self.prompt:
            problems.append(("prompt", "prompt must not be empty"))
        return problems

    def single_prompt(self) -> str | list[int]:
        """The one prompt, unwrapped from a one-element batch if the client sent one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0]
        if isinstance(first, int):
            return [p for p in prompt if isinstance(p, int)]
        return first


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextContentPart], Field(max_length=MAX_CONTENT_PARTS, fail_fast=True)] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_MAP_ENTRIES, fail_fast=True)] | None = None
    tool_choice: str | Annotated[dict[str, Any], Field(max_length=MAX_MAP_ENTRIES)] | None = None
    parallel_tool_calls: bool | None = None
    response_format: Annotated[dict[str, Any], Field(max_length=MAX_MAP_ENTRIES)] | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_MAP_ENTRIES)] | None = None
    store: bool | None = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        problems = self.common_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs requires logprobs to be true"))
        if self.tools:
            problems.append(("tools", "tool calling is not supported by this server"))
        if self.tool_choice not in (None, "none", "auto"):
            problems.append(("tool_choice", "tool calling is not supported by this server"))
        if self.response_format is not None and self.response_format.get("type") != "text":
            problems.append(("response_format", 'only response_format {"type": "text"} is supported'))
        if self.store:
            problems.append(("store", "store is not supported by this server"))
        return problems

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----------------------------------------------------------------------------- responses


def now_seconds() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI sends `"delta": {}` on the finishing chunk, not nulls
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class RuntimeInfo(BaseModel):
    """GET contract.INFO_PATH: what the router needs to pair prefill and decode pods."""

    role: str
    model: str
    compat_hash: str
    kv_endpoint: str
    block_size: int
    max_model_len: int | None = None
    identity_proof: str | None = None
    """Asked with ``?nonce=``: HMAC(nonce, role) under the InferenceService's KV handoff key,
    proof to a decode pod that this pod is one of its service's (None without a key)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "splitserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
