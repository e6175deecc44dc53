"""Grammars a client can make costly: refused at the door by size, compiled on deep stacks, smallest first
without starving large ones, dropped when their client has gone, cached within a byte budget; errors that
name the field, keep the connection open and carry llguidance's message without its backtrace.

Every test talks HTTP to the real server and reads the grammar compiler's counters in-process
(``served.engine.processor.grammars``).
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pagedserve.engine.sampling_params import StructuredOutputsParams
from pagedserve.engine.structured_output import compiler as compiler_module
from pagedserve.engine.structured_output.compiler import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_SCHEMA_PROPERTIES,
    NUM_COMPILE_THREADS,
    SMALL_GRAMMAR_CHARS,
    GrammarCompiler,
)
from pagedserve.engine.structured_output.manager import GuidanceManager
from tests.conftest import Served

ASK = [{"role": "user", "content": "Answer in JSON."}]
DEADLINE_S = 120.0


def _nested(depth: int) -> dict[str, Any]:
    """An object schema nested ``depth`` objects deep: 2 JSON levels each, past llguidance's 128 at 64."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _ref_chain(length: int) -> dict[str, Any]:
    """An object schema holding arrays whose items ``$ref`` the next definition, ``length`` times: llguidance
    recurses once per link while compiling it (1,000 links overflow an 8 MiB thread stack)."""
    definitions: dict[str, Any] = {str(i): {"type": "array", "items": {"$ref": f"#/$defs/{i + 1}"}}
                                   for i in range(length)}
    definitions[str(length)] = {"type": "integer"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/0"}}, "$defs": definitions}


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _responses_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "answer", "schema": schema}}


#: The routes that take a JSON schema: (path, the body around ``schema``, the field the error must name).
SCHEMA_ROUTES: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "chat tools": ("/v1/chat/completions", lambda s: {"messages": ASK, "max_tokens": 2, "tools": [_tool(s)]},
                   "tools.0.function.parameters"),
    "chat response_format": ("/v1/chat/completions", lambda s: {
        "messages": ASK, "max_tokens": 2, "response_format": _schema_format(s)}, "response_format.json_schema.schema"),
    "chat guided_json": ("/v1/chat/completions", lambda s: {"messages": ASK, "max_tokens": 2, "guided_json": s},
                         "guided_json"),
    "completions guided_json": ("/v1/completions", lambda s: {"prompt": "{", "max_tokens": 2, "guided_json": s},
                                "guided_json"),
    "tokenize tools": ("/tokenize", lambda s: {"messages": ASK, "tools": [_tool(s)]}, "tools.0.function.parameters"),
    "responses tools": ("/v1/responses", lambda s: {
        "input": "hi", "max_output_tokens": 16, "tools": [{"type": "function", "name": "f", "parameters": s}]},
        "tools.0.parameters"),
    "responses text.format": ("/v1/responses", lambda s: {
        "input": "hi", "max_output_tokens": 16, "text": _responses_format(s)}, "text.format.schema"),
}


@pytest.fixture
def one_connection(served: Served) -> Iterator[httpx.Client]:
    """A client that holds one keep-alive connection: a second one would be opened only if the server closed it."""
    with httpx.Client(base_url=served.url, timeout=DEADLINE_S, limits=httpx.Limits(max_connections=1)) as client:
        yield client


def _client_port(response: httpx.Response) -> int:
    """The client's port of the connection the response came on."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _refused(response: httpx.Response, param: str) -> str:
    """The message of a 400 naming ``param``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


# --------------------------------------------------------------------------- the field named, the connection kept


@pytest.mark.parametrize("route", sorted(SCHEMA_ROUTES))
def test_a_schema_nested_past_llguidance_s_parser_is_a_400_naming_its_field_on_the_same_connection(
        one_connection: httpx.Client, route: str) -> None:
    """64 nested objects: llguidance's JSON parser stops at 128 levels with a ValueError, which was a 500
    that dropped the connection (tools) or a 400 naming no field (the others)."""
    path, body, param = SCHEMA_ROUTES[route]
    refused = one_connection.post(path, json=body(_nested(64)))
    assert "nested too deeply" in _refused(refused, param)
    after = one_connection.post("/tokenize", json={"prompt": "still here"})
    assert after.status_code == 200 and _client_port(after) == _client_port(refused)


@pytest.mark.parametrize("route", ["chat response_format", "completions guided_json", "responses text.format",
                                   "chat tools"])
def test_a_schema_asking_for_its_own_json_whitespace_is_refused(client: httpx.Client, route: str) -> None:
    """``x-guidance`` whitespace options would give pretty-printed JSON, against the fixed whitespace; the
    ones equal to the fixed format are accepted."""
    path, body, param = SCHEMA_ROUTES[route]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    refused = client.post(path, json=body({**schema, "x-guidance": {"whitespace_pattern": "[ \n]*"}}))
    assert "whitespace_pattern" in _refused(refused, param)
    same = client.post(path, json=body({**schema, "x-guidance": {"whitespace_flexible": False,
                                                                  "key_separator": ": "}}))
    assert same.status_code == 200, same.text


# --------------------------------------------------------------------------- sizes refused before compiling


def test_sources_over_the_limits_are_refused_before_any_compile(client: httpx.Client, served: Served) -> None:
    grammars = served.engine.processor.grammars
    compiled = grammars.num_compiled
    choices = [f"c{i}" for i in range(MAX_CHOICES + 1)]
    message = _refused(client.post("/v1/completions", json={"prompt": "a", "guided_choice": choices}), "guided_choice")
    assert f"{MAX_CHOICES + 1:,} choices" in message and f"{MAX_CHOICES:,}" in message
    regex = "a" * (MAX_GRAMMAR_CHARS + 1)
    message = _refused(client.post("/v1/completions", json={"prompt": "a", "structured_outputs": {"regex": regex}}),
                       "structured_outputs.regex")
    assert f"{MAX_GRAMMAR_CHARS + 1:,} characters" in message
    many = {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_SCHEMA_PROPERTIES + 1)}}
    message = _refused(client.post("/v1/chat/completions", json={"messages": ASK, "response_format": _schema_format(
        many)}), "response_format.json_schema.schema")
    assert f"{MAX_SCHEMA_PROPERTIES + 1:,} object properties" in message
    # Tools count together: each is under the limit, the two are over it.
    half = {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_SCHEMA_PROPERTIES // 2 + 1)}}
    tools = [{"type": "function", "function": {"name": name, "parameters": half}} for name in ("f", "g")]
    message = _refused(client.post("/v1/chat/completions", json={"messages": ASK, "tools": tools}), "tools")
    assert "object properties" in message
    assert grammars.num_compiled == compiled


def test_a_source_under_the_limit_compiles_though_its_grammar_text_is_longer(client: httpx.Client,
                                                                            served: Served) -> None:
    """The most choices, of 258 characters: 520 K characters of source, 11% more of grammar text; the compile
    thread that takes large grammars took them only up to the source limit, and this one waited forever."""
    grammars = served.engine.processor.grammars
    compiled = grammars.num_compiled
    choices = [f"{i:04}" + "x" * 254 for i in range(MAX_CHOICES)]
    assert MAX_GRAMMAR_CHARS - 10_000 < len(json.dumps(choices)) <= MAX_GRAMMAR_CHARS
    response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "guided_choice": choices})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in {choice[:len(response.json()["choices"][0]["text"])]
                                                      for choice in choices}
    assert grammars.num_compiled == compiled + 1


def test_a_grammar_llguidance_panics_on_is_a_400_without_its_backtrace(client: httpx.Client) -> None:
    """66,000 alternatives (414 K characters, under the limit) break llguidance's symbol limit: a panic,
    whose text went to the client with its native backtrace and build paths."""
    alternatives = "|".join(f'"{i:x}"' for i in range(66_000))
    response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                                    "structured_outputs": {"grammar": f"start: {alternatives}"}})
    message = _refused(response, "structured_outputs.grammar")
    assert message.startswith("invalid grammar for structured output: panic: ") and "symbols" in message
    assert "<backtrace>" not in message and "\n" not in message and "python-build" not in message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions guided_json", "chat response_format"])
def test_a_grammar_failing_while_generating_names_the_client_s_field(
        client: httpx.Client, monkeypatch: pytest.MonkeyPatch, route: str, stream: bool) -> None:
    """The grammar refusing a sampled token fails the request in the engine with ``structured_outputs``;
    completions passed that name on (the client sent ``guided_json``), where chat named its own field."""
    monkeypatch.setattr(GuidanceManager, "accept_tokens", lambda self, request_id, token_ids: "token refused")
    path, body, param = SCHEMA_ROUTES[route]
    refused = client.post(path, json={**body({"type": "object"}), "stream": stream, "max_tokens": 4})
    assert "token refused" in _refused(refused, param)
    monkeypatch.undo()
    assert client.post(path, json={**body({"type": "object"}), "max_tokens": 4}).status_code == 200


# --------------------------------------------------------------------------- deep grammars, on deep stacks


@pytest.mark.parametrize("route", ["completions guided_json", "tokenize tools"])
def test_a_long_ref_chain_compiles_instead_of_overflowing_the_stack(client: httpx.Client, route: str) -> None:
    """3,000 ``$ref`` links (150 K characters) overflowed an 8 MiB stack, a segfault that took the server
    down: the tool schemas were checked on the event loop's thread (as chat checks them too; the chat prompt
    holding them would be too long here), compiles ran on ordinary pool threads."""
    path, body, _ = SCHEMA_ROUTES[route]
    response = client.post(path, json=body(_ref_chain(3000)))
    assert response.status_code == 200, response.text
    assert client.get("/health").status_code == 200


# --------------------------------------------------------------------------- compile queue and cache


class HeldCompiles:
    """The served compiler's compiles, recorded (``built``: each grammar's text, as its compile starts); a
    compile whose text holds the name of a ``hold`` waits until that hold is released."""

    def __init__(self, grammars: GrammarCompiler, monkeypatch: pytest.MonkeyPatch) -> None:
        self.grammars = grammars
        self.built: list[str] = []
        self.holds: dict[str, threading.Event] = {}
        build = grammars._build

        def held_build(text: str, kind: str) -> Any:
            self.built.append(text)
            for name, released in list(self.holds.items()):
                if name in text:
                    released.wait(timeout=DEADLINE_S)
            return build(text, kind)

        monkeypatch.setattr(grammars, "_build", held_build)

    def hold(self) -> tuple[str, threading.Event]:
        """A new hold: its unique name (put it in a grammar) and the event that releases it."""
        name = f"hold-{time.monotonic_ns()}"
        self.holds[name] = threading.Event()
        return name, self.holds[name]

    def started(self, name: str) -> bool:
        return any(name in text for text in self.built)

    def release_all(self) -> None:
        for released in self.holds.values():
            released.set()


@pytest.fixture
def held(served: Served, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldCompiles]:
    held = HeldCompiles(served.engine.processor.grammars, monkeypatch)
    yield held
    held.release_all()


def _large(name: str) -> StructuredOutputsParams:
    """A choice list of more than ``SMALL_GRAMMAR_CHARS``: only the first compile thread takes it."""
    params = StructuredOutputsParams(choice=[f"{name} {i}" for i in range(1500)])
    assert len(json.dumps(params.choice)) > SMALL_GRAMMAR_CHARS
    return params


def test_a_queued_compile_whose_client_left_never_runs(served: Served, held: HeldCompiles) -> None:
    grammars = held.grammars
    name, release = held.hold()
    pool = ThreadPoolExecutor(2)  # two requests whose compiles hold both threads
    holding = [pool.submit(httpx.post, f"{served.url}/v1/completions", timeout=DEADLINE_S, json={
        "prompt": "a", "max_tokens": 1, "guided_choice": [f"{name} {i}"]}) for i in range(2)]
    pool.shutdown(wait=False)
    _wait_for(lambda: sum(name in text for text in held.built) == 2, "both compile threads to be held")
    cancelled = grammars.num_cancelled
    gone = f"gone {time.monotonic_ns()}"
    body = json.dumps({"prompt": "a", "max_tokens": 1, "guided_choice": [gone]}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _wait_for(lambda: grammars.num_queued == 1, "the request's compile to be queued")
    _wait_for(lambda: grammars.num_cancelled == cancelled + 1, "the compile to be cancelled")
    release.set()
    assert [response.result().status_code for response in holding] == [200, 200]
    _wait_for(lambda: grammars.num_queued == 0, "the cancelled job to be skipped")
    assert not held.started(gone)
    # The cache forgot it: the same grammar asked again compiles and answers.
    again = httpx.post(f"{served.url}/v1/completions", timeout=DEADLINE_S,
                       json={"prompt": "a", "max_tokens": 32, "guided_choice": [gone]})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == gone
    assert sum(gone in text for text in held.built) == 1


def test_a_small_schema_compiles_while_large_grammars_hold_the_first_thread(client: httpx.Client,
                                                                            held: HeldCompiles) -> None:
    name, release = held.hold()
    running = held.grammars.compile(_large(name))
    _wait_for(lambda: held.started(name), "the large grammar's compile to start")
    queued = held.grammars.compile(_large(f"queued {name}"))
    schema = {"type": "object", "properties": {name.replace("-", "_"): {"type": "integer"}}}
    response = client.post("/v1/completions", json={"prompt": "{", "max_tokens": 4, "guided_json": schema})
    assert response.status_code == 200, response.text
    assert not running.done() and not queued.done() and held.grammars.num_queued == 1
    release.set()
    running.result(timeout=DEADLINE_S), queued.result(timeout=DEADLINE_S)


def test_queued_grammars_compile_smallest_first(held: HeldCompiles) -> None:
    """Held: the first thread by a large grammar, the second by a small one; of the two large grammars queued
    behind them, the smaller compiles first."""
    first, release_first = held.hold()
    second, release_second = held.hold()
    held.grammars.compile(_large(first))
    _wait_for(lambda: held.started(first), "the first thread to be held")
    held.grammars.compile(StructuredOutputsParams(choice=[second]))
    _wait_for(lambda: held.started(second), "the second thread to be held")
    larger = held.grammars.compile(StructuredOutputsParams(choice=[f"larger {first} {i}" for i in range(MAX_CHOICES)]))
    smaller = held.grammars.compile(_large(f"smaller {first}"))
    _wait_for(lambda: held.grammars.num_queued == 2, "both to be queued")
    release_first.set()
    larger.result(timeout=DEADLINE_S), smaller.result(timeout=DEADLINE_S)
    order = [text for text in held.built if "larger" in text or "smaller" in text]
    assert len(order) == 2 and "smaller" in order[0]
    release_second.set()


def test_a_large_compile_is_not_starved_by_small_ones_queued_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Smallest first alone let a steady stream of small grammars pass a queued large one for ever; jobs run
    earliest deadline first, the deadline growing with the grammar's size (``AGING_S_PER_CHAR``)."""
    monkeypatch.setattr(compiler_module, "AGING_S_PER_CHAR", 1e-6)
    threads = compiler_module._CompileThreads()
    holds = [threading.Event(), threading.Event()]
    try:
        threads.submit(SMALL_GRAMMAR_CHARS + 1, holds[0].wait)  # only the first thread takes it
        _wait_for(lambda: threads.num_queued == 0, "the first thread to be held")
        threads.submit(1, holds[1].wait)
        _wait_for(lambda: threads.num_queued == 0, "the second thread to be held")
        ran: list[str] = []
        large = threads.submit(50_000, lambda: ran.append("large"))  # its deadline: 50 ms from now
        time.sleep(0.2)
        small = threads.submit(10, lambda: ran.append("small"))  # smaller, but its deadline is later
        holds[0].set()
        large.result(timeout=DEADLINE_S), small.result(timeout=DEADLINE_S)
        assert ran == ["large", "small"]
    finally:
        for hold in holds:
            hold.set()
        threads.shutdown(wait=True)


def test_the_grammar_cache_is_bounded_by_its_estimated_bytes(client: httpx.Client, served: Served,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Distinct large choice lists: the cache keeps what fits in its byte budget, the newest always."""
    budget = 16 * 1024**2
    monkeypatch.setattr(compiler_module, "MAX_CACHED_GRAMMAR_BYTES", budget)
    grammars: GrammarCompiler = served.engine.processor.grammars
    tag = time.monotonic_ns()
    for n in range(12):  # each about 45 K characters: an estimated 3 MiB
        choices = [f"{tag} {n} {i}" for i in range(1900)]  # 2,000 sharing a prefix fail while generating
        response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "guided_choice": choices})
        assert response.status_code == 200, response.text
        assert grammars.cached_bytes <= budget
    newest = grammars.compile(StructuredOutputsParams(choice=choices))
    assert newest.done() and newest.result() is not None  # still cached: no new compile
    assert grammars.cached_bytes > budget - 4 * 1024**2  # full up to about one grammar


def test_a_compiler_dropped_without_shutdown_stops_its_threads(served: Served) -> None:
    """Each offline ``LLM`` has a compiler; one dropped without ``shutdown`` left two idle threads (with their
    stack reservations) for the life of the process."""
    before = {thread for thread in threading.enumerate() if thread.name.startswith("grammar-")}
    compiler = GrammarCompiler(served.engine.tokenizer, 49_152)
    started = {thread for thread in threading.enumerate() if thread.name.startswith("grammar-")} - before
    assert len(started) == NUM_COMPILE_THREADS
    del compiler
    gc.collect()
    for thread in started:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in started)
