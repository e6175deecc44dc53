"""The HTTP server's own work and memory are bounded, whatever a client sends (issue 26).

* ``/detokenize`` decodes at most ``max_model_len`` ids;
* the dashboard's backlog lets the event loop serve others between two records;
* the Responses API's ``metadata``, ``user``, ``call_id`` and tool descriptions have limits, and the
  response store a byte bound as well as a count;
* unknown field names are kept and logged cut, and at most ``_MAX_LOGGED_UNKNOWN_FIELDS`` of them;
* an error quotes a client's value (a model name, a field name) cut, never whole;
* a client that stops reading its stream has its request aborted once ``max_stream_backlog_tokens`` wait;
* the ``Bearer`` scheme is case-insensitive (RFC 9110).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest
from starlette.requests import Request

from pagedserve.engine.step_records import StepRecordBuffer
from pagedserve.server import protocol
from pagedserve.server.app import ServerArgs
from pagedserve.server.dashboard import follow_steps
from pagedserve.server.errors import MAX_ECHOED_CHARS, MAX_ERROR_MESSAGE_CHARS, shorten
from pagedserve.server.responses import ResponseStore, stored_bytes
from pagedserve.server.responses_protocol import (
    MAX_IDENTIFIER_CHARS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_TOOL_DESCRIPTION_CHARS,
)
from tests.conftest import TEST_ENGINE_ARGS, Served

#: What the longest echoed value becomes: its first ``MAX_ECHOED_CHARS`` and a note of the rest.
MAX_SHORTENED_CHARS = len(shorten("x" * 10**9))


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]


# --------------------------------------------------------------------------- /detokenize


def test_detokenize_decodes_at_most_max_model_len_ids(client: httpx.Client, served: Served) -> None:
    limit = served.engine.max_model_len
    error = error_of(client.post("/detokenize", json={"tokens": [1] * (limit + 1)}), 400)
    assert error["param"] == "tokens" and f"at most max_model_len ({limit})" in error["message"]
    decoded = client.post("/detokenize", json={"tokens": [1] * limit})
    assert decoded.status_code == 200
    assert decoded.json()["prompt"] == served.engine.tokenizer.decode([1] * limit)


# --------------------------------------------------------------------------- echoed values


def test_an_unknown_model_is_quoted_cut_in_the_404(client: httpx.Client) -> None:
    name = "m" * 100_000
    for response in (client.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1}),
                     client.get(f"/v1/models/{name[:10_000]}")):
        error = error_of(response, 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"
        assert f"`{'m' * MAX_ECHOED_CHARS}... (" in error["message"]
        assert len(error["message"]) < MAX_SHORTENED_CHARS + 100


def test_any_error_quotes_a_clients_value_cut(client: httpx.Client) -> None:
    """A dict key the request may not hold is named in ``param`` and in the message: both are cut."""
    key = "k" * 100_000
    body = {"prompt": "Hi", "max_tokens": 1, "structured_outputs": {key: 1}}
    error = error_of(client.post("/v1/completions", json=body), 400)
    assert error["param"] == shorten(f"structured_outputs.{key}")
    assert len(error["message"]) <= len(shorten("x" * 10**9, MAX_ERROR_MESSAGE_CHARS))


# --------------------------------------------------------------------------- unknown fields


def test_unknown_field_names_are_logged_cut_and_at_most_a_thousand(
        client: httpx.Client, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "_logged_unknown_fields", set())  # as if no earlier test sent any
    long_name = "z" * 1_000_000
    with caplog.at_level(logging.WARNING, logger="pagedserve.server.protocol"):
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, long_name: 1}).status_code == 200
    assert protocol._logged_unknown_fields == {shorten(long_name)}
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert logged == [f"The following fields were present in the request but ignored: ['{shorten(long_name)}']"]
    many = {f"made_up_{i}": i for i in range(1500)}
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **many}).status_code == 200
    assert len(protocol._logged_unknown_fields) == protocol._MAX_LOGGED_UNKNOWN_FIELDS
    assert max(map(len, protocol._logged_unknown_fields)) == len(shorten(long_name))


# --------------------------------------------------------------------------- Responses API


@pytest.mark.parametrize(("field", "value", "param"), [
    ("metadata", {f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}, "metadata"),
    ("metadata", {"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}, "metadata"),
    ("metadata", {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}, "metadata"),
    ("user", "u" * (MAX_IDENTIFIER_CHARS + 1), "user"),
    ("input", [{"type": "function_call", "call_id": "c" * (MAX_IDENTIFIER_CHARS + 1), "name": "f",
                "arguments": "{}"}], "input.0.call_id"),
    ("input", [{"type": "function_call_output", "call_id": "c" * (MAX_IDENTIFIER_CHARS + 1), "output": "4"}],
     "input.0.call_id"),
    ("tools", [{"type": "function", "name": "f", "description": "d" * (MAX_TOOL_DESCRIPTION_CHARS + 1)}],
     "tools.0.description"),
], ids=["metadata-pairs", "metadata-key", "metadata-value", "user", "function_call", "function_call_output",
        "tool-description"])
def test_what_a_stored_response_keeps_is_bounded(client: httpx.Client, field: str, value: object,
                                                  param: str) -> None:
    body = {"input": "Hi", "max_output_tokens": 1, field: value}
    assert error_of(client.post("/v1/responses", json=body), 400)["param"] == param


def test_metadata_at_openais_limits_is_kept(client: httpx.Client) -> None:
    metadata = {f"{i:02d}".ljust(MAX_METADATA_KEY_CHARS, "k"): "v" * MAX_METADATA_VALUE_CHARS
                for i in range(MAX_METADATA_PAIRS)}
    user = "u" * MAX_IDENTIFIER_CHARS
    created = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1, "metadata": metadata,
                                                 "user": user})
    assert created.status_code == 200, created.text
    stored = client.get(f"/v1/responses/{created.json()['id']}").json()
    assert stored["metadata"] == metadata and stored["user"] == user


def test_the_response_store_drops_the_oldest_past_its_byte_bound(serve_app) -> None:
    served = serve_app(ServerArgs())
    max_bytes = 40_000  # about four responses with full metadata (9 KiB each)
    store = served.app.state.response_store = ResponseStore(max_bytes=max_bytes)
    metadata = {f"{i:02d}": "v" * MAX_METADATA_VALUE_CHARS for i in range(MAX_METADATA_PAIRS)}
    with httpx.Client(base_url=served.url, timeout=120) as client:
        ids = [client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1, "metadata": metadata}
                           ).json()["id"] for _ in range(8)]
        assert client.get(f"/v1/responses/{ids[-1]}").status_code == 200
        assert client.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert 1 < len(store) < len(ids)
    kept = [store.get(response_id) for response_id in ids if store.get(response_id) is not None]
    assert store.num_bytes == sum(stored_bytes(entry.response, entry.messages) for entry in kept) <= max_bytes


# --------------------------------------------------------------------------- the dashboard


def test_the_dashboard_backlog_lets_the_event_loop_run_between_records(served: Served) -> None:
    """A send that fits the socket's buffer does not wait: the backlog itself must give way, or many followers
    connecting at once hold every other client (the issue measured /health at 12 s with 100 of them)."""
    records = StepRecordBuffer(64)
    for step in range(64):
        records.append({"step": step, "preempted": [], "finished": []})
    request = Request({"type": "http", "app": served.app})

    async def follow() -> tuple[list[int], int]:
        response = await follow_steps(records, request, history=64, every_step=True)
        passes = 0  # of the event loop, counted by a task that yields at once each time it runs

        async def count_passes() -> None:
            nonlocal passes
            while True:
                passes += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count_passes())
        await asyncio.sleep(0)
        start = passes
        steps = [json.loads(await anext(response.body_iterator))["step"] for _ in range(64)]
        ran = passes - start
        counter.cancel()
        await response.body_iterator.aclose()
        return steps, ran

    steps, passes = asyncio.run(follow())
    assert steps == list(range(64))
    assert passes >= 63  # the loop ran between every two records


def test_followers_share_one_json_text_per_buffered_record() -> None:
    """A hundred followers of a full buffer serialized every record a hundred times on the event loop (a plain
    request beside them took 7.7x its solo time): the buffer makes each record's text once."""
    records = StepRecordBuffer(2)
    for step in range(3):
        records.append({"step": step, "preempted": [], "finished": []})
    newest = records.records[-1]
    assert records.to_json(newest) is records.to_json(newest)
    assert json.loads(records.to_json(newest)) == newest
    merged = {**newest, "finished": [["r", "stop"]]}  # a follower's record carrying skipped finishes
    assert json.loads(records.to_json(merged)) == merged
    assert records.to_json(newest) != records.to_json(merged)
    evicted = {"step": 0, "preempted": [], "finished": []}  # fell out of the buffer: not cached any more
    assert json.loads(records.to_json(evicted)) == evicted
    assert sorted(records._json) == [1, 2]


# --------------------------------------------------------------------------- a client that stops reading


@pytest.fixture(scope="module")
def served_small_backlog(serve_fresh_engine) -> Served:
    # 100 logprobs a token (about 4 KB of JSON each) fill the sockets' buffers in about 120 steps, 20 took 500.
    return serve_fresh_engine(**TEST_ENGINE_ARGS, max_stream_backlog_tokens=64, max_logprobs=100)


def test_a_client_that_stops_reading_its_stream_has_its_request_aborted(served_small_backlog: Served) -> None:
    """Once the sockets' buffers are full (about 4 MiB on Linux's loopback), outputs wait in the engine's
    stream; past 64 tokens the request is aborted while its client is still connected: KV blocks freed,
    waiting outputs dropped."""
    served = served_small_backlog
    engine = served.engine
    max_tokens, n = 2000, 8  # 16,000 tokens of about 4 KB each with 100 logprobs: more than the buffers hold
    body = json.dumps({"prompt": "Count to a thousand:", "max_tokens": max_tokens, "n": n, "logprobs": 100,
                       "ignore_eos": True, "stream": True}).encode()
    port = int(served.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)  # and never reads
        wait_for(lambda: engine.get_stats().num_running_reqs == n, 120, "the request to start")
        wait_for(lambda: (stats := engine.get_stats()).num_running_reqs == stats.num_waiting_reqs == 0, 600,
                 "the request to end")
        assert engine.get_stats().kv_cache_usage == 0.0  # its blocks are free
        assert sum(stream.backlog_tokens for stream in engine._streams.values()) == 0  # outputs dropped
        with httpx.Client(base_url=served.url) as client:
            finished = [f for record in client.get("/v1/dashboard/steps/recent", params={"limit": 4096}).json()
                        for f in record["finished"]]
    assert len(finished) == n and {f["reason"] for f in finished} == {"abort"}, finished
    assert all(f["output_tokens"] < max_tokens for f in finished)


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# --------------------------------------------------------------------------- access control


def test_the_bearer_scheme_is_case_insensitive(serve_app) -> None:
    served = serve_app(ServerArgs(api_key="sekret"))
    expected = {"Bearer sekret": 200, "bearer sekret": 200, "BEARER  sekret": 200, "bearer wrong": 401,
                "Basic sekret": 401, "sekret": 401, "bearersekret": 401}
    with httpx.Client(base_url=served.url) as client:
        answered = {authorization: client.get("/v1/models", headers={"Authorization": authorization}).status_code
                    for authorization in expected}
    assert answered == expected


def test_the_last_output_is_queued_past_the_backlog_bound() -> None:
    """A request that has finished holds nothing more in the engine: its last output was refused past the
    bound, and a completed request ended as client_too_slow."""
    from pagedserve.engine.async_llm import _OutputStream
    from pagedserve.engine.outputs import CompletionOutput, RequestOutput

    def output(num_tokens: int, finished: bool) -> RequestOutput:
        completion = CompletionOutput(index=0, text="x" * num_tokens, token_ids=[1] * num_tokens)
        return RequestOutput("r", None, [1], [completion], finished)

    stream = _OutputStream(max_backlog_tokens=4)
    assert stream.put(output(3, finished=False))
    assert not stream.put(output(3, finished=False))  # past the bound while the request still runs
    assert stream.put(output(3, finished=True))
    assert stream.backlog_tokens == 6
