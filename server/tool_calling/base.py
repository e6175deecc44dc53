"""What every tool-call format provides: an incremental parser, a grammar and a prompt fallback.

A format (Hermes' ``<tool_call>`` markup, ...) is one ``ToolParser`` subclass, registered by name in
``pagedserve.server.tool_calling.TOOL_PARSERS``. The same parser splits a reply whole and streamed: a whole reply
is fed in one piece (``parse_reply``), so a streamed reply's deltas always add up to the whole one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedserve.server.tool_calling.plan import ToolPlan


@dataclass
class ToolCallDelta:
    """A piece of one tool call.

    Attributes:
        index: the call's position in the reply, from 0.
        name: the function's name, on the call's first piece only.
        arguments: the next piece of the arguments' JSON text ("" when none came yet).
    """

    index: int
    name: str | None
    arguments: str


@dataclass
class ParsedDelta:
    """What a piece of the model's text turned out to be: reply text and pieces of calls (at most
    one piece per call)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedReply:
    """A whole reply: its text outside the call markup, and each call as ``(name, arguments JSON text)``."""

    content: str
    calls: list[tuple[str, str]]


class ToolParser(ABC):
    """Splits one reply, fed as it streams, into content and tool calls; one instance per reply.

    Subclasses also say how their format is prompted (``render_fallback``) and constrained (``grammar``).
    """

    #: The registry's name for the format (``--tool-call-parser``).
    name: ClassVar[str]

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """The next piece of the reply's text; text that may still turn out to be markup is held back."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The end of the reply: what was held back. A call cut short keeps what it got; a call whose
        name never arrived is dropped."""

    @classmethod
    @abstractmethod
    def detect(cls, chat_template: str) -> bool:
        """Whether a model whose chat template is ``chat_template`` writes calls in this format."""

    @classmethod
    @abstractmethod
    def grammar(cls, plan: ToolPlan) -> str:
        """The llguidance Lark grammar that holds the reply to ``plan`` (``plan.active`` is true)."""

    @classmethod
    @abstractmethod
    def render_fallback(cls, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, str]]:
        """``messages`` (``protocol.conversation``'s dicts) as plain ``{"role", "content"}`` messages for a
        chat template that knows nothing of tools: the tools and this format's instructions in the system
        message, an assistant's calls written as markup, tool results as user messages."""


def parse_reply(parser: ToolParser, text: str) -> ParsedReply:
    """A whole reply, split by a fresh ``parser``: exactly what its streamed deltas add up to."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for delta in (parser.feed(text), parser.finish()):
        content.append(delta.content)
        for call in delta.calls:
            if call.name is not None:
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return ParsedReply("".join(content), [(name, arguments) for name, arguments in calls.values()])


def add_to_system_message(messages: list[dict[str, str]], text: str) -> None:
    """Append ``text`` to the first message when it is a system (or developer) one, else insert it as one."""
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}".lstrip()
    else:
        messages.insert(0, {"role": "system", "content": text})
