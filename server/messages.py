"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API, as a thin adapter over
chat completions (as ``pagedserve.server.responses`` is for OpenAI's Responses API).

A request becomes a ``ChatCompletionRequest`` (``chat_request``): ``system`` a system message first; a message's
text blocks its content, an assistant's ``tool_use`` blocks its ``tool_calls``, a user's ``tool_result`` blocks
``tool`` messages (before the user's text); ``thinking`` blocks are dropped, as chat templates leave earlier
thinking out. A conversation that ends with an assistant message is a prefill: the answer continues it (chat's
``continue_final_message``). ``tool_choice`` ``any`` is chat's ``required``, ``tool`` a named function, and
``disable_parallel_tool_use`` turns ``parallel_tool_calls`` off; ``output_config.format`` is a ``json_schema``
``response_format``.

The answer is chat's reply as content blocks: thinking (``--reasoning-parser``), text, then ``tool_use``.
``stop_reason``: ``tool_use`` when it made calls, ``max_tokens`` when cut there, ``stop_sequence`` (naming it in
``stop_sequence``) when one of ``stop_sequences`` ended it, else ``end_turn``. Streamed, it is Anthropic's
event sequence: ``message_start``; per block ``content_block_start``, its ``content_block_delta``s
(``text_delta``, ``thinking_delta``, ``input_json_delta``) and ``content_block_stop``; ``message_delta`` (stop
reason, output tokens) and ``message_stop``. An error after the start is an ``error`` event. Errors name
Anthropic's fields (``stop_sequences``, ``tools.0.input_schema``) in Anthropic's shape
(``pagedserve.server.errors``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.server.chat import run_chat, tokenize_chat
from pagedserve.server.errors import OpenAIError, bad_request, rename_field, resolve_model
from pagedserve.server.messages_protocol import (
    ContentBlock,
    InputMessage,
    Message,
    MessagesPrompt,
    MessagesRequest,
    MessageTokensCount,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from pagedserve.server.protocol import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionTool,
    ChatMessage,
    DeltaMessage,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    ToolCall,
    ToolChoice,
)

#: Chat's name of a field (the start of an error's dotted ``param``) -> the Messages API's.
_FIELD_NAMES = (
    (re.compile(r"^stop\b"), "stop_sequences"),
    (re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
    (re.compile(r"^response_format"), "output_config.format"),
    (re.compile(r"^tools(\.\d+)\.function\.parameters"), r"tools\1.input_schema"),
    (re.compile(r"^tools(\.\d+)\.function"), r"tools\1"),
    (re.compile(r"^tool_choice\.function"), "tool_choice.name"),
    (re.compile(r"^parallel_tool_calls$"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"^user$"), "metadata.user_id"),
    # Chat's messages do not line up with the request's (system first, tool results split out).
    (re.compile(r"^messages\..*$"), "messages"),
)

#: ``tool_choice.type`` -> chat's ``tool_choice`` (``tool`` is a named function).
_TOOL_CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


# --------------------------------------------------------------------------- request -> chat


def _text(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _chat_messages(index: int, message: InputMessage) -> list[ChatMessage]:
    """The chat messages of the request's ``index``-th message.

    Raises:
        OpenAIError: 400 for a block in the wrong role's message (``tool_use`` from the user,
            ``tool_result`` from the assistant).
    """
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    wrong = ToolResultBlock if message.role == "assistant" else ToolUseBlock
    for j, block in enumerate(message.content):
        if isinstance(block, wrong):
            raise bad_request(f"{block.type} blocks do not belong in {message.role} messages",
                              f"messages.{index}.content.{j}")
    text = _text([block for block in message.content if isinstance(block, TextBlock)])
    if message.role == "assistant":
        calls = [ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input)))
                 for block in message.content if isinstance(block, ToolUseBlock)]
        return [ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)]
    results = [ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=block.text())
               for block in message.content if isinstance(block, ToolResultBlock)]
    return results + ([ChatMessage(role="user", content=text)] if text or not results else [])


def chat_request(request: MessagesPrompt) -> ChatCompletionRequest:
    """The chat request that answers ``request`` (a ``MessagesRequest``), or that renders its prompt (a
    ``MessagesPrompt``, for ``count_tokens``).

    Raises:
        OpenAIError: 400 for a block in the wrong role's message, or a prefill (a last assistant message)
            that holds tool calls.
    """
    messages = [] if request.system is None else [ChatMessage(
        role="system", content=request.system if isinstance(request.system, str) else _text(request.system))]
    for index, message in enumerate(request.messages):
        messages += _chat_messages(index, message)
    prefill = request.messages[-1].role == "assistant"
    if prefill and messages[-1].tool_calls:
        raise bad_request("the last message may be the assistant's only as text for the answer to continue, "
                          "not with tool_use blocks", f"messages.{len(request.messages) - 1}.content")
    tools = None if request.tools is None else [
        ChatCompletionTool(type="function", function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema, strict=tool.strict))
        for tool in request.tools]
    choice = request.tool_choice
    tool_choice = None if choice is None else _TOOL_CHOICES.get(choice.type) or NamedToolChoice(
        type="function", function=NamedFunction(name=choice.name))
    output = request.output_config.format if request.output_config is not None else None
    fields: dict[str, Any] = dict(
        model=request.model, messages=messages, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        add_generation_prompt=not prefill, continue_final_message=prefill,
        response_format=None if output is None else ResponseFormat(
            type="json_schema", json_schema=JSONSchemaFormat(name="output", schema=output.schema_)))
    if isinstance(request, MessagesRequest):
        fields |= dict(
            max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature,
            top_p=request.top_p, top_k=request.top_k, stream=request.stream,
            user=request.metadata.user_id if request.metadata is not None else None,
            # Every chunk carries the usage: message_start reports the prompt's tokens.
            stream_options=StreamOptions(include_usage=True, continuous_usage_stats=True) if request.stream else None)
    return ChatCompletionRequest(**fields)


# --------------------------------------------------------------------------- chat -> message


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (chat's JSON text, held by the tool grammar to a JSON object) as ``input``."""
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError(f"tool call arguments are not a JSON object: {arguments[:100]!r}")
    return value


def _content(message: AssistantMessage) -> list[ContentBlock]:
    """Chat's whole reply as content blocks: its thinking, its text (unless it only made calls or only thought),
    then its calls."""
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content or not (message.tool_calls or blocks):
        blocks.append(TextBlock(text=message.content or ""))
    blocks += [ToolUseBlock(id=call.id, name=call.function.name, input=_tool_input(call.function.arguments))
               for call in message.tool_calls or ()]
    return blocks


def _stop(finish_reason: str | None, stop_reason: int | str | None,
          stop_sequences: list[str] | None) -> tuple[StopReason, str | None]:
    """``(stop_reason, stop_sequence)`` from chat's ``finish_reason`` and vLLM's ``stop_reason``.

    Raises:
        OpenAIError: 503 when the request was aborted (no finish reason): the server is shutting down.
    """
    if finish_reason is None:
        raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "The request was aborted: the server is shutting down.",
                          code="engine_dead")
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


async def create_message(request: MessagesRequest, engine: AsyncLLM,
                         tool_call_parser: str = "auto") -> Message | EventSourceResponse:
    """Run a Messages API request through chat: a ``Message``, or an SSE stream of Anthropic's events.

    ``tool_call_parser`` (``--tool-call-parser``) names the tool-call format, ``auto`` = the model's.

    Raises:
        OpenAIError: 400 for invalid or unsupported input, 404 for an unknown model, 429 when the queue is
            full, 503 when the engine is down.
    """
    request.check()
    chat = chat_request(request)
    try:
        result = await run_chat(chat, engine, tool_call_parser)
    except OpenAIError as error:
        raise rename_field(error, _FIELD_NAMES) from error
    message = Message(id=_message_id(), model=request.model or engine.model_name, content=[],
                      usage=Usage(input_tokens=0, output_tokens=0))
    if not isinstance(result, ChatCompletionResponse):
        return EventSourceResponse(MessageStream(message, request.stop_sequences).events(result), sep="\n")
    choice = result.choices[0]
    message.content = _content(choice.message)
    message.stop_reason, message.stop_sequence = _stop(choice.finish_reason, choice.stop_reason,
                                                       request.stop_sequences)
    message.usage = Usage(input_tokens=result.usage.prompt_tokens, output_tokens=result.usage.completion_tokens)
    return message


async def count_message_tokens(request: MessagesPrompt, engine: AsyncLLM,
                               tool_call_parser: str = "auto") -> MessageTokensCount:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as a ``create_message`` of the same conversation,
    system prompt and tools reports them in ``usage.input_tokens``.

    Raises:
        OpenAIError: 400 for invalid or unsupported input, or a conversation longer than the model takes;
            404 for an unknown model.
    """
    request.check()
    resolve_model(request.model, engine)
    try:
        token_ids = await tokenize_chat(chat_request(request), engine, tool_call_parser)
    except OpenAIError as error:
        raise rename_field(error, _FIELD_NAMES) from error
    return MessageTokensCount(input_tokens=len(token_ids))


class MessageStream:
    """Anthropic's events of one streamed message, from chat's chunks.

    One content block is open at a time: thinking opens a thinking block, text a text block, a tool call's
    first piece (the one with its ``id``) a ``tool_use`` block, each closing the one before (chat streams the
    calls one after the other). Block indexes count from 0.
    """

    def __init__(self, message: Message, stop_sequences: list[str] | None) -> None:
        self.message = message
        self.stop_sequences = stop_sequences
        self.index = -1  # of the last block opened
        self.open: type[ContentBlock] | None = None

    @staticmethod
    def _event(type_: str, **fields: Any) -> ServerSentEvent:
        data = {"type": type_} | {name: value.model_dump(mode="json", by_alias=True) if isinstance(value, BaseModel)
                                  else value for name, value in fields.items()}
        return ServerSentEvent(data=json.dumps(data), event=type_)

    def _start(self, block: ContentBlock) -> Iterator[ServerSentEvent]:
        yield from self._stop_block()
        self.index += 1
        self.open = type(block)
        yield self._event("content_block_start", index=self.index, content_block=block)

    def _stop_block(self) -> Iterator[ServerSentEvent]:
        if self.open is not None:
            self.open = None
            yield self._event("content_block_stop", index=self.index)

    def _block_delta(self, **delta: str) -> ServerSentEvent:
        return self._event("content_block_delta", index=self.index, delta=delta)

    def _delta(self, delta: DeltaMessage) -> Iterator[ServerSentEvent]:
        if delta.reasoning_content:
            if self.open is not ThinkingBlock:
                yield from self._start(ThinkingBlock(thinking=""))
            yield self._block_delta(type="thinking_delta", thinking=delta.reasoning_content)
        if delta.content:
            if self.open is not TextBlock:
                yield from self._start(TextBlock(text=""))
            yield self._block_delta(type="text_delta", text=delta.content)
        for call in delta.tool_calls or ():
            if call.id is not None:
                yield from self._start(ToolUseBlock(id=call.id, name=call.function.name or "", input={}))
            if call.function.arguments:
                yield self._block_delta(type="input_json_delta", partial_json=call.function.arguments)

    async def events(self, chunks: AsyncGenerator[ChatCompletionChunk, None]) -> AsyncIterator[ServerSentEvent]:
        """The events, from chat's chunks (``run_chat``'s, the first one already produced, each with the usage
        so far); an error they raise ends the stream with an ``error`` event."""
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        output_tokens = 0
        started = False
        async with aclosing(chunks):
            try:
                async for chunk in chunks:
                    if chunk.usage is not None:
                        output_tokens = chunk.usage.completion_tokens
                    if not started:  # chat's first chunk: the role, once the engine has answered
                        started = True
                        self.message.usage.input_tokens = chunk.usage.prompt_tokens if chunk.usage else 0
                        yield self._event("message_start", message=self.message)
                    for choice in chunk.choices:
                        for event in self._delta(choice.delta):
                            yield event
                        finish_reason = choice.finish_reason or finish_reason
                        stop_reason = choice.stop_reason if choice.stop_reason is not None else stop_reason
                stop, stop_sequence = _stop(finish_reason, stop_reason, self.stop_sequences)
            except OpenAIError as error:
                yield self._event("error", error=error.anthropic_body()["error"])
                return
        for event in self._stop_block():
            yield event
        yield self._event("message_delta", delta={"stop_reason": stop, "stop_sequence": stop_sequence},
                          usage={"output_tokens": output_tokens})
        yield self._event("message_stop")
