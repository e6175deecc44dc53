"""A chat request's tools and ``tool_choice``, checked at the door and resolved into a ``ToolPlan``.

``tool_choice`` (OpenAI's semantics; left out it is ``auto`` with tools, ``none`` without):

- ``none``: the reply is plain text; the tools are left out of the prompt and nothing is parsed.
- ``auto``: the model chooses; a grammar holds a call it starts to the format, to a tool's name and to
  that tool's parameters (``ToolPlan.active``), text before it is free.
- ``required``: one or more calls, nothing else (exactly one when ``parallel_tool_calls`` is false).
- ``{"type": "function", "function": {"name": X}}``: exactly one call, of X.

A structured-output constraint (``response_format``, ...) cannot hold a reply that must be a call:
with ``required`` or a named tool it is a 400 naming it. With ``auto``, a JSON one (``json_schema``,
``json_object``) holds the text answer instead of free text (``ToolPlan.answer_schema``); any other is
a 400.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampling_params import StructuredOutputsParams
from pagedserve.engine.structured_output.compiler import GrammarCompiler
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import ChatCompletionRequest, ChatCompletionTool, NamedToolChoice, TokenizeRequest

#: OpenAI's rule for function names.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The arguments of a function declared without ``parameters``: an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    """One function the model may call.

    Attributes:
        name: the function's name.
        parameters: the JSON schema its arguments follow (``NO_PARAMETERS`` when it declares none).
        spec: the tool as chat templates and prompts show it (OpenAI's ``{"type": "function", ...}``).
    """

    name: str
    parameters: dict[str, Any]
    spec: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """How a reply may use the request's tools.

    Attributes:
        mode: ``tool_choice`` resolved: ``none``, ``auto``, ``required`` or ``named``.
        tools: every tool of the request, in its order.
        callable: the tools a call may name: all of them, or the named one.
        parallel: whether a reply may hold more than one call.
        answer_schema: with ``auto``, the JSON schema a text answer follows (from ``response_format``);
            None = free text.
    """

    mode: Mode
    tools: tuple[Tool, ...]
    callable: tuple[Tool, ...]
    parallel: bool
    answer_schema: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        """Every mode but ``none``: the prompt shows the tools, a grammar holds the reply to the call
        format and the reply is parsed for calls."""
        return self.mode != "none"


async def plan_tools(request: ChatCompletionRequest | TokenizeRequest, structured: StructuredOutputsParams | None,
                     structured_param: str | None, grammars: GrammarCompiler | None) -> ToolPlan | None:
    """The request's ``ToolPlan``; None without ``tools``.

    Args:
        request: the chat request (or a ``/tokenize`` of its messages).
        structured: its structured-output constraint (``request.structured_output()``), if any.
        structured_param: the field that set it, for errors.
        grammars: checks the tools' parameters (and the answer schema) as the tool grammar will hold them;
            None where the engine has no grammar engine (a library setup): then ``tools`` are refused.

    Raises:
        OpenAIError: 400 naming the field: ``tool_choice`` without ``tools``, an empty ``tools``, a bad
            or repeated function name, parameters that are not a JSON schema of an object (or one the
            grammar engine cannot enforce, nested too deep, asking for its own JSON whitespace), schemas over
            the grammar limits together (``tools``), a named tool that is not in ``tools``, or a
            structured-output constraint that cannot go with ``tool_choice``, or no grammar engine.
    """
    if request.tools is None:
        if request.tool_choice is not None:
            raise bad_request("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return None
    if not request.tools:
        raise bad_request("'tools' must hold at least one tool; leave it out for none", "tools")
    if grammars is None:  # tool calls are held to their grammar
        raise bad_request("tool calling is not available in this engine (it has no grammar engine)", "tools")
    tools = tuple(_tool(tool, index) for index, tool in enumerate(request.tools))
    names = [tool.name for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise bad_request(f"tool names must be unique; '{name}' is given twice", f"tools.{index}.function.name")
    choice = request.tool_choice or "auto"
    callable_ = tools
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function '{choice.function.name}', which is not in "
                              f"'tools' ({', '.join(names)})", "tool_choice")
        callable_ = (tools[names.index(choice.function.name)],)
    mode: Mode = "named" if isinstance(choice, NamedToolChoice) else choice
    answer_schema = None
    if structured is not None and mode != "none":
        if mode != "auto" or structured.kind not in ("json", "json_object"):
            what = "tool_choice 'auto'" if mode == "auto" else "a tool_choice that asks for a call"
            raise bad_request(f"'{structured_param}' cannot be combined with {what}; only a JSON schema or "
                              "json_object response_format can hold the text answer of tool_choice 'auto'",
                              structured_param)
        answer_schema = {"type": "object"} if structured.json_object else structured.json
    plan = ToolPlan(mode, tools, callable_, request.parallel_tool_calls and mode != "named", answer_schema)
    await _check_schemas(plan, structured_param, grammars)
    return plan


async def _check_schemas(plan: ToolPlan, structured_param: str | None, grammars: GrammarCompiler) -> None:
    """Refuse a schema the tool grammar cannot hold, naming its own field: inside the tool grammar, its error
    would be blamed on all the tools."""
    checked = [(tool.parameters, f"tools.{index}.function.parameters", f"Invalid schema for function '{tool.name}'")
               for index, tool in enumerate(plan.tools)]
    if plan.answer_schema is not None:
        checked.append((plan.answer_schema, str(structured_param), "invalid JSON schema for structured output"))
    try:
        errors = await grammars.json_schema_errors_async([schema for schema, _, _ in checked])
    except InvalidRequestError as exc:  # over a limit together
        raise bad_request(exc.message, "tools") from exc
    for (_, param, what), error in zip(checked, errors, strict=True):
        if error:
            raise bad_request(f"{what}: {error}", param)


def _tool(tool: ChatCompletionTool, index: int) -> Tool:
    function = tool.function
    if not TOOL_NAME.fullmatch(function.name):
        raise bad_request(f"Invalid function name '{function.name}': it must be 1 to 64 letters, digits, "
                          "underscores or dashes", f"tools.{index}.function.name")
    parameters = NO_PARAMETERS if function.parameters is None else function.parameters
    param = f"tools.{index}.function.parameters"
    if parameters.get("type", "object") != "object":
        raise bad_request(f"Invalid schema for function '{function.name}': the parameters must be a JSON "
                          f"schema of type 'object', got type {json.dumps(parameters['type'])}", param)
    return Tool(function.name, parameters, tool.model_dump(exclude_none=True))
