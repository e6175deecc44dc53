"""``POST /v1/responses``, OpenAI's Responses API, as a thin adapter over chat completions.

A request becomes a ``ChatCompletionRequest`` (``chat_request``): ``instructions`` a system message
first, then the conversation stored under ``previous_response_id``, then the ``input`` items
(messages as they are; ``function_call`` items the assistant's ``tool_calls``, consecutive ones in
one assistant message; ``function_call_output`` items ``tool`` messages). ``pagedserve.server.chat`` runs it,
and its answer comes back as a ``Response``; its stream of chunks as OpenAI's typed events, each
``event: <type>`` and ``data: {..., "sequence_number"}``, ending with ``response.completed``,
``response.incomplete`` (cut at ``max_output_tokens``) or ``response.failed``, without ``[DONE]``,
as OpenAI sends them. Errors name the Responses API's fields where chat's name its own
(``max_output_tokens``, ``text.format``, ``tools.0.parameters``).

With ``store`` (true unless the request says false, as in OpenAI's API) a finished response is kept,
with its conversation, in the app's ``ResponseStore``, in memory: at most ``MAX_STORED_RESPONSES``
and ``MAX_STORED_RESPONSE_BYTES`` of JSON, each for ``STORED_RESPONSE_TTL_S`` seconds, the oldest
dropped first. A stored conversation holds the same message objects as its predecessor's, so a chain
of responses costs the text of each turn once. As in OpenAI's API, a continued response does not inherit
the previous ``instructions``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic_core import to_json
from sse_starlette import EventSourceResponse, ServerSentEvent

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.server.chat import run_chat
from pagedserve.server.errors import OpenAIError, rename_field
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
    UsageInfo,
    unix_time,
)
from pagedserve.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    IncompleteDetails,
    InputItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
    part_text,
)

#: Most responses stored at once; storing one more drops the oldest.
MAX_STORED_RESPONSES = 1000
#: Most bytes of JSON the stored responses and their conversations take together; storing one more drops the
#: oldest until it fits.
MAX_STORED_RESPONSE_BYTES = 256 * 1024**2
#: Seconds a stored response can be continued or retrieved, from when it finished.
STORED_RESPONSE_TTL_S = 3600.0


# --------------------------------------------------------------------------- the store


@dataclass
class StoredResponse:
    response: Response
    messages: list[ChatMessage]  # the conversation through the response's output, instructions left out
    expires_at: float  # on the store's clock
    num_bytes: int  # ``stored_bytes`` of the two


def stored_bytes(response: Response, messages: list[ChatMessage]) -> int:
    """Bytes of JSON of a response and its conversation, what storing them costs (about). A continued
    conversation shares its predecessor's messages, counted again here: an upper bound."""
    return len(to_json(response)) + len(to_json(messages))


class ResponseStore:
    """Finished responses by id, for ``previous_response_id`` and ``GET /v1/responses/{id}``.

    Args:
        max_size: most responses kept; storing one more drops the oldest.
        max_bytes: most ``stored_bytes`` kept, all responses together; storing one more drops the oldest
            until it fits (one larger than this alone is not kept).
        ttl_s: seconds a response is kept after it was stored.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, max_size: int = MAX_STORED_RESPONSES, ttl_s: float = STORED_RESPONSE_TTL_S,
                 clock: Callable[[], float] = time.monotonic, max_bytes: int = MAX_STORED_RESPONSE_BYTES) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.num_bytes = 0  # of the responses kept
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    @classmethod
    def of(cls, app: FastAPI) -> ResponseStore:
        """The app's store, made on first use (apps that share an engine keep their own)."""
        if not hasattr(app.state, "response_store"):
            app.state.response_store = cls()
        return app.state.response_store

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: Response, messages: list[ChatMessage]) -> None:
        now = self.clock()
        self._drop_expired(now)
        entry = StoredResponse(response, messages, now + self.ttl_s, stored_bytes(response, messages))
        if entry.num_bytes > self.max_bytes:
            return
        while len(self._entries) >= self.max_size or self.num_bytes + entry.num_bytes > self.max_bytes:
            self._drop_oldest()
        self._entries[response.id] = entry
        self.num_bytes += entry.num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        self._drop_expired(self.clock())
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.num_bytes

    def _drop_expired(self, now: float) -> None:
        # One TTL for all: the oldest entry expires first.
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._drop_oldest()


def response_not_found(response_id: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND, f"Response with id '{response_id}' not found.", "response_id")


def retrieve_response(store: ResponseStore, response_id: str) -> Response:
    """``GET /v1/responses/{id}``. Raises: OpenAIError: 404 when it is not (or no longer) stored."""
    entry = store.get(response_id)
    if entry is None:
        raise response_not_found(response_id)
    return entry.response


# --------------------------------------------------------------------------- request -> chat


def _input_messages(items: str | list[InputItem], history: list[ChatMessage]) -> list[ChatMessage]:
    """``history`` followed by the input items as chat messages (``history``'s are not changed)."""
    if isinstance(items, str):
        return [*history, ChatMessage(role="user", content=items)]
    messages = list(history)
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":  # the same turn: text then calls, or parallel calls
                last = messages[-1]
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=part_text(item.output)))
        elif isinstance(item, ReasoningItem):
            continue  # earlier thinking: chat templates leave it out of the prompt
        else:
            messages.append(ChatMessage(role=item.role, content=part_text(item.content)))
    return messages


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else ResponseFormat(type=fmt.type)
    return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def chat_request(request: ResponsesRequest, history: list[ChatMessage]
                 ) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
    """The chat request that answers ``request``, and its conversation without the instructions
    (what a continuation starts from). ``history``: the conversation of ``previous_response_id``."""
    conversation = _input_messages(request.input, history)
    system = [] if request.instructions is None else [ChatMessage(role="system", content=request.instructions)]
    tools = None if request.tools is None else [
        ChatCompletionTool(type="function", function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict))
        for tool in request.tools]
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    chat = ChatCompletionRequest(
        model=request.model, messages=system + conversation, max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, response_format=_response_format(request.text),
        tools=tools, tool_choice=choice, parallel_tool_calls=request.parallel_tool_calls, user=request.user,
        stream=request.stream, stream_options=StreamOptions(include_usage=True) if request.stream else None)
    return chat, conversation


#: Chat's name of a field (the start of an error's dotted ``param``) -> the Responses API's.
_FIELD_NAMES = (
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools(\.\d+)\.function"), r"tools\1"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
    (re.compile(r"^(messages(\..*)?|prompt)$"), "input"),
)


# --------------------------------------------------------------------------- chat -> response


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response(request: ResponsesRequest, model: str) -> Response:
    """The response to ``request``, in progress, with no output yet."""
    return Response(
        id=_item_id("resp"), created_at=unix_time(), status="in_progress", model=model,
        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p,
        text=request.text or TextConfig(format=TextFormat(type="text")), tools=request.tools or [],
        tool_choice=request.tool_choice or "auto", parallel_tool_calls=request.parallel_tool_calls,
        previous_response_id=request.previous_response_id, store=request.store,
        metadata=request.metadata or {}, user=request.user)


def _output(message: AssistantMessage) -> list[OutputItem]:
    """The output items of chat's whole reply: its thinking (``--reasoning-parser``), its text (unless it only
    made calls or only thought), then its calls."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(OutputReasoning(id=_item_id("rs"), status="completed",
                                     content=[ReasoningText(text=message.reasoning_content)]))
    if message.content or not (message.tool_calls or message.reasoning_content):
        items.append(OutputMessage(id=_item_id("msg"), status="completed",
                                   content=[OutputText(text=message.content or "")]))
    items += [OutputFunctionCall(id=_item_id("fc"), status="completed", call_id=call.id,
                                 name=call.function.name, arguments=call.function.arguments)
              for call in message.tool_calls or ()]
    return items


def _assistant_message(output: list[OutputItem]) -> ChatMessage:
    """The output as the conversation's next chat message."""
    text = "".join(item.content[0].text for item in output if isinstance(item, OutputMessage))
    calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
             for item in output if isinstance(item, OutputFunctionCall)]
    return ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)


def _finish(response: Response, finish_reason: str | None, usage: UsageInfo | None) -> None:
    """Set the response's status, usage and end time from chat's finish reason: ``length`` is
    ``incomplete`` (the last item too), no reason (an abort, at shutdown) ``failed``."""
    response.completed_at = unix_time()
    if usage is not None:
        response.usage = ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                       total_tokens=usage.total_tokens)
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        if response.output:
            response.output[-1].status = "incomplete"
    elif finish_reason is None:
        response.status = "failed"
        response.error = ResponseError(code="server_error", message="The request was aborted: the server "
                                       "is shutting down.")
    else:
        response.status = "completed"


async def create_response(request: ResponsesRequest, engine: AsyncLLM, store: ResponseStore,
                          tool_call_parser: str = "auto") -> Response | EventSourceResponse:
    """Run a Responses API request through chat: a ``Response``, or an SSE stream of typed events.

    ``tool_call_parser`` (``--tool-call-parser``) names the tool-call format, ``auto`` = the model's.

    Raises:
        OpenAIError: 400 for invalid or unsupported input (an unknown ``previous_response_id``:
            ``previous_response_not_found``, as OpenAI), 404 for an unknown model, 429 when the queue
            is full, 503 when the engine is down.
    """
    request.check()
    history: list[ChatMessage] = []
    if request.previous_response_id is not None:
        previous = store.get(request.previous_response_id)
        if previous is None:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"Previous response with id "
                              f"'{request.previous_response_id}' not found.", "previous_response_id",
                              "previous_response_not_found")
        history = previous.messages
    chat, conversation = chat_request(request, history)
    response = new_response(request, request.model or engine.model_name)
    try:
        result = await run_chat(chat, engine, tool_call_parser)
    except OpenAIError as error:
        raise rename_field(error, _FIELD_NAMES) from error

    def keep(finished: Response) -> None:
        if request.store and finished.status != "failed":
            store.put(finished, [*conversation, _assistant_message(finished.output)])

    if not isinstance(result, ChatCompletionResponse):
        return EventSourceResponse(ResponseStream(response).events(result, keep), sep="\n")
    choice = result.choices[0]
    response.output = _output(choice.message)
    _finish(response, choice.finish_reason, result.usage)
    keep(response)
    return response


class ResponseStream:
    """The typed events of one streamed response, from chat's chunks.

    One output item is open at a time: text opens a message, a tool call's first piece (the one with
    its ``id``) a function call, each closing the item before (chat streams the calls one after the
    other). Every event carries the next ``sequence_number``, from 0.
    """

    def __init__(self, response: Response) -> None:
        self.response = response
        self.sequence_number = 0
        self.open: OutputItem | None = None
        self.calls: dict[int, OutputFunctionCall] = {}  # by chat's tool call index

    def _event(self, type_: str, **fields: Any) -> ServerSentEvent:
        data = {"type": type_, "sequence_number": self.sequence_number} | {
            name: value.model_dump(mode="json", by_alias=True) if isinstance(value, BaseModel) else value
            for name, value in fields.items()}
        self.sequence_number += 1
        return ServerSentEvent(data=json.dumps(data), event=type_)

    def _item_event(self, type_: str, item: OutputItem, **fields: Any) -> ServerSentEvent:
        return self._event(type_, item_id=item.id, output_index=self.response.output.index(item), **fields)

    def _add(self, item: OutputItem) -> Iterator[ServerSentEvent]:
        self.response.output.append(item)
        self.open = item
        yield self._event("response.output_item.added", output_index=len(self.response.output) - 1, item=item)
        if isinstance(item, OutputMessage):
            item.content.append(OutputText(text=""))  # after the event: the item is added with no content
            yield self._item_event("response.content_part.added", item, content_index=0, part=item.content[0])

    def _close(self, status: str) -> Iterator[ServerSentEvent]:
        item, self.open = self.open, None
        if item is None:
            return
        item.status = status
        if isinstance(item, OutputMessage):
            part = item.content[0]
            yield self._item_event("response.output_text.done", item, content_index=0, text=part.text, logprobs=[])
            yield self._item_event("response.content_part.done", item, content_index=0, part=part)
        elif isinstance(item, OutputReasoning):
            yield self._item_event("response.reasoning_text.done", item, content_index=0, text=item.content[0].text)
        else:
            yield self._item_event("response.function_call_arguments.done", item, name=item.name,
                                   arguments=item.arguments)
        yield self._event("response.output_item.done", output_index=self.response.output.index(item), item=item)

    def _delta(self, delta: DeltaMessage) -> Iterator[ServerSentEvent]:
        if delta.reasoning_content:
            if not isinstance(self.open, OutputReasoning):
                yield from self._close("completed")
                yield from self._add(OutputReasoning(id=_item_id("rs"), status="in_progress",
                                                     content=[ReasoningText(text="")]))
            self.open.content[0].text += delta.reasoning_content
            yield self._item_event("response.reasoning_text.delta", self.open, content_index=0,
                                   delta=delta.reasoning_content)
        if delta.content:
            if not isinstance(self.open, OutputMessage):
                yield from self._close("completed")
                yield from self._add(OutputMessage(id=_item_id("msg"), status="in_progress", content=[]))
            self.open.content[0].text += delta.content
            yield self._item_event("response.output_text.delta", self.open, content_index=0, delta=delta.content,
                                   logprobs=[])
        for call in delta.tool_calls or ():
            if call.id is not None:
                yield from self._close("completed")
                self.calls[call.index] = OutputFunctionCall(id=_item_id("fc"), status="in_progress", call_id=call.id,
                                                            name=call.function.name or "", arguments="")
                yield from self._add(self.calls[call.index])
            item = self.calls[call.index]
            if call.function.arguments:
                item.arguments += call.function.arguments
                yield self._item_event("response.function_call_arguments.delta", item, delta=call.function.arguments)

    async def events(self, chunks: AsyncGenerator[ChatCompletionChunk, None], finished: Callable[[Response], None]
                     ) -> AsyncIterator[ServerSentEvent]:
        """The events, from chat's chunks (``run_chat``); an error they raise ends the stream with
        ``response.failed``. ``finished`` gets the response once it is complete (or incomplete), before
        the last event."""
        yield self._event("response.created", response=self.response)
        yield self._event("response.in_progress", response=self.response)
        finish_reason: str | None = None
        usage: UsageInfo | None = None
        async with aclosing(chunks):
            try:
                async for chunk in chunks:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        for event in self._delta(choice.delta):
                            yield event
                        finish_reason = choice.finish_reason or finish_reason
            except OpenAIError as error:
                self.response.status = "failed"
                # The SDK reads code as one of OpenAI's; ours (engine_dead, request_failed, ...) are server errors.
                self.response.error = ResponseError(code="server_error", message=error.message)
                yield self._event("response.failed", response=self.response)
                return
        for event in self._close("incomplete" if finish_reason == "length" else "completed"):
            yield event
        _finish(self.response, finish_reason, usage)
        finished(self.response)
        yield self._event(f"response.{self.response.status}", response=self.response)
