"""Request and response bodies of ``/v1/responses``, OpenAI's Responses API, in OpenAI's shapes.

``pagedserve.server.responses`` serves them by translating to and from chat completions. A request is read
as chat's are (``RequestBody``: strict types, valid Unicode, unknown fields logged); what it asks
for that this server does not have is a 400 naming it: input items or content parts other than text
(``input_image``, ``input_file``, ``reasoning``, ...), built-in tools (``web_search``,
``file_search``, ...) and the fields of ``UNSUPPORTED_RESPONSES_FIELDS`` (``background``,
``reasoning``, ...).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedserve.server.errors import OpenAIError, bad_request
from pagedserve.server.protocol import (
    UNSUPPORTED_FIELDS,
    Number,
    OpenAIBaseModel,
    RequestBody,
    SamplingRequest,
    Text,
    check_fields,
)

#: Fields of OpenAI's Responses API that would change the output and are not implemented:
#: name -> (what it asks for, the values that ask for nothing), as ``protocol.UNSUPPORTED_FIELDS``.
UNSUPPORTED_RESPONSES_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "background": ("background responses", (False,)),
    "reasoning": ("reasoning effort and summaries", ({},)),
    "conversation": ("conversations; use previous_response_id", ()),
    "prompt": ("stored prompt templates", ()),
    "include": ("extra output data", ([],)),
    "max_tool_calls": ("a bound on built-in tool calls", ()),
    "truncation": ("dropping input that does not fit the context", ("disabled",)),
    "top_logprobs": ("logprobs", (0,)),
    "context_management": ("compaction", ()),
}

#: Chat completions' sampling fields (and vLLM's) that the Responses API does not have: sent here,
#: each would change the output if served, so each is refused by name rather than ignored.
CHAT_ONLY_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    name: ("a chat completions field; the Responses API has no such field", ())
    for name in [*SamplingRequest.model_fields, "max_tokens", "max_completion_tokens"]
    if name not in ("model", "stream", "stream_options", "user", "temperature", "top_p")}

#: OpenAI's limits on ``metadata``: key-value pairs, and the characters of a key and of a value.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: Most characters of ``user`` and of a ``call_id``, kept with a stored response (OpenAI's ids are under 100).
MAX_IDENTIFIER_CHARS = 256
#: Most characters of a tool's description (agents' longest are a few thousand).
MAX_TOOL_DESCRIPTION_CHARS = 32_768

#: A client's identifier that a stored response keeps: ``user``, ``call_id``.
Identifier = Annotated[Text, Field(max_length=MAX_IDENTIFIER_CHARS)]

#: The input item types and content part types served: text, function calls and (dropped) reasoning.
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_PART_TYPES = ("input_text", "output_text")


# --------------------------------------------------------------------------- requests


class TextPart(OpenAIBaseModel):
    """``input_text``, or ``output_text`` in an assistant message passed back as input."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def part_text(content: Text | list[TextPart]) -> str:
    """A message's content, or a function call's output, as one string (parts joined by newlines)."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class MessageItem(OpenAIBaseModel):
    """A message (``type`` may be left out, as in the SDK's ``EasyInputMessage``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[TextPart]
    id: Text | None = None
    status: Text | None = None


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made, passed back as input (or one of ``Response.output``)."""

    type: Literal["function_call"] = "function_call"
    call_id: Identifier
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: Identifier
    output: Text | list[TextPart]
    id: Text | None = None
    status: Text | None = None


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: Text


class ReasoningItem(OpenAIBaseModel):
    """A model's thinking (with ``--reasoning-parser``): one of ``Response.output``, or passed back as input,
    where it is dropped (chat templates leave earlier turns' thinking out of the prompt)."""

    type: Literal["reasoning"] = "reasoning"
    id: Text | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Text | None = None


def _item_type(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


_INPUT_ITEMS = TypeAdapter(list[InputItem])


class TextFormat(OpenAIBaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``name`` and ``schema``
    (flat, where chat nests them under ``response_format.json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a format of type json_schema needs 'name' and 'schema'")
        return self


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; nothing else is served


class FunctionTool(OpenAIBaseModel):
    """A function tool, flat (chat nests these fields under ``function``)."""

    type: Literal["function"]
    name: Text
    description: Annotated[Text, Field(max_length=MAX_TOOL_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionToolChoice(OpenAIBaseModel):
    """``tool_choice: {"type": "function", "name": ...}``: call this function."""

    type: Literal["function"]
    name: Text


ResponsesToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


def _unsupported(param: str, what: str, instead: str) -> OpenAIError:
    return bad_request(f"Invalid value for '{param}': {what} not supported by this server; {instead}.", param)


class ResponsesRequest(RequestBody):
    """``POST /v1/responses``."""

    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    store: StrictBool = True
    stream: StrictBool = False
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None  # None = "auto" with tools, "none" without
    parallel_tool_calls: StrictBool = True
    metadata: dict[str, Text] | None = None
    user: Identifier | None = None
    # Accepted and ignored: they change nothing in the output.
    stream_options: dict[str, Any] | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_path(cls, value: Any, handler: Any) -> str | list[InputItem]:
        """A 400 naming the item's field (``input.2.role``): pydantic's error would name the union
        member and the item type's tag on the way."""
        if isinstance(value, str) or not isinstance(value, list):
            try:
                return handler(value)
            except ValidationError:
                raise ValueError("input must be a string or a list of input items") from None
        try:
            return _INPUT_ITEMS.validate_python(value)
        except ValidationError as exc:
            error = exc.errors()[0]
            parts = ["input"]
            for part in error["loc"]:
                if part in _ITEM_TYPES:  # the tag of the item's type
                    continue
                if isinstance(part, str) and (part == "str" or not part.isidentifier()):
                    break  # a union member's tag
                parts.append(str(part))
            param = ".".join(parts)
            raise bad_request(f"Invalid value for '{param}': {error['msg']}", param) from None

    @field_validator("metadata")
    @classmethod
    def _metadata_within_limits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits (``MAX_METADATA_PAIRS`` pairs, keys and values of at most ``MAX_METADATA_KEY_CHARS``
        and ``MAX_METADATA_VALUE_CHARS`` characters): a stored response keeps its metadata."""
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys have at most {MAX_METADATA_KEY_CHARS} characters, got one of {len(key)}")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values have at most {MAX_METADATA_VALUE_CHARS} characters, got one of "
                                 f"{len(value)}")
        return metadata

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_text(cls, data: Any) -> Any:
        """A 400 naming the first input item, content part, tool or tool choice that is not text or a
        function (an OpenAIError, not a ValueError: pydantic would report every union member instead)."""
        if not isinstance(data, dict):
            return data
        for i, item in enumerate(data["input"] if isinstance(data.get("input"), list) else ()):
            if not isinstance(item, dict):
                continue
            kind = _item_type(item)
            if kind not in _ITEM_TYPES:
                raise _unsupported(f"input.{i}.type", f"input items of type {json.dumps(kind)} are",
                                   f"send {', '.join(_ITEM_TYPES)}")
            if kind == "reasoning":
                continue  # dropped whole (ReasoningItem)
            field = "output" if kind == "function_call_output" else "content"
            parts = item.get(field)
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if isinstance(part, dict) and part.get("type") not in _PART_TYPES:
                    raise _unsupported(f"input.{i}.{field}.{j}.type",
                                       f"content of type {json.dumps(part.get('type'))} is",
                                       "send text as input_text")
        for i, tool in enumerate(data["tools"] if isinstance(data.get("tools"), list) else ()):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise _unsupported(f"tools.{i}.type", f"built-in tools ({json.dumps(tool.get('type'))}) are",
                                   "only function tools are served")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise _unsupported("tool_choice.type", f"tool_choice of type {json.dumps(choice.get('type'))} is",
                               "use none, auto, required or a function")
        return data

    def check(self) -> None:
        """Refuse the fields of ``UNSUPPORTED_RESPONSES_FIELDS``, chat's ``UNSUPPORTED_FIELDS`` and chat's
        own sampling fields (``CHAT_ONLY_FIELDS``) that ask for something, and log the other unknown ones
        (``check_fields``).

        Raises:
            OpenAIError: 400 naming the first unsupported field set.
        """
        check_fields(self, UNSUPPORTED_FIELDS | CHAT_ONLY_FIELDS | UNSUPPORTED_RESPONSES_FIELDS)


# --------------------------------------------------------------------------- responses


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(OpenAIBaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class OutputReasoning(OpenAIBaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class Response(OpenAIBaseModel):
    """A response, whole; in a stream, its state at each lifecycle event."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, echoed.
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    text: TextConfig
    tools: list[FunctionTool]
    tool_choice: ResponsesToolChoice
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    user: str | None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
