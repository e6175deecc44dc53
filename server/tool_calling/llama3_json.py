"""Llama 3.1-3.3's JSON tool-call format (vLLM's ``llama3_json``): a reply that is a call is JSON, ::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>``, several separated by ``;``. A reply that does not open with ``{`` (or
the tag) is plain text, and so is one that opens so but holds no call (JSON that answers, held to a
``response_format``), sent when the reply ends. ``"arguments"`` is accepted for ``"parameters"``, as vLLM does.

The grammar for ``tool_choice: auto`` lets the reply be text that does not open with ``{``, or calls held to
the tools' names and parameters; ``required`` and a named tool allow only calls. The prompt fallback, for a
chat template without tools, lists the tools in the system message with Meta's instructions for JSON calls;
an assistant's calls are written as that JSON and tool results become user messages.

Arguments stream as their raw text, as in the Hermes parser (``json_text.ValueEnd`` finds where they end).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.server.tool_calling.base import ParsedDelta, ToolCallDelta, ToolParser, add_to_system_message
from pagedserve.server.tool_calling.json_text import ValueEnd, add_arguments, json_call_rules, json_option, json_string
from pagedserve.server.tool_calling.plan import ToolPlan

PYTHON_TAG = "<|python_tag|>"
#: A call's JSON up to its parameters' value: ``{"name": "<name>", "parameters": ``.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:')
_INSTRUCTIONS = """Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.

Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. \
Do not use variables.

{tools}"""


class Llama3JsonToolParser(ToolParser):
    """Splits a reply in Llama 3's JSON format: text, or ``{"name", "parameters"}`` calls joined by ``;``."""

    name = "llama3_json"

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # "text" or "calls", once the reply's opening decides it
        self._num_calls = 0
        self._value: ValueEnd | None = None  # the open call's parameters, once its name was sent
        self._closed = True  # no call open: the next is awaited (after ";")
        self._held = ""  # the reply's text since it opened as calls, until a call's name came: content if none does

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        if self._mode != "text" and not self._num_calls:
            self._held += text
        delta = ParsedDelta()
        if self._mode is None:
            opening = self._buffer.lstrip()
            if not opening or (PYTHON_TAG.startswith(opening) and opening != PYTHON_TAG):
                return delta  # whitespace, or perhaps the tag, cut short
            self._mode = "calls" if opening.startswith(("{", PYTHON_TAG)) else "text"
            if self._mode == "calls":
                self._buffer = opening.removeprefix(PYTHON_TAG)
        if self._mode == "text":
            delta.content, self._buffer = self._buffer, ""
            return delta
        while self._step(delta):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        delta = ParsedDelta()
        if self._mode != "calls":
            delta.content, self._buffer = self._buffer, ""
        elif self._closed and self._buffer.strip().removeprefix(";").strip():
            self._whole_call(self._buffer, delta)  # a call that did not open as {"name", "parameters"}
        if self._mode == "calls" and not self._num_calls:
            delta.content = self._held  # JSON that is no call (an answer held to a response_format), as written
        self._buffer = self._held = ""
        return delta

    def _step(self, delta: ParsedDelta) -> bool:
        """Decide what it can of the buffer; False when it must wait for more text."""
        if self._closed:
            text = self._buffer.lstrip()
            head = _CALL_HEAD.match(text.removeprefix(";") if self._num_calls else text)
            if head is None:
                return False
            self._closed, self._value = False, ValueEnd()
            self._buffer = text.removeprefix(";")[head.end():] if self._num_calls else text[head.end():]
            delta.calls.append(ToolCallDelta(self._num_calls, json_string(head.group(1)), ""))
            self._num_calls += 1
            return True
        if not self._value.done:
            piece, used = self._value.feed(self._buffer)
            self._buffer = self._buffer[used:]
            if piece:
                add_arguments(delta, self._num_calls - 1, piece)
            return self._value.done
        end = self._buffer.find("}")  # the call object's own
        if end < 0:
            return False
        self._buffer, self._closed = self._buffer[end + 1:], True
        return True

    def _whole_call(self, body: str, delta: ParsedDelta) -> None:
        """JSON calls that did not open with ``name`` first: each object with a string ``name`` is taken whole."""
        for part in body.split(";"):
            try:
                call = json.loads(part)
            except ValueError:
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                arguments = call.get("parameters", call.get("arguments", {}))
                text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                delta.calls.append(ToolCallDelta(self._num_calls, call["name"], text))
                self._num_calls += 1

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return '"parameters": dictionary of argument name' in chat_template

    @classmethod
    def grammar(cls, plan: ToolPlan) -> str:
        lines = ["%llguidance {}"]
        if plan.mode != "auto":
            lines.append("start: calls")
        elif plan.answer_schema is not None:
            lines += ["start: answer | calls", f"answer: %json {json_option(plan.answer_schema)}"]
        else:
            lines += ["start: TEXT | calls", r"TEXT: /([^{\s](.|\n)*)?/"]
        lines.append('calls: call ("; " call)*' if plan.parallel else "calls: call")
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(plan.callable))))
        return "\n".join(lines + json_call_rules(plan, "parameters")) + "\n"

    @classmethod
    def render_fallback(cls, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, str]]:
        rendered: list[dict[str, str]] = []
        for message in messages:
            role, content = message["role"], message.get("content") or ""
            if role == "tool":
                rendered.append({"role": "user", "content": f"Tool result: {content}"})
                continue
            calls = [json.dumps({"name": call["function"]["name"], "parameters": _parameters(call["function"])},
                                ensure_ascii=False) for call in message.get("tool_calls") or ()]
            rendered.append({"role": role, "content": "; ".join(calls) if calls else content})
        if tools:
            listing = _INSTRUCTIONS.format(tools="\n\n".join(json.dumps(tool, indent=4, ensure_ascii=False)
                                                            for tool in tools))
            add_to_system_message(rendered, listing)
        return rendered


def _parameters(function: Mapping[str, Any]) -> Any:
    """A call's arguments as JSON: a dict as is, OpenAI's JSON text parsed (kept as text when it is not JSON)."""
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
