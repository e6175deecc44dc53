"""Tool calling on /v1/chat/completions: each ``tool_choice`` through the OpenAI SDK against the real
server, streamed calls equal to whole ones, a full round trip, bad tool specs refused; and the Hermes
parser, grammar and prompt fallback on hand-written model outputs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.sampling_params import StructuredOutputsParams
from pagedserve.server.app import ServerArgs
from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import ChatCompletionRequest, conversation
from pagedserve.server.tool_calling import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolParser,
    parse_reply,
    plan_tools,
    tool_parser_class,
)
from pagedserve.server.tool_calling.output import StreamedReply
from pagedserve.server.tool_calling.prompt import render_inputs
from tests.conftest import Served

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                   "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"],
    "additionalProperties": False,
    "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                            "parameters": WEATHER_PARAMETERS, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Get the current time"}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 40}
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": {"type": "object", "properties": {},
                                                              "additionalProperties": False}}


def assert_valid_calls(calls: list[Any]) -> None:
    """Each call has an OpenAI id and type, names a tool, and its arguments validate against its parameters."""
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


# --------------------------------------------------------------------------- the server, through the SDK


def test_required_makes_one_valid_call_and_the_stream_adds_up_to_it(openai_client: openai.OpenAI) -> None:
    request = {**GREEDY, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    whole = openai_client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls)

    with openai_client.chat.completions.stream(**request) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion()
    first, *rest = [call for chunk in chunks for c in chunk.choices for call in c.delta.tool_calls or ()]
    assert (first.index, first.type, first.function.name) == (0, "function", choice.message.tool_calls[0].function.name)
    assert first.id.startswith("call_") and all(call.id is None and call.function.name is None for call in rest)
    assert not any(c.delta.content for chunk in chunks for c in chunk.choices)
    call = streamed.choices[0].message.tool_calls[0]
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == (choice.message.tool_calls[0].function.name,
                                                             choice.message.tool_calls[0].function.arguments)
    if call.function.name == "get_weather":  # a strict tool: the SDK parses its arguments
        assert call.function.parsed_arguments == json.loads(call.function.arguments)


def test_named_tool_choice_calls_exactly_that_tool(openai_client: openai.OpenAI) -> None:
    reply = openai_client.chat.completions.create(
        **GREEDY, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["get_time"] and calls[0].function.arguments == "{}"
    assert reply.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_allow_several_calls_and_one_without(openai_client: openai.OpenAI) -> None:
    request = {**GREEDY, "max_tokens": 44, "tools": [CLOCK], "tool_choice": "required",
               "messages": [{"role": "user", "content": "What time is it in Paris and in London?"}]}
    several = openai_client.chat.completions.create(**request, parallel_tool_calls=True).choices[0]
    assert len(several.message.tool_calls) >= 2 and len({call.id for call in several.message.tool_calls}) >= 2
    assert_valid_calls(several.message.tool_calls)
    one = openai_client.chat.completions.create(**request, parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    assert_valid_calls(one.message.tool_calls)


def test_auto_answers_in_text_or_calls_and_no_markup_reaches_content(openai_client: openai.OpenAI) -> None:
    for stream in (False, True):
        reply = openai_client.chat.completions.create(**{**GREEDY, "max_tokens": 16}, messages=ASK, tools=TOOLS,
                                                      stream=stream)
        if stream:
            content = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
        else:
            content = reply.choices[0].message.content or ""
            assert_valid_calls(reply.choices[0].message.tool_calls or [])
        assert "<tool_call>" not in content and "</tool_call>" not in content


def test_none_answers_in_plain_text_to_a_prompt_without_the_tools(openai_client: openai.OpenAI,
                                                                   served: Served) -> None:
    reply = openai_client.chat.completions.create(**{**GREEDY, "max_tokens": 8}, messages=ASK, tools=TOOLS,
                                                  tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(served.engine.processor.render_chat(ASK))


def test_full_round_trip_ends_in_an_answer(openai_client: openai.OpenAI, client: httpx.Client,
                                           served: Served) -> None:
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 22, "sky": "sunny"}'}]
    reply = openai_client.chat.completions.create(**{**GREEDY, "max_tokens": 16}, messages=messages, tools=TOOLS)
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls
    # SmolLM2's template takes no tools: the prompt is the Hermes fallback, the call and its result as text.
    fallback = HermesToolParser.render_fallback(conversation(ChatCompletionRequest(messages=messages).messages), TOOLS)
    assert "<tool_response>" in fallback[-1]["content"]
    assert reply.usage.prompt_tokens == len(served.engine.processor.render_chat(fallback))
    raw = client.post("/v1/chat/completions", json={**GREEDY, "max_tokens": 1, "messages": ASK}).json()
    assert "tool_calls" not in raw["choices"][0]["message"]  # left out when there are none, as OpenAI does


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [CLOCK, CLOCK]}, "tools.1.function.name"),
    ({"tools": [CLOCK, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "wat"}}}}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "guided_regex": "[a-z]+"}, "guided_regex"),
    ({"tools": TOOLS, "messages": [{"role": "tool", "content": "22"}]}, "messages.0"),
])
def test_bad_tool_specs_are_a_400_naming_the_field(client: httpx.Client, body: dict[str, Any], param: str) -> None:
    response = client.post("/v1/chat/completions", json={**GREEDY, "messages": ASK, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert client.get("/health").status_code == 200


def test_tokenize_renders_tools_as_chat_does(client: httpx.Client) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    chat = client.post("/v1/chat/completions", json={**GREEDY, **body, "max_tokens": 1}).json()
    tokenized = client.post("/tokenize", json=body).json()
    without_tools = client.post("/tokenize", json={"messages": ASK}).json()
    assert tokenized["count"] == chat["usage"]["prompt_tokens"] > without_tools["count"]
    refused = client.post("/tokenize", json={"messages": ASK, "tool_choice": "auto"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"


def grammar_accepts(served: Served, text: str, **request: Any) -> bool:
    """Whether the tool grammar of a request with ``TOOLS`` and ``request``'s fields takes all of ``text``."""
    chat = ChatCompletionRequest(messages=ASK, tools=TOOLS, **request)
    plan = asyncio.run(plan_tools(chat, *chat.structured_output(), served.engine.processor.grammars))
    grammar = HermesToolParser.grammar(plan)
    matcher = served.engine.processor.grammars.compile(StructuredOutputsParams(grammar=grammar)).result().deep_copy()
    tokens = served.engine.tokenizer.encode(text)
    return all(matcher.consume_token(token) for token in tokens) and matcher.is_accepting()


CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_auto_grammar_lets_text_through_and_holds_a_started_call_to_the_schema(served: Served) -> None:
    assert grammar_accepts(served, "It is sunny.") and grammar_accepts(served, "Let me check.\n" + CALL_PARIS)
    assert grammar_accepts(served, CALL_PARIS + "\n" + CALL_TIME)
    assert not grammar_accepts(served, CALL_PARIS.replace("Paris", "Berlin"))
    assert not grammar_accepts(served, CALL_PARIS.replace("get_weather", "launch"))
    assert not grammar_accepts(served, CALL_PARIS + " and more text")
    assert not grammar_accepts(served, CALL_PARIS + "\n" + CALL_TIME, parallel_tool_calls=False)


def test_auto_with_a_json_response_format_answers_in_json_or_calls(served: Served) -> None:
    json_object = {"response_format": {"type": "json_object"}}
    assert grammar_accepts(served, '{"answer": "sunny"}', **json_object) and grammar_accepts(served, CALL_TIME,
                                                                                           **json_object)
    assert not grammar_accepts(served, "It is sunny.", **json_object)


# --------------------------------------------------------------------------- the Hermes parser and prompt

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } in \\"text\\""}}\n</tool_call>'
OUTPUTS = {
    "plain text": ("Hello <b>there</b> < tool", "Hello <b>there</b> < tool", []),
    "text then a call": ("Let me check.\n" + CALL, "Let me check.",
                         [("get_weather", '{"city": "Paris", "note": "a } in \\"text\\""}')]),
    "two calls": (CALL + "\n" + CALL.replace("Paris", "Tokyo"), "",
                  [("get_weather", '{"city": "Paris", "note": "a } in \\"text\\""}'),
                   ("get_weather", '{"city": "Tokyo", "note": "a } in \\"text\\""}')]),
    "empty arguments": ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "",
                        [("get_time", "{}")]),
    "keys in another order": ('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', "",
                              [("f", '{"x": 1}')]),
    "cut short in the arguments": ('<tool_call>\n{"name": "f", "arguments": {"x": [1, ', "", [("f", '{"x": [1, ')]),
    "cut short before the name": ('Hi <tool_call>\n{"na', "Hi", []),
    "a marker cut short": ("Hi <tool_ca", "Hi <tool_ca", []),
    "not JSON": ("<tool_call>\nnonsense\n</tool_call> ok", "ok", []),
}


LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "note": "a } in \\"text\\""}}'
LLAMA3_OUTPUTS = {
    "plain text": ("It is sunny { maybe }", "It is sunny { maybe }", []),
    "a call": (LLAMA3_CALL, "", [("get_weather", '{"city": "Paris", "note": "a } in \\"text\\""}')]),
    "after the python tag, two calls": ("<|python_tag|>" + LLAMA3_CALL + "; " + LLAMA3_CALL.replace("Paris", "Tokyo"),
                                        "", [("get_weather", '{"city": "Paris", "note": "a } in \\"text\\""}'),
                                             ("get_weather", '{"city": "Tokyo", "note": "a } in \\"text\\""}')]),
    "arguments for parameters": (' {"name": "get_time", "arguments": {}}', "", [("get_time", "{}")]),
    "keys in another order": ('{"parameters": {"x": 1}, "name": "f"}', "", [("f", '{"x": 1}')]),
    "cut short in the parameters": ('{"name": "f", "parameters": {"x": [1, ', "", [("f", '{"x": [1, ')]),
    "not JSON": ("{nonsense", "{nonsense", []),
    "JSON that is no call": ('{"city": "Paris", "temp": 20}', '{"city": "Paris", "temp": 20}', []),
    "the python tag before code": ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
}
#: Each parser with its replies: (text, content, calls).
PARSER_OUTPUTS = {HermesToolParser: OUTPUTS, Llama3JsonToolParser: LLAMA3_OUTPUTS}
CASES = [(parser, name) for parser, outputs in PARSER_OUTPUTS.items() for name in outputs]


@pytest.mark.parametrize(("parser", "name"), CASES, ids=[f"{p.name}-{n}" for p, n in CASES])
def test_parsers_split_content_and_calls(parser: type[ToolParser], name: str) -> None:
    text, content, calls = PARSER_OUTPUTS[parser][name]
    reply = parse_reply(parser(), text)
    assert (reply.content, reply.calls) == (content, calls)


@settings(max_examples=150, deadline=None, database=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_pieces_add_up_to_the_whole_reply_at_any_chunk_boundaries(case: tuple, cuts: list[int]) -> None:
    parser, name = case
    text = PARSER_OUTPUTS[parser][name][0]
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut < len(text))})
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]
    reply = StreamedReply(parser())
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta_content, delta_calls = reply.delta(piece, finished=i == len(pieces) - 1)
        content += delta_content or ""
        for call in delta_calls or ():
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments
    assert "<tool_call" not in content or name == "a marker cut short"
    whole = parse_reply(parser(), text)
    assert (content, [tuple(call) for call in calls.values()]) == (whole.content, whole.calls)


def test_hermes_fallback_renders_tools_calls_and_results_as_text() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
                {"role": "tool", "content": "22 C", "tool_call_id": "a"},
                {"role": "tool", "content": "noon", "tool_call_id": "b"}]
    rendered = HermesToolParser.render_fallback(messages, TOOLS)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in rendered[0]["content"]
    assert rendered[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert rendered[3]["content"] == "<tool_response>\n22 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    assert HermesToolParser.render_fallback(messages[1:2], None) == [{"role": "user", "content": "Weather?"}]


def test_llama3_json_fallback_renders_tools_calls_and_results_as_text() -> None:
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
                {"role": "tool", "content": "22 C", "tool_call_id": "a"}]
    rendered = Llama3JsonToolParser.render_fallback(messages, TOOLS)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert '"parameters": dictionary of argument name' in rendered[0]["content"]
    assert rendered[2]["content"] == ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                      '{"name": "get_time", "parameters": {}}')
    assert rendered[3]["content"] == "Tool result: 22 C"


def test_llama3_json_calls_are_served_through_the_sdk(serve_app) -> None:
    """``--tool-call-parser llama3_json`` on the embedded model (whose template has no tools: the fallback
    prompt): required and parallel calls held to the tools' parameters, the stream adding up to the whole."""
    served = serve_app(ServerArgs(tool_call_parser="llama3_json"))
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    request = {**GREEDY, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    assert_valid_calls(choice.message.tool_calls)
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    named = client.chat.completions.create(**{**request, "tool_choice": {"type": "function",
                                                                          "function": {"name": "get_time"}}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]


def test_the_tool_parser_is_chosen_by_name_or_from_the_chat_template() -> None:
    parser: type[ToolParser] = tool_parser_class("auto", "{{ '<tool_call>' }}")
    assert parser is HermesToolParser and tool_parser_class("auto", None) is HermesToolParser
    assert tool_parser_class("hermes", "") is HermesToolParser
    llama3 = '{"name": function name, "parameters": dictionary of argument name and its value}'
    assert tool_parser_class("auto", llama3) is Llama3JsonToolParser
    assert tool_parser_class("llama3_json", "") is Llama3JsonToolParser
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_parser_class("mistral", "")


def test_a_template_that_shows_tools_in_another_format_gets_the_parsed_format_s_prompt(served: Served) -> None:
    """A template that renders ``tools`` but writes calls in a format no parser reads (here a made-up
    one) must not describe that format while the reply is held to and parsed as hermes."""
    class Tokenizer:
        chat_template = "{% for tool in tools %}<function>{{ tool }}</function>{% endfor %}"

    request = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required")
    plan = asyncio.run(plan_tools(request, None, None, served.engine.processor.grammars))
    messages, tools = render_inputs(request.messages, plan, HermesToolParser, Tokenizer())
    assert tools is None and "<tool_call>" in messages[0]["content"]
    Tokenizer.chat_template += "{{ '<tool_call>' }}"  # a hermes template shows its tools itself
    messages, tools = render_inputs(request.messages, plan, HermesToolParser, Tokenizer())
    assert tools is not None and messages == conversation(request.messages)


def test_tools_without_a_grammar_engine_are_a_400_naming_tools() -> None:
    """An engine built without a grammar compiler (a library setup) cannot hold tool calls to their grammar:
    a 400 naming ``tools``, not a 500 from the missing compiler."""
    request = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(plan_tools(request, None, None, None))
    assert refused.value.status_code == 400 and refused.value.param == "tools"
    assert asyncio.run(plan_tools(ChatCompletionRequest(messages=ASK), None, None, None)) is None


def test_a_bad_answer_schema_with_tools_is_blamed_on_response_format(client: httpx.Client) -> None:
    body = {**GREEDY, "messages": ASK, "tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "array", "uniqueItems": True}}}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in response.json()["error"]["message"]
