"""A choice's reply through a tool parser, in OpenAI's shapes: whole (``reply_message``) or streamed
(``StreamedReply``). Calls get ids ``call_<24 hex digits>``; ``finish_reason`` is ``tool_calls`` when
the reply made calls and stopped on its own (``length`` stays ``length``)."""

from __future__ import annotations

import uuid

from pagedserve.server.protocol import AssistantMessage, DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pagedserve.server.tool_calling.base import ParsedDelta, ToolParser, parse_reply


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


def reply_message(parser: ToolParser, text: str, prefix: str = "") -> tuple[AssistantMessage, bool]:
    """The message of a whole reply ``text`` (``prefix``, vLLM's echo, before its content), and whether
    it made calls."""
    reply = parse_reply(parser, text)
    calls = [ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))
             for name, arguments in reply.calls]
    content = prefix + reply.content
    return AssistantMessage(content=content if content or not calls else None, tool_calls=calls or None), bool(calls)


class StreamedReply:
    """One choice's streamed reply: its text deltas in, OpenAI's ``content`` and ``tool_calls`` deltas out."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.ids: list[str] = []

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """``(content, tool_calls)`` for the next piece of the reply, None where there is nothing new.
        A call's first delta carries its ``id``, ``type`` and ``function.name``; the next ones pieces of
        ``function.arguments``."""
        parsed = self.parser.feed(text)
        if finished:
            parsed = _merged(parsed, self.parser.finish())
        calls = []
        for call in parsed.calls:
            if call.name is not None:
                self.ids.append(call_id())
                calls.append(DeltaToolCall(index=call.index, id=self.ids[call.index], type="function",
                                           function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            elif call.arguments:
                calls.append(DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments)))
        return parsed.content or None, calls or None


def _merged(first: ParsedDelta, second: ParsedDelta) -> ParsedDelta:
    """``first`` then ``second`` as one delta: a call's pieces joined."""
    calls = list(first.calls)
    for call in second.calls:
        if calls and calls[-1].index == call.index:
            calls[-1].arguments += call.arguments
        else:
            calls.append(call)
    return ParsedDelta(first.content + second.content, calls)
