"""``/v1/messages`` (Anthropic's Messages API) against the real server, through the ``anthropic`` SDK: answers as
chat gives them for the same conversation (greedy), the event stream, tool use and a tool round trip, prefill,
stop sequences, token counts, ``x-api-key``, and refusals in Anthropic's error shape that name the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from pagedserve.server.app import ServerArgs
from pagedserve.server.errors import OpenAIError
from pagedserve.server.messages import MessageStream
from pagedserve.server.messages_protocol import Message, Usage
from pagedserve.server.protocol import ChatCompletionChunk
from tests.conftest import Served, sse_payloads

MODEL = "SmolLM2-135M-Instruct"
#: Greedy, to compare with chat: the SDK (2.x) no longer has sampling arguments, the API still takes them.
GREEDY = {"temperature": 0}
QUESTION = "What is the capital of France?"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)


def _chat(openai_client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **fields: Any) -> Any:
    return openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, **fields).choices[0]


def test_a_message_answers_as_chat_does_with_usage(claude: anthropic.Anthropic, openai_client: openai.OpenAI,
                                                   client: httpx.Client) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system="You are terse.",
                                     messages=[{"role": "user", "content": QUESTION}])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and [block.type for block in message.content] == ["text"]
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTION}]
    reply = _chat(openai_client, chat, 12)
    assert message.content[0].text == reply.message.content
    assert message.stop_reason == ("max_tokens" if reply.finish_reason == "length" else "end_turn")
    prompt = client.post("/tokenize", json={"messages": chat}).json()["count"]
    assert message.usage.input_tokens == prompt and 0 < message.usage.output_tokens <= 12


def test_system_blocks_and_text_blocks_are_joined_as_chat_joins_parts(claude: anthropic.Anthropic) -> None:
    as_strings = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system="Be brief.\nBe kind.",
                                        messages=[{"role": "user", "content": "Hello\nthere"}])
    as_blocks = claude.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control":
                                                        {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}])
    assert as_blocks.content == as_strings.content and as_blocks.usage == as_strings.usage


def test_a_stop_sequence_is_named_and_chat_reports_it_as_stop_reason(claude: anthropic.Anthropic,
                                                                     openai_client: openai.OpenAI) -> None:
    free = claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": QUESTION}])
    word = free.content[0].text.split()[1]  # a word the answer holds, after its first
    message = claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, stop_sequences=["zzz", word],
                                     messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == free.content[0].text[:free.content[0].text.index(word)]
    # vLLM's stop_reason on chat's choices: the stop string that ended the choice.
    reply = _chat(openai_client, [{"role": "user", "content": QUESTION}], 16, stop=["zzz", word])
    assert reply.finish_reason == "stop" and reply.model_extra["stop_reason"] == word


def test_a_last_assistant_message_is_continued(claude: anthropic.Anthropic, openai_client: openai.OpenAI) -> None:
    prefill = "The capital of France is"
    message = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": prefill}])
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": prefill}]
    reply = _chat(openai_client, chat, 6, extra_body={"continue_final_message": True,
                                                      "add_generation_prompt": False})
    assert message.content[0].text == reply.message.content
    new_turn = _chat(openai_client, chat, 6)  # a new assistant turn after the prefill answers otherwise
    assert reply.message.content != new_turn.message.content


def test_continue_final_message_with_a_generation_prompt_is_refused(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(openai_client, [{"role": "user", "content": "Hi"}], 4, extra_body={"continue_final_message": True})
    assert refused.value.body["param"] == "continue_final_message"


def test_the_stream_is_anthropics_event_sequence_and_adds_up_to_the_message(claude: anthropic.Anthropic,
                                                                            client: httpx.Client) -> None:
    request = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": QUESTION}]}
    whole = claude.messages.create(**request, extra_body=GREEDY)
    with claude.messages.stream(**request, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text and len(pieces) > 1
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens

    with client.stream("POST", "/v1/messages", json={**request, **GREEDY, "stream": True}) as response:
        lines = list(response.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = sse_payloads(lines)
    assert [event["type"] for event in events] == names  # each event's name is its type
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {event["delta"]["type"] for event in events[2:-3]} == {"text_delta"}
    assert events[-2]["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}


def test_tool_use_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    request = {"model": MODEL, "max_tokens": 60, "extra_body": GREEDY, "tools": [WEATHER],
               "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
               "messages": [{"role": "user", "content": "What's the weather in Paris?"}]}
    message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use" and [block.type for block in message.content] == ["tool_use"]
    call = message.content[0]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])

    with claude.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].input == call.input and final.content[0].name == call.name
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert deltas and {delta.type for delta in deltas} == {"input_json_delta"}
    assert json.loads("".join(delta.partial_json for delta in deltas)) == call.input


def test_a_named_tool_without_parallel_calls(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER, {**WEATHER, "name": "get_time"}],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    assert [(block.type, block.name) for block in message.content] == [("tool_use", "get_time")]


def test_a_tool_round_trip_renders_as_chat_with_tool_messages(claude: anthropic.Anthropic, client: httpx.Client,
                                                              openai_client: openai.OpenAI) -> None:
    question = {"role": "user", "content": "What's the weather in Paris?"}
    first = claude.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[question])
    call = first.content[0]
    conversation = [question, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                                                 {"type": "text", "text": "Answer in one sentence."}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=conversation)
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    chat = [question,
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
            {"role": "user", "content": "Answer in one sentence."}]
    chat_tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}]
    reply = _chat(openai_client, chat, 16, tools=chat_tools, tool_choice="none")
    assert answer.content[0].text == reply.message.content
    counted = claude.messages.count_tokens(model=MODEL, tools=[WEATHER], tool_choice={"type": "none"},
                                           messages=conversation)
    assert counted.input_tokens == answer.usage.input_tokens == client.post(
        "/tokenize", json={"messages": chat, "tools": chat_tools, "tool_choice": "none"}).json()["count"]


def test_count_tokens_equals_the_messages_input_tokens(claude: anthropic.Anthropic) -> None:
    request = {"model": MODEL, "system": "You are terse.", "tools": [WEATHER],
               "messages": [{"role": "user", "content": "What's the weather in Oslo?"}]}
    counted = claude.messages.count_tokens(**request)
    message = claude.messages.create(max_tokens=40, extra_body=GREEDY, **request)
    assert counted.input_tokens == message.usage.input_tokens > 0


def test_output_config_format_holds_the_answer_to_the_schema(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    message = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages.0.content.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": QUESTION},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                      "input": {}}]}], "tools": [WEATHER]}, "messages.1.content"),
    ({"messages": []}, "messages"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"stop_sequences": "stop"}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "object", "properties": 3}}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
])
def test_bad_input_is_refused_in_anthropics_shape_naming_the_field(client: httpx.Client, body: dict[str, Any],
                                                                   param: str) -> None:
    request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]} | body
    response = client.post("/v1/messages", json={k: v for k, v in request.items() if v is not None})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"'{param}'" in error["error"]["message"] or error["error"]["message"].startswith(param), error


def test_an_unknown_model_and_route_errors_take_anthropics_shape(claude: anthropic.Anthropic,
                                                                  client: httpx.Client) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in missing.value.body["error"]["message"]
    invalid_json = client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert invalid_json.status_code == 400 and invalid_json.json()["error"]["type"] == "invalid_request_error"
    wrong_method = client.get("/v1/messages")
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    assert client.post("/v1/chat/completions", json={}).json()["error"]["param"] == "messages"  # OpenAI's elsewhere


def test_the_api_key_is_taken_from_x_api_key_or_the_bearer_token(serve_app: Any) -> None:
    locked = serve_app(ServerArgs(api_key="sekret"))
    hello = {"role": "user", "content": "Hi"}
    assert anthropic.Anthropic(base_url=locked.url, api_key="sekret", max_retries=0).messages.create(
        model=MODEL, max_tokens=2, messages=[hello]).usage.output_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=locked.url, api_key="guess", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[hello])
    assert refused.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{locked.url}/v1/chat/completions", headers={"Authorization": "Bearer sekret"},
                        json={"messages": [hello], "max_tokens": 2}, timeout=60)
    assert bearer.status_code == 200
    by_x_api_key = httpx.get(f"{locked.url}/v1/models", headers={"x-api-key": "sekret"}, timeout=60)
    assert by_x_api_key.status_code == 200
    twice = httpx.get(f"{locked.url}/v1/models", headers=[("x-api-key", "sekret"), ("x-api-key", "sekret")])
    assert twice.status_code == 400 and twice.json()["error"]["code"] == "duplicate_authorization"


# --------------------------------------------------------------------------- the stream, from chat's chunks


def _chunks(*deltas: dict[str, Any], error: OpenAIError | None = None) -> AsyncGenerator[ChatCompletionChunk, None]:
    async def chunks() -> AsyncGenerator[ChatCompletionChunk, None]:
        for tokens, delta in enumerate(deltas):
            yield ChatCompletionChunk.model_validate({
                "id": "c", "created": 0, "model": MODEL, "usage": {"prompt_tokens": 7, "completion_tokens": tokens,
                                                                   "total_tokens": 7 + tokens},
                "choices": [{"index": 0, "delta": delta, "finish_reason": delta.pop("finish_reason", None)}]})
        if error is not None:
            raise error
    return chunks()


def _events(chunks: AsyncGenerator[ChatCompletionChunk, None]) -> list[dict[str, Any]]:
    message = Message(id="msg_1", model=MODEL, content=[], usage=Usage(input_tokens=0, output_tokens=0))

    async def events() -> list[dict[str, Any]]:
        return [json.loads(event.data) async for event in MessageStream(message, None).events(chunks)]

    return asyncio.run(events())


def test_thinking_then_text_then_calls_are_blocks_in_order() -> None:
    events = _events(_chunks(
        {"role": "assistant", "content": ""}, {"reasoning_content": "Paris is"}, {"reasoning_content": " sunny."},
        {"content": "Checking."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1}"}}], "finish_reason": "tool_calls"}))
    assert events[0]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    starts = [(event["index"], event["content_block"]) for event in events if event["type"] == "content_block_start"]
    assert starts == [(0, {"type": "thinking", "thinking": "", "signature": ""}), (1, {"type": "text", "text": ""}),
                      (2, {"type": "tool_use", "id": "call_1", "name": "f", "input": {}})]
    deltas = [(event["index"], event["delta"]) for event in events if event["type"] == "content_block_delta"]
    assert deltas == [(0, {"type": "thinking_delta", "thinking": "Paris is"}),
                      (0, {"type": "thinking_delta", "thinking": " sunny."}),
                      (1, {"type": "text_delta", "text": "Checking."}),
                      (2, {"type": "input_json_delta", "partial_json": "{\"a\": 1}"})]
    assert [event["index"] for event in events if event["type"] == "content_block_stop"] == [0, 1, 2]
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                          "usage": {"output_tokens": 5}}
    assert events[-1] == {"type": "message_stop"}


def test_an_error_after_the_start_ends_the_stream_with_an_error_event() -> None:
    events = _events(_chunks({"role": "assistant", "content": ""}, {"content": "Hi"},
                                   error=OpenAIError(503, "The engine is not running.", code="engine_dead")))
    assert [event["type"] for event in events] == ["message_start", "content_block_start", "content_block_delta",
                                                   "error"]
    assert events[-1]["error"] == {"type": "api_error", "message": "The engine is not running."}


def test_an_abort_at_shutdown_is_an_error_event_not_a_stop() -> None:
    events = _events(_chunks({"role": "assistant", "content": ""}, {"content": "Hi"}))  # no finish reason
    assert events[-1]["type"] == "error" and "shutting down" in events[-1]["error"]["message"]
