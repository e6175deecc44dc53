"""Refused requests: every one gets its status and OpenAI's error shape, and nothing else is disturbed.

Also access control (API key, CORS), the body-size limit, the waiting-queue
limit (429) and an engine that dies under load (503, no hang).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagedserve.engine.async_llm import AsyncLLM, QueueFullError
from pagedserve.engine.config import CacheConfig, EngineArgs, ModelConfig
from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.core_client import InprocClient
from pagedserve.engine.input_processor import MAX_N, InputProcessor
from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path
from pagedserve.engine.request import EngineCoreRequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server import protocol
from pagedserve.server.app import ServerArgs
from pagedserve.server.cli import main as cli_main
from pagedserve.server.protocol import UNSUPPORTED_FIELDS
from tests.conftest import Served, sse_payloads

LONG_PROMPT = [19556] * 2100  # token ids, more than max_model_len (2048)
USER = [{"role": "user", "content": "Hi"}]

# (path, body, status, param): param None = the error names no field.
INVALID_REQUESTS = [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"not-a-token": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [99999999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 50}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1.5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content"),
    # Structured output that cannot be built: the parser's message, the field the client set.
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, 400, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": USER, "guided_json": {"type": "integer", "minimum": "zero"}}, 400,
     "guided_json"),
    ("/v1/chat/completions", {"messages": USER, "guided_json": "{not json"}, 400, "guided_json"),
    ("/v1/chat/completions", {"messages": USER, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": "Hi", "guided_regex": "[0-9"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "Hi", "guided_grammar": "start: undefined_rule"}, 400, "guided_grammar"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"choice": ["a"], "regex": "a"}}, 400,
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"whitespace_pattern": " *"}}, 400,
     "structured_outputs.whitespace_pattern"),
    ("/v1/chat/completions", {"messages": USER, "guided_regex": "a", "response_format": {"type": "json_object"}},
     400, "guided_regex"),
    ("/v1/chat/completions", {"messages": USER, "guided_json": "true"}, 400, "guided_json"),
    ("/v1/chat/completions", {"messages": USER, "guided_choice": ["a"], "min_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/completions", {"prompt": "Hi", "tool_choice": "auto"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    # Fields that would change the output and are not served: refused, naming the field.
    ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f", "parameters": {}}]}, 400,
     "functions"),
    ("/v1/chat/completions", {"messages": USER, "function_call": "auto"}, 400, "function_call"),
    ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "low"}, 400, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": USER, "best_of": 2}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": USER, "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 129}, 400, "n"),
    ("/v1/chat/completions", {"messages": USER, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400, None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """Check the status and OpenAI's error shape; returns the ``error`` object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize(("path", "body", "status", "param"), INVALID_REQUESTS + [
    (path, {**body, "stream": True}, status, param)
    for path, body, status, param in INVALID_REQUESTS if path.startswith("/v1/")])
def test_invalid_request_gets_its_status_and_the_openai_error_shape(
        client: httpx.Client, served: Served, path: str, body: dict[str, Any], status: int,
        param: str | None) -> None:
    assert_openai_error(client.post(path, json=body), status, param)
    assert not served.engine.errored


def test_context_length_error_gives_both_numbers(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5000})
    error = assert_openai_error(response, 400, "max_tokens")
    assert "maximum context length is 2048 tokens" in error["message"]
    assert "(1 in the messages, 5000 in the completion)" in error["message"]


@pytest.mark.parametrize(("content", "param"), [(b"{not json", None), (b"[1, 2]", None), (b"", None)])
def test_malformed_bodies_are_400(client: httpx.Client, content: bytes, param: str | None) -> None:
    response = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param)


@pytest.mark.parametrize(("method", "path", "status"), [
    ("PUT", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405), ("GET", "/v2/nothing", 404)])
def test_wrong_method_or_route(client: httpx.Client, method: str, path: str, status: int) -> None:
    assert_openai_error(client.request(method, path), status)


def test_invalid_requests_do_not_disturb_a_running_stream(client: httpx.Client, served: Served) -> None:
    body = {"prompt": "A list of rivers:", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with httpx.Client(base_url=served.url, timeout=120) as other:
        with other.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for path, invalid, status, _ in INVALID_REQUESTS:
                assert client.post(path, json=invalid).status_code == status
            events = sse_payloads([first, *lines])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    assert client.get("/health").status_code == 200


# --------------------------------------------------------------------------- nothing silently dropped


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_every_unsupported_field_is_refused_by_name(client: httpx.Client, served: Served, field: str) -> None:
    for path, body in [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"})]:
        error = assert_openai_error(client.post(path, json={**body, field: "on"}), 400, field)
        assert "not supported yet" in error["message"] and f"'{field}'" in error["message"]
    assert not served.engine.errored


@pytest.mark.parametrize(("field", "value"), [(field, harmless[0]) for field, (_, harmless)
                                               in sorted(UNSUPPORTED_FIELDS.items()) if harmless]
                         + [("tool_choice", None)])
def test_unsupported_fields_asking_for_nothing_are_accepted(client: httpx.Client, field: str, value: Any) -> None:
    body = {"messages": USER, "max_tokens": 1, field: value}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_unknown_fields_are_accepted_and_logged_once_per_name(
        client: httpx.Client, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "_logged_unknown_fields", set())  # as if no earlier test sent them
    messages = [{"role": "user", "content": "Hi", "speaker": "ann"}]
    with caplog.at_level(logging.WARNING, logger="pagedserve.server.protocol"):
        for _ in range(2):
            for path, body in [("/v1/completions", {"prompt": "Hi", "foo_bar": 1}),
                               ("/v1/chat/completions", {"messages": messages, "foo_bar": 1, "n_predict": 3}),
                               ("/v1/completions", {"prompt": "Hi", "prediction": {"type": "content"}})]:
                assert client.post(path, json={**body, "max_tokens": 1}).status_code == 200
    ignored = [r.getMessage() for r in caplog.records
               if "were present in the request but ignored" in r.getMessage()]
    assert ignored == [
        "The following fields were present in the request but ignored: ['foo_bar']",
        "The following fields were present in the request but ignored: ['messages.speaker', 'n_predict']",
        "The following fields were present in the request but ignored: ['prediction']"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.getMessage() in ignored)


def test_n_is_bounded_by_a_documented_maximum(client: httpx.Client) -> None:
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "Hi", "n": MAX_N + 1}), 400, "n")
    assert str(MAX_N) in error["message"]
    assert MAX_N == 128  # OpenAI's documented maximum


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi"}),
                                       ("/v1/chat/completions", {"messages": USER})])
def test_stream_options_without_stream_is_refused(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    options = {"stream_options": {"include_usage": True}}
    for stream in ({}, {"stream": False}):
        assert_openai_error(client.post(path, json={**body, **options, **stream}), 400, "stream_options")
    assert client.post(path, json={**body, **options, "stream": True, "max_tokens": 1}).status_code == 200
    assert client.post(path, json={**body, "stream_options": None, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi"}),
                                       ("/v1/chat/completions", {"messages": USER})])
def test_prompt_logprobs_cannot_be_streamed(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    response = client.post(path, json={**body, "prompt_logprobs": 1, "stream": True})
    assert_openai_error(response, 400, "prompt_logprobs")


def test_top_logprobs_errors_name_top_logprobs(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(model="", messages=USER, logprobs=True, top_logprobs=21)
    assert raised.value.body["param"] == "top_logprobs"
    assert raised.value.body["message"].startswith("top_logprobs must be <= 20")


def test_models_retrieve_gives_the_card_and_404_for_other_ids(
        client: httpx.Client, openai_client: openai.OpenAI, served: Served) -> None:
    card = openai_client.models.retrieve(served.engine.model_name)
    assert (card.id, card.object, card.owned_by) == (served.engine.model_name, "model", "pagedserve")
    assert client.get(f"/v1/models/{served.engine.model_name}").json()["max_model_len"] == 2048
    error = assert_openai_error(client.get("/v1/models/gpt-4"), 404, "model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("org/other-model")


# --------------------------------------------------------------------------- access and limits


def test_api_key_guards_the_api_but_not_health_or_version(serve_app: Any) -> None:
    app = serve_app(ServerArgs(api_key="sekret"))
    body = {"prompt": "Hi", "max_tokens": 2}
    with httpx.Client(base_url=app.url, timeout=120) as http:
        error = assert_openai_error(http.post("/v1/completions", json=body), 401)
        assert error["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer guess"}
        assert_openai_error(http.post("/v1/completions", json=body, headers=wrong), 401)
        right = {"Authorization": "Bearer sekret"}
        assert http.post("/v1/completions", json=body, headers=right).status_code == 200
        for method, path in [("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize")]:
            assert_openai_error(http.request(method, path, json={"prompt": "a", "tokens": [1]}), 401)
        assert http.get("/health").status_code == 200 and http.get("/version").status_code == 200

    sdk = openai.OpenAI(base_url=f"{app.url}/v1", api_key="sekret", max_retries=0)
    assert sdk.completions.create(model="", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{app.url}/v1", api_key="guess", max_retries=0).models.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{app.url}/v1", api_key="guess", max_retries=0).models.retrieve("x")


def test_bench_serve_sends_the_api_key_and_a_refused_one_is_one_line(
        serve_app: Any, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    app = serve_app(ServerArgs(api_key="sekret"))
    tokenizer = gguf_cache_folder(resolve_model_path(None)).path  # an HF folder: loads fast
    argv = ["bench", "serve", "--base-url", f"{app.url}/v1", "--num-prompts", "2", "--input-len", "8",
            "--output-len", "2", "--tokenizer", tokenizer, "--no-progress"]
    monkeypatch.setenv("OPENAI_API_KEY", "sekret")  # the default of --api-key, as for the openai SDK
    assert cli_main(argv) == 0
    assert "Successful requests" in capsys.readouterr().out
    assert cli_main([*argv, "--api-key", "sekret"]) == 0
    capsys.readouterr()

    monkeypatch.delenv("OPENAI_API_KEY")
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith(f"error: GET {app.url}/v1/models answered HTTP 401 (pass --api-key")
    assert "Traceback" not in captured.err


def test_cors_is_off_by_default_and_on_for_allowed_origins(client: httpx.Client, serve_app: Any) -> None:
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in client.get("/v1/models", headers={"Origin": "http://ui.example"}
                                                           ).headers
    app = serve_app(ServerArgs(allowed_origins=["http://ui.example"], api_key="sekret"))
    response = httpx.options(f"{app.url}/v1/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://ui.example"


def test_oversized_bodies_are_413_declared_or_streamed(serve_app: Any) -> None:
    app = serve_app(ServerArgs(max_request_body_bytes=1024))
    big = b'{"prompt": "' + b"a" * 2000 + b'"}'
    with httpx.Client(base_url=app.url, timeout=60, headers={"content-type": "application/json"}) as http:
        error = assert_openai_error(http.post("/tokenize", content=big), 413)
        assert error["code"] == "request_too_large" and "1024" in error["message"]
        # No Content-Length: the middleware counts the chunks as they arrive.
        chunked = (big[i:i + 256] for i in range(0, len(big), 256))
        assert_openai_error(http.post("/tokenize", content=chunked), 413)
        assert http.post("/tokenize", content=b'{"prompt": "small"}').status_code == 200


# --------------------------------------------------------------------------- queue limit and engine failure


@pytest.fixture(scope="module")
def fragile(serve_fresh_engine: Any) -> Served:
    """An engine of its own that runs one request at a time and lets one wait; its tests may break it."""
    return serve_fresh_engine(max_model_len=256, kv_cache_memory_bytes="32MiB", max_num_seqs=1,
                              max_waiting_requests=1)


def wait_for_waiting_requests(served: Served, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while served.engine.get_stats().num_waiting_reqs != count:
        assert time.monotonic() < deadline, served.engine.get_stats()
        time.sleep(0.02)


def post_in_background(pool: ThreadPoolExecutor, url: str, body: dict[str, Any]) -> Any:
    return pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)


def test_full_waiting_queue_gives_429(fragile: Served) -> None:
    running = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=fragile.url, timeout=120) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions", json=running) as stream:
            lines = stream.iter_lines()  # held: a collected line iterator would close the stream
            next(line for line in lines if line.startswith("data: "))
            waiting = post_in_background(pool, fragile.url, {"prompt": "Hi", "max_tokens": 2})
            wait_for_waiting_requests(fragile, 1)
            for stream_flag in (False, True):
                response = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream_flag})
                assert assert_openai_error(response, 429)["code"] == "queue_full"
        # The stream's client left: its request is aborted and the waiting one runs.
        assert waiting.result(timeout=120).status_code == 200


class _GatedCore:
    """An engine core that applies each request only once ``gate`` is set, and runs none: each stays waiting."""

    def __init__(self, max_waiting_requests: int) -> None:
        model_config = ModelConfig(path="unused", served_model_name="gated", hf_config=None, max_model_len=64,
                                   vocab_size=49152, generation_defaults={})
        self.config = SimpleNamespace(model_config=model_config,
                                      args=EngineArgs(max_waiting_requests=max_waiting_requests,
                                                      step_record_buffer_size=0))
        self.gate = threading.Event()
        self.requests: list[EngineCoreRequest] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.gate.wait()
        self.requests.append(request)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=0, num_waiting_reqs=len(self.requests), kv_cache_usage=0.0,
                              prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                              num_scheduled_tokens=0)

    def step(self) -> list:
        return []

    def has_unfinished_requests(self) -> bool:
        return False  # nothing to step: the engine thread blocks on its input queue

    def abort_requests(self, request_ids: list[str]) -> None:
        self.requests = [r for r in self.requests if r.request_id not in request_ids]

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        pass  # no worker to die

    def shutdown(self) -> None:
        pass


def test_queued_requests_count_as_waiting_before_the_engine_applies_them() -> None:
    """The frontend counts what it submitted and the engine thread has not applied yet (``n`` as ``n``),
    without reading the scheduler's queue."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path)

    async def run() -> None:
        core = _GatedCore(max_waiting_requests=3)
        processor = InputProcessor(core.config.model_config, tokenizer, CacheConfig(64, 16), max_logprobs=20)
        engine = AsyncLLM(InprocClient(core), processor, None, asyncio.get_running_loop())

        async def until(condition: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 60
            while not condition():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.01)

        started = []
        for request_id, n, submitted in [("two", 2, 2), ("one", 1, 3)]:
            outputs = engine.generate(processor.process([1, 2], SamplingParams(max_tokens=2, n=n)), request_id)
            started.append(asyncio.ensure_future(anext(outputs)))
            # The request is queued; the engine thread waits at the gate.
            await until(lambda count=submitted: engine.num_waiting_requests() == count, f"{request_id} submitted")
        assert engine.get_stats().num_waiting_reqs == 0
        with pytest.raises(QueueFullError):
            await anext(engine.generate(processor.process([1, 2], SamplingParams(max_tokens=2)), "refused"))
        core.gate.set()
        await until(lambda: engine.get_stats().num_waiting_reqs == 3, "the engine applied the requests")
        assert engine.num_waiting_requests() == 3  # now all in the scheduler's count, none counted twice
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)
        await engine.shutdown(timeout_s=1)

    asyncio.run(run())


def test_engine_failure_ends_in_flight_requests_with_errors(fragile: Served) -> None:
    running = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    crashed = threading.Event()

    def broken_execute_model(*args: Any, **kwargs: Any) -> Any:
        crashed.set()
        raise RuntimeError("injected failure")

    with httpx.Client(base_url=fragile.url, timeout=120) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions", json=running) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            waiting = post_in_background(pool, fragile.url, {"prompt": "Hi", "max_tokens": 2})
            wait_for_waiting_requests(fragile, 1)
            fragile.engine.client.core.executor.execute_model = broken_execute_model
            events = sse_payloads([first, *lines])
        assert crashed.is_set()
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
        assert_openai_error(waiting.result(timeout=120), 503)
        assert_openai_error(http.get("/health"), 503)
        assert_openai_error(http.post("/v1/completions", json={"prompt": "Hi"}), 503)
        assert_openai_error(http.post("/v1/completions", json={"prompt": "Hi", "stream": True}), 503)
