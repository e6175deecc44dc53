"""The Hermes tool-call format (NousResearch Hermes 2 Pro, Qwen2.5/3, ...): JSON inside ``<tool_call>`` tags.

A reply is optional text, then the calls, each ::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

separated by a newline. The markers are plain text, not special tokens, in most vocabularies
(SmolLM2's included), so the grammar of ``tool_choice: auto`` switches on with a lazy lexeme: free
text until it ends in ``<tool_call>``, then a call held to a tool's name and parameters, then only
another call or the end.

Prompt fallback, for a chat template without tools (SmolLM2's): the system message gets a
``# Tools`` section listing the tools as JSON inside ``<tools></tools>`` and the instructions above
(Qwen2.5's wording); an assistant message's ``tool_calls`` are written as the markup after its text;
``role: tool`` messages become user messages ``<tool_response>\\n{content}\\n</tool_response>``,
consecutive ones merged into one.

The parser streams a call's arguments as their raw text, as the model writes them, so the pieces
always concatenate to the final JSON (no re-serialized partial JSON, which drops or doubles
characters: vLLM #19056, #22885, #21544); text that may be the start of ``<tool_call>`` is held back
so no markup reaches ``content``, and whitespace around the markup is dropped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.engine.reasoning import partial_suffix
from pagedserve.server.tool_calling.base import ParsedDelta, ToolCallDelta, ToolParser, add_to_system_message
from pagedserve.server.tool_calling.json_text import ValueEnd, add_arguments, json_call_rules, json_option, json_string
from pagedserve.server.tool_calling.plan import ToolPlan

logger = logging.getLogger(__name__)

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
#: A call's JSON up to its arguments' value: ``{"name": "<name>", "arguments": ``.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')

_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class HermesToolParser(ToolParser):
    """Splits a reply in the Hermes format: text, then ``<tool_call>{"name", "arguments"}</tool_call>`` calls."""

    name = "hermes"

    def __init__(self) -> None:
        self._buffer = ""  # text not yet decided
        self._in_call = False
        self._held_space = ""  # trailing whitespace of the content, dropped if markup follows
        self._after_call = False  # drop the whitespace that follows a call
        self._num_calls = 0
        self._named = False  # the open call's name has been sent
        self._value: ValueEnd | None = None

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        delta = ParsedDelta()
        while self._step(delta):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        delta = ParsedDelta()
        if self._in_call and not self._named:
            self._whole_call(self._buffer, delta)
        elif not self._in_call:
            delta.content = self._content(self._buffer)
            if not self._num_calls:
                delta.content += self._held_space
        self._buffer = self._held_space = ""
        return delta

    def _step(self, delta: ParsedDelta) -> bool:
        """Decide what it can of the buffer; False when it must wait for more text."""
        if not self._in_call:
            start = self._buffer.find(CALL_START)
            if start < 0:
                keep = partial_suffix(self._buffer, CALL_START)
                delta.content += self._content(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return False
            delta.content += self._content(self._buffer[:start])
            self._buffer = self._buffer[start + len(CALL_START):]
            self._in_call, self._named, self._value, self._held_space = True, False, None, ""
            return True
        if not self._named:
            head = _CALL_HEAD.match(self._buffer)
            if head is not None:
                self._named, self._value = True, ValueEnd()
                self._buffer = self._buffer[head.end():]
                delta.calls.append(ToolCallDelta(self._num_calls, json_string(head.group(1)), ""))
                self._num_calls += 1
                return True
            end = self._buffer.find(CALL_END)
            if end < 0:
                return False
            self._whole_call(self._buffer[:end], delta)
            self._close_call(end)
            return True
        if self._value is not None and not self._value.done:
            piece, used = self._value.feed(self._buffer)
            self._buffer = self._buffer[used:]
            if piece:
                add_arguments(delta, self._num_calls - 1, piece)
            return self._value.done
        end = self._buffer.find(CALL_END)
        if end < 0:
            return False
        self._close_call(end)
        return True

    def _close_call(self, end: int) -> None:
        self._buffer = self._buffer[end + len(CALL_END):]
        self._in_call, self._after_call = False, True

    def _whole_call(self, body: str, delta: ParsedDelta) -> None:
        """A call whose JSON did not start as ``{"name": ..., "arguments": ...}``: taken whole if it is a
        JSON object with a string ``name`` (and ``arguments``), else dropped."""
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            logger.debug("dropped a tool call that is not valid JSON with a name: %r", body[:200])
            return
        arguments = call.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        delta.calls.append(ToolCallDelta(self._num_calls, call["name"], text))
        self._num_calls += 1

    def _content(self, text: str) -> str:
        """``text`` as reply text, less the whitespace next to markup (trailing whitespace is held)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        stripped = text.rstrip()
        if not stripped:
            self._held_space += text
            return ""
        out = self._held_space + stripped
        self._held_space = text[len(stripped):]
        return out

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return CALL_START in chat_template

    @classmethod
    def grammar(cls, plan: ToolPlan) -> str:
        lines = ["%llguidance {}"]
        if plan.mode != "auto":
            lines.append(f'start: "{CALL_START}" calls')
        elif plan.answer_schema is not None:
            lines += [f'start: answer | "{CALL_START}" calls', f"answer: %json {json_option(plan.answer_schema)}"]
        else:
            lines += ["start: TEXT | head calls", f'head[lazy]: TEXT "{CALL_START}"', r"TEXT: /(.|\n)*/"]
        lines.append(f'calls: body ("\\n{CALL_START}" body)*' if plan.parallel else "calls: body")
        alternatives = " | ".join(f"call_{i}" for i in range(len(plan.callable)))
        lines.append(f'body: "\\n" ({alternatives}) "\\n{CALL_END}"')
        return "\n".join(lines + json_call_rules(plan, "arguments")) + "\n"

    @classmethod
    def render_fallback(cls, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, str]]:
        rendered: list[dict[str, str]] = []
        previous_role = None
        for message in messages:
            role, content = message["role"], message.get("content") or ""
            if role == "tool":
                response = f"<tool_response>\n{content}\n</tool_response>"
                if previous_role == "tool":
                    rendered[-1]["content"] += "\n" + response
                else:
                    rendered.append({"role": "user", "content": response})
                previous_role = role
                continue
            previous_role = role
            calls = [_markup(call["function"]) for call in message.get("tool_calls") or ()]
            rendered.append({"role": role, "content": "\n".join(([content] if content else []) + calls)})
        if tools:
            listing = _INSTRUCTIONS.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
            add_to_system_message(rendered, listing)
        return rendered


def _markup(function: Mapping[str, Any]) -> str:
    """One call as the model writes it (``function``: ``{"name", "arguments"}``, arguments a dict or text)."""
    call = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"{CALL_START}\n{call}\n{CALL_END}"
