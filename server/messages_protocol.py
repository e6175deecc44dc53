"""Anthropic's Messages API (https://docs.anthropic.com/en/api/messages): the request, the message it answers
with, and the token count, as Anthropic defines them; ``pagedserve.server.messages`` serves them through chat.

What is served: text, ``tool_use``, ``tool_result`` and (passed over, as chat templates leave earlier thinking
out) ``thinking`` blocks; custom tools; ``output_config.format`` (a JSON schema). What would change the output and
is not served is a 400 naming the field: images and documents, server tools, ``thinking`` budgets, MCP servers.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from pagedserve.server.errors import OpenAIError, bad_request
from pagedserve.server.protocol import Number, OpenAIBaseModel, RequestBody, Text, check_fields

#: Content blocks a message may hold; another type (image, document, server tool results) is a 400.
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")

#: Fields that would change the output but are not served (``check_fields``' table): a request setting one
#: to anything but null gets a 400 naming it.
UNSUPPORTED_MESSAGES_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "thinking": ("a thinking budget; a reasoning model thinks as its chat template has it, and with "
                 "--reasoning-parser its thinking comes back in thinking blocks", ()),
    "mcp_servers": ("MCP servers", ([],)),
    "container": ("containers for server tools", ()),
    "context_management": ("context editing", ()),
}


class TextBlock(OpenAIBaseModel):
    """Text; its ``cache_control`` is accepted and needs nothing: the prefix cache is automatic."""

    type: Literal["text"] = "text"
    text: Text


class ToolUseBlock(OpenAIBaseModel):
    """A call the assistant made: the tool's name and its input, a JSON object."""

    type: Literal["tool_use"] = "tool_use"
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(OpenAIBaseModel):
    """What a call returned, in a user message; ``is_error`` marks a failed call, whose text says so."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)


class ThinkingBlock(OpenAIBaseModel):
    """The assistant's thinking before its answer (``--reasoning-parser``); ``signature`` is empty here, and
    ignored when a client sends a block back."""

    type: Literal["thinking"] = "thinking"
    thinking: Text
    signature: Text = ""


class RedactedThinkingBlock(OpenAIBaseModel):
    type: Literal["redacted_thinking"]
    data: Text


InputBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                       Field(discriminator="type")]
ContentBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]


class InputMessage(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: Text | list[InputBlock]


class Tool(OpenAIBaseModel):
    """A custom tool: its input follows ``input_schema`` (a JSON schema of an object)."""

    name: Text
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: StrictBool | None = None


class ToolChoice(OpenAIBaseModel):
    """``auto`` (the model chooses), ``any`` (one or more calls), ``tool`` (a call of ``name``) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool', and only allowed with it")
        return self


class Metadata(OpenAIBaseModel):
    user_id: Text | None = None


class JSONOutputFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBaseModel):
    """The answer's format: a JSON schema it follows (structured output). ``effort`` is not served."""

    format: JSONOutputFormat | None = None
    effort: Text | None = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, effort: str | None) -> None:
        if effort is not None:
            raise ValueError("effort is not supported by this server; leave it out")


def _unsupported(param: str, what: str) -> OpenAIError:
    return bad_request(f"Invalid value for '{param}': {what} not supported by this server.", param)


class MessagesPrompt(RequestBody):
    """What ``POST /v1/messages/count_tokens`` counts: the conversation, the system prompt and the tools."""

    unsupported_fields: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = UNSUPPORTED_MESSAGES_FIELDS

    model: Text
    messages: list[InputMessage]
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[InputMessage]) -> list[InputMessage]:
        if not messages:
            raise ValueError("at least one message is required")
        return messages

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_text(cls, data: Any) -> Any:
        """A 400 naming the first content block or tool that is not served (an error here, not a ValueError:
        pydantic would report every member of the block union instead)."""
        if not isinstance(data, dict):
            return data
        for i, message in enumerate(data["messages"] if isinstance(data.get("messages"), list) else ()):
            content = message.get("content") if isinstance(message, dict) else None
            for j, block in enumerate(content if isinstance(content, list) else ()):
                if not isinstance(block, dict):
                    continue
                if block.get("type") not in _BLOCK_TYPES:
                    raise _unsupported(f"messages.{i}.content.{j}.type",
                                       f"content blocks of type {json.dumps(block.get('type'))} are")
                inner = block.get("content") if block.get("type") == "tool_result" else None
                for k, part in enumerate(inner if isinstance(inner, list) else ()):
                    if isinstance(part, dict) and part.get("type") != "text":
                        raise _unsupported(f"messages.{i}.content.{j}.content.{k}.type",
                                           f"tool results of type {json.dumps(part.get('type'))} are")
        for i, tool in enumerate(data["tools"] if isinstance(data.get("tools"), list) else ()):
            if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
                raise _unsupported(f"tools.{i}.type", f"server tools ({json.dumps(tool.get('type'))}) are")
        return data

    def check(self) -> None:
        """Refuse the fields of ``UNSUPPORTED_MESSAGES_FIELDS`` that ask for something; log other unknown ones.

        Raises:
            OpenAIError: 400 naming the first unsupported field set.
        """
        check_fields(self, self.unsupported_fields)


class MessagesRequest(MessagesPrompt):
    """``POST /v1/messages``."""

    max_tokens: StrictInt
    stop_sequences: list[Text] | None = None
    stream: StrictBool = False
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    metadata: Metadata | None = None
    # Accepted and ignored: they change nothing in the output.
    service_tier: Text | None = None
    cache_control: dict[str, Any] | None = None


class Usage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(OpenAIBaseModel):
    """The assistant's answer: its thinking, text and calls as content blocks, in that order."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None  # null only in a stream's message_start
    stop_sequence: str | None = None  # the one of stop_sequences that ended the answer
    usage: Usage


class MessageTokensCount(OpenAIBaseModel):
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as ``usage.input_tokens`` counts them."""

    input_tokens: int
