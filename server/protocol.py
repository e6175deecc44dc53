"""Request and response bodies of the HTTP API, in OpenAI's shapes (plus vLLM's extra sampling fields).

Unknown request fields are ignored, as OpenAI-compatible servers do, so that
clients written for other servers (e.g. llama.cpp's ``n_predict``) still work.
Values are range-checked by ``SamplingParams``, not here, so that there is one
set of rules whichever frontend builds the request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer
from sse_starlette import EventSourceResponse

from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from server.errors import OpenAIError


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share: the model, streaming and sampling.

    A field left out or sent as ``null`` takes ``SamplingParams``' default.
    """

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # JSON keys are strings; pydantic turns them into ints
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, max_tokens: int, logprobs: int | None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for this request.

        Args:
            max_tokens: most output tokens per completion, resolved by the endpoint.
            logprobs: top logprobs per output token; None = no logprobs.
            prompt_logprobs: top logprobs per prompt token; None = none.

        Raises:
            ValueError: a value out of range, naming the field.
        """
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              **given)


_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output",
)

PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's default; null = up to the context length
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> PromptInput:
        # Without this, pydantic reports one error per member of the union.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists") from None


class TextContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


MessageContent = str | list[TextContentPart] | None


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: MessageContent = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: MessageContent) -> MessageContent:
        for part in content if isinstance(content, list) else ():
            if part.type != "text" or part.text is None:
                raise ValueError(f"only content parts of type 'text' with a 'text' field are supported, "
                                 f"got type {part.type!r}")
        return content

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM does."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class ResponseFormat(OpenAIBaseModel):
    type: str


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's ``finish_reason`` for the engine's: ``stop`` and ``length`` pass, an abort
    (only at shutdown) is ``null`` as in vLLM, since OpenAI has no word for it."""
    return None if reason == FinishReason.ABORT.value else reason


def unix_time() -> int:
    """Seconds since the epoch, the type of OpenAI's ``created`` fields."""
    return int(time.time())


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogProbs(OpenAIBaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class Choice(OpenAIBaseModel):
    """What every choice has, whole or streamed."""

    index: int
    finish_reason: str | None = None


class ResponseHead(OpenAIBaseModel):
    """What every response and streamed chunk has."""

    id: str
    created: int
    model: str


class CompletionChoice(Choice):
    text: str
    logprobs: CompletionLogProbs | None = None


class CompletionResponse(ResponseHead):
    """A whole completion, or (``object`` unchanged, as OpenAI does) one streamed chunk of it."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogProbs(OpenAIBaseModel):
    content: list[TokenLogprob]


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Choice):
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionResponse(ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends {"role": ..., "content": ""} first, then {"content": ...}, then {}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(Choice):
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionChunk(ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "pagedserve"
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# --------------------------------------------------------------------------- streaming


async def sse_response(chunks: AsyncGenerator[BaseModel, None]) -> EventSourceResponse:
    """Stream ``chunks`` as server-sent events: ``data: {json}`` each, then ``data: [DONE]``.

    The first chunk is awaited before the response starts, so that a request the
    engine refuses gets its HTTP status (the chunk generators produce nothing
    before the engine's first output). An ``OpenAIError`` raised later, once the
    status is sent, becomes a ``data: {"error": ...}`` event before ``[DONE]``,
    as vLLM does. When the client disconnects, sse-starlette cancels the stream
    and ``chunks`` is closed, which aborts its requests in the engine.

    Raises:
        OpenAIError: whatever the first chunk raises (``chunks`` is closed then).
    """
    try:
        first = await anext(chunks)
    except BaseException:
        await chunks.aclose()
        raise

    async def events() -> AsyncIterator[str]:
        async with aclosing(chunks):
            yield first.model_dump_json()
            try:
                async for chunk in chunks:
                    yield chunk.model_dump_json()
            except OpenAIError as error:
                yield error.to_json()
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n")
