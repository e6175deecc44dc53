"""The messages and tools a chat template is given: the template's own tool rendering when it has one,
else the tool format's fallback (``ToolParser.render_fallback``)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedserve.engine.chat_template import takes_tools
from pagedserve.server.protocol import ChatMessage, conversation
from pagedserve.server.tool_calling.base import ToolParser
from pagedserve.server.tool_calling.plan import ToolPlan


def render_inputs(messages: list[ChatMessage], plan: ToolPlan | None, tool_format: type[ToolParser],
                  tokenizer: PreTrainedTokenizerBase) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` for ``apply_chat_template``. The tools are shown unless there are none or
    ``tool_choice`` is ``none``. The template shows them itself only when it takes tools and writes calls
    in ``tool_format`` (the format the reply is held to and parsed in); otherwise it gets plain
    ``{"role", "content"}`` messages from ``tool_format`` (tools in the system message, calls and
    results as text) and no tools, so the prompt always describes the format that is parsed."""
    shown = [tool.spec for tool in plan.tools] if plan is not None and plan.active else None
    if takes_tools(tokenizer) and tool_format.detect(str(tokenizer.chat_template or "")):
        return conversation(messages), shown
    return tool_format.render_fallback(conversation(messages), shown), None
