"""``/v1/responses`` (OpenAI's Responses API) against the real server, through the OpenAI SDK: answers
as chat gives them for the same conversation, structured output, the typed stream, continuation by
``previous_response_id`` with its bounded store, and refusals that name the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import ChatCompletionChunk, ChatMessage
from pagedserve.server.responses import ResponseStore, ResponseStream, new_response
from pagedserve.server.responses_protocol import Response, ResponsesRequest
from tests.conftest import Served

TEMPERATURE = 0  # greedy: the same conversation gives the same text on chat and on responses
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "population": {"type": "integer", "minimum": 0}},
               "required": ["city", "population"], "additionalProperties": False}


def _chat_text(openai_client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> str:
    reply = openai_client.chat.completions.create(model="", messages=messages, max_tokens=max_tokens,
                                                  temperature=TEMPERATURE)
    return reply.choices[0].message.content or ""


def test_string_input_answers_with_one_message_and_usage(openai_client: openai.OpenAI) -> None:
    response = openai_client.responses.create(model="", input="What is 2 + 2?", max_output_tokens=8,
                                              temperature=TEMPERATURE)
    assert response.id.startswith("resp_") and response.object == "response"
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].content[0].type == "output_text" and response.output_text
    assert response.output_text == _chat_text(openai_client, [{"role": "user", "content": "What is 2 + 2?"}], 8)
    usage = response.usage
    assert usage.output_tokens <= 8 and usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_items_and_instructions_answer_as_the_same_chat_does(openai_client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": "My name is Ada."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}]
    response = openai_client.responses.create(model="", input=items, instructions="You are terse.",
                                              max_output_tokens=8, temperature=TEMPERATURE)
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Hello Ada!"}, {"role": "user", "content": "What is my name?"}]
    assert response.output_text == _chat_text(openai_client, chat, 8)
    assert response.instructions == "You are terse."


def test_max_output_tokens_cut_is_incomplete(openai_client: openai.OpenAI) -> None:
    response = openai_client.responses.create(model="", input="Write a long story about a dragon.",
                                              max_output_tokens=3, temperature=TEMPERATURE)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3


def test_json_schema_text_format_is_followed(openai_client: openai.OpenAI) -> None:
    response = openai_client.responses.create(
        model="", input="Name a large city and its population as JSON.", max_output_tokens=40,
        temperature=TEMPERATURE,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}})
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), CITY_SCHEMA)
    assert response.text.format.type == "json_schema"


class Answer(BaseModel):
    answer: bool


def test_sdk_parse_and_stream_helpers_read_the_stream(openai_client: openai.OpenAI) -> None:
    parsed = openai_client.responses.parse(model="SmolLM2-135M-Instruct", input="Is the sky blue?",
                                           text_format=Answer, max_output_tokens=12, temperature=TEMPERATURE)
    assert isinstance(parsed.output_parsed, Answer)
    with openai_client.responses.stream(model="SmolLM2-135M-Instruct", input="Is the sky blue?",
                                        text_format=Answer, max_output_tokens=12,
                                        temperature=TEMPERATURE) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == parsed.output_text
    assert final.output_parsed == parsed.output_parsed


def test_stream_events_come_in_order_and_join_to_the_text(openai_client: openai.OpenAI) -> None:
    events = list(openai_client.responses.create(model="", input="What is 2 + 2?", max_output_tokens=6,
                                                 temperature=TEMPERATURE, stream=True))
    types = [event.type for event in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    item = final.output[0]
    assert {event.item_id for event in events if hasattr(event, "item_id")} == {item.id}
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == item.content[0].text
    assert text == openai_client.responses.create(model="", input="What is 2 + 2?", max_output_tokens=6,
                                                  temperature=TEMPERATURE).output_text
    assert final.usage.output_tokens == 6 and final.id == events[0].response.id


def test_stream_is_named_server_sent_events_without_done(client: httpx.Client) -> None:
    body = {"input": "Hi", "max_output_tokens": 2, "temperature": TEMPERATURE, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [event["type"] for event in data] and names[-1] == "response.incomplete"


def test_previous_response_id_continues_the_conversation(openai_client: openai.OpenAI,
                                                         client: httpx.Client) -> None:
    first = openai_client.responses.create(model="", input="My name is Ada.", instructions="Be brief.",
                                           max_output_tokens=6, temperature=TEMPERATURE)
    second = openai_client.responses.create(model="", input="What is my name?", previous_response_id=first.id,
                                            max_output_tokens=6, temperature=TEMPERATURE)
    # The earlier turns come back; the earlier instructions do not (as in OpenAI's API).
    chat = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}]
    assert second.output_text == _chat_text(openai_client, chat, 6)
    assert second.previous_response_id == first.id
    assert client.get(f"/v1/responses/{second.id}").json()["output"][0]["content"][0]["text"] == second.output_text
    assert client.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response",
                                                                 "deleted": True}
    assert client.get(f"/v1/responses/{first.id}").status_code == 404
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.responses.create(model="", input="Hi", previous_response_id=first.id, max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "previous_response_not_found"


def test_store_false_keeps_nothing(openai_client: openai.OpenAI, client: httpx.Client) -> None:
    response = openai_client.responses.create(model="", input="Hi", store=False, max_output_tokens=2,
                                              temperature=TEMPERATURE)
    assert response.store is False and client.get(f"/v1/responses/{response.id}").status_code == 404


def _chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None,
           **fields: Any) -> ChatCompletionChunk:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    return ChatCompletionChunk.model_validate({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                                               "model": "m", "choices": choices, **fields})


def _translated(chunks: list[ChatCompletionChunk | OpenAIError]) -> tuple[list[dict[str, Any]], list[Response]]:
    """The events ``ResponseStream`` makes of chat's chunks (an error among them is raised there),
    and the responses it finished."""
    finished: list[Response] = []

    async def events() -> list[dict[str, Any]]:
        async def payloads() -> AsyncGenerator[ChatCompletionChunk, None]:
            for chunk in chunks:
                if isinstance(chunk, OpenAIError):
                    raise chunk
                yield chunk

        stream = ResponseStream(new_response(ResponsesRequest(input="Hi"), "m"))
        return [json.loads(event.data) async for event in stream.events(payloads(), finished.append)]

    return asyncio.run(events()), finished


def test_stream_closes_the_message_when_a_call_starts() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    events, finished = _translated([
        _chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let me look."}),
        _chunk({"tool_calls": [call]}), _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, "tool_calls"),
        _chunk(usage={"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12})])
    assert [(event["type"], event.get("output_index")) for event in events] == [
        ("response.created", None), ("response.in_progress", None), ("response.output_item.added", 0),
        ("response.content_part.added", 0), ("response.output_text.delta", 0), ("response.output_text.done", 0),
        ("response.content_part.done", 0), ("response.output_item.done", 0), ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1), ("response.completed", None)]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1] | {"id": None} == {"id": None, "type": "function_call", "status": "completed",
                                                 "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
    assert final["usage"]["total_tokens"] == 12 and [response.id for response in finished] == [final["id"]]


def test_stream_error_after_the_start_is_a_failed_response() -> None:
    error = OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "The engine is not running.", code="engine_dead")
    events, finished = _translated([_chunk({"content": "Hel"}), error])
    assert [event["type"] for event in events][-2:] == ["response.output_text.delta", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "The engine is not running."}
    assert finished == []  # nothing to store


def _stored(store: ResponseStore, response_id: str) -> None:
    store.put(Response.model_construct(id=response_id), [ChatMessage(role="user", content=response_id)])


def test_store_drops_the_oldest_beyond_its_size_and_each_after_its_ttl() -> None:
    now = [0.0]
    store = ResponseStore(max_size=2, ttl_s=10.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        _stored(store, name)
        now[0] += 4.0
    assert store.get("a") is None and len(store) == 2  # evicted by size
    assert store.get("b").messages[0].content == "b"
    now[0] = 14.0  # b was stored at 4 s: expired; c at 8 s: kept
    assert store.get("b") is None and store.get("c") is not None
    now[0] = 18.0
    assert store.get("c") is None and len(store) == 0


WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                      "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {key: value for key, value in WEATHER.items() if key != "type"}}
QUESTION = "What is the weather in Paris?"
#: One call, then the end (several calls may follow one another otherwise, up to max_output_tokens).
ONE_CALL = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 40,
            "temperature": TEMPERATURE}


def test_a_function_call_is_an_output_item_with_the_arguments_chat_gives(openai_client: openai.OpenAI) -> None:
    response = openai_client.responses.create(model="", input=QUESTION, **ONE_CALL)
    assert response.status == "completed" and [item.type for item in response.output] == ["function_call"]
    call = response.output[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    chat = openai_client.chat.completions.create(
        model="", messages=[{"role": "user", "content": QUESTION}], tools=[CHAT_WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=40, temperature=TEMPERATURE)
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments


def test_streamed_function_call_arguments_join_to_the_final_call(openai_client: openai.OpenAI) -> None:
    events = list(openai_client.responses.create(
        model="", input=QUESTION, stream=True, **{**ONE_CALL, "tool_choice": {"type": "function",
                                                                             "name": "get_weather"}}))
    types = [event.type for event in events]
    deltas = types.count("response.function_call_arguments.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas,
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    call = events[-1].response.output[0]
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert deltas >= 2 and arguments == events[-3].arguments == call.arguments
    assert events[2].item.call_id == call.call_id and events[2].item.name == call.name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


def test_function_call_output_round_trip_reads_as_the_chat_tool_messages(openai_client: openai.OpenAI) -> None:
    first = openai_client.responses.create(model="", input=QUESTION, **ONE_CALL)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"}
    settings = {"tools": [WEATHER], "max_output_tokens": 6, "temperature": TEMPERATURE}
    explicit = openai_client.responses.create(model="", input=[{"role": "user", "content": QUESTION},
                                                               call.model_dump(exclude_none=True), result],
                                              **settings)
    continued = openai_client.responses.create(model="", input=[result], previous_response_id=first.id,
                                               **settings)
    chat = openai_client.chat.completions.create(model="", messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C"}],
        tools=[CHAT_WEATHER], max_tokens=6, temperature=TEMPERATURE)
    assert explicit.output_text == continued.output_text == (chat.choices[0].message.content or "")
    assert explicit.usage.input_tokens == continued.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "input_file", "file_id": "f"}]}, "input.1.type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "input.0.output.0.type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "Hi", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "Hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": [{"role": "critic", "content": "Hi"}]}, "input.0.role"),
    ({"input": "Hello. " * 3000}, "input"),  # longer than the context
    # Chat's fields would change the output: refused by name, never ignored.
    ({"input": "Hi", "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"input": "Hi", "seed": 1}, "seed"),
    ({"input": "Hi", "n": 2}, "n"),
    ({"input": "Hi", "max_tokens": 5}, "max_tokens"),
    ({"input": "Hi", "tools": [{**WEATHER, "parameters": {"type": "nonsense"}}], "tool_choice": "required"},
     "tools.0.parameters"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_unsupported_or_invalid_input_is_a_400_naming_the_field(client: httpx.Client, served: Served,
                                                                body: dict[str, Any], param: str) -> None:
    reply = client.post("/v1/responses", json={"max_output_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert client.get("/health").status_code == 200
    assert client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1}).status_code == 200
