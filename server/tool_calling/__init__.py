"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

A request's tools are checked and resolved into a ``ToolPlan`` (``plan``). The prompt shows them
through the model's chat template when it takes ``tools``, else through the format's fallback
(``ToolParser.render_fallback``, ``prompt``). Unless ``tool_choice`` is ``none``, a grammar from the
format (``ToolParser.grammar``) holds the reply to well-formed calls of the given tools, and the
format's parser splits the reply, whole or streamed, into ``content`` and ``tool_calls`` (``output``).

Formats are registered by name in ``TOOL_PARSERS`` (``--tool-call-parser``); ``auto`` picks the one
whose markup the model's chat template shows, else ``DEFAULT_TOOL_PARSER``. Adding a format is one
``ToolParser`` subclass and one line here.
"""

from __future__ import annotations

from pagedserve.server.tool_calling.base import ParsedDelta, ParsedReply, ToolCallDelta, ToolParser, parse_reply
from pagedserve.server.tool_calling.hermes import HermesToolParser
from pagedserve.server.tool_calling.llama3_json import Llama3JsonToolParser
from pagedserve.server.tool_calling.plan import Tool, ToolPlan, plan_tools

TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser,
                                                                                 Llama3JsonToolParser)}
DEFAULT_TOOL_PARSER = "hermes"
#: ``--tool-call-parser``'s values.
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS)


def tool_parser_class(setting: str, chat_template: str | None) -> type[ToolParser]:
    """The format named by ``setting`` (``--tool-call-parser``); for ``auto``, the first registered one
    that the chat template shows, else ``DEFAULT_TOOL_PARSER``.

    Raises:
        ValueError: an unknown name.
    """
    if setting == "auto":
        detected = [parser for parser in TOOL_PARSERS.values() if parser.detect(chat_template or "")]
        return detected[0] if detected else TOOL_PARSERS[DEFAULT_TOOL_PARSER]
    if setting not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {setting!r}; one of {', '.join(TOOL_PARSER_CHOICES)}")
    return TOOL_PARSERS[setting]


__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "TOOL_PARSER_CHOICES", "HermesToolParser", "Llama3JsonToolParser",
           "ParsedDelta",
           "ParsedReply", "Tool", "ToolCallDelta", "ToolParser", "ToolPlan", "parse_reply", "plan_tools",
           "tool_parser_class"]
