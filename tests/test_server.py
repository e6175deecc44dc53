"""The HTTP server against the real engine: response shapes, streaming, concurrency, disconnects, CLI."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest

import pagedserve
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.request import EngineCoreRequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server.app import ServerArgs
from pagedserve.server.cli import build_parser, main
from pagedserve.server.cli_args import resolve_settings
from tests.conftest import Served, cli_server, engine_step_fault, free_port, sse_payloads

GREEDY = {"temperature": 0.0}


def post(client: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(client: httpx.Client, path: str, **body: Any) -> list[Any]:
    """Every event of a streamed request, ``[DONE]`` included."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(response.iter_lines())


def joined_text(events: list[Any], index: int = 0) -> str:
    """The text of choice ``index`` across the chunks of a completions or chat stream."""
    pieces = []
    for event in events[:-1]:
        for choice in event["choices"]:
            if choice["index"] == index:
                pieces.append(choice["text"] if "text" in choice else choice["delta"].get("content", ""))
    return "".join(pieces)


def wait_until_idle(engine: AsyncLLM, timeout_s: float = 60.0) -> None:
    """Wait for no running or waiting request and no KV block in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.get_stats()
        if stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the engine is still busy after {timeout_s} s: {stats}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- simple routes


def test_models_health_and_version_describe_the_server(client: httpx.Client, served: Served) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [served.engine.model_name]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 2048
    assert client.get("/health").status_code == 200
    assert client.get("/version").json() == {"version": pagedserve.__version__}


def test_tokenize_and_detokenize_round_trip(client: httpx.Client) -> None:
    tokens = post(client, "/tokenize", prompt="Hello world, again")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    assert post(client, "/detokenize", tokens=tokens["tokens"]) == {"prompt": "Hello world, again"}


def test_chat_messages_tokenize_exactly_as_apply_chat_template(client: httpx.Client, served: Served) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
    tokenizer = served.engine.tokenizer
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert post(client, "/tokenize", messages=messages)["tokens"] == list(expected)
    # A list of text parts is the same conversation as its parts joined by newlines.
    parts = [*messages[:3], {"role": "user", "content": [{"type": "text", "text": "Name a"},
                                                         {"type": "text", "text": "colour."}]}]
    joined = [*messages[:3], {"role": "user", "content": "Name a\ncolour."}]
    assert post(client, "/tokenize", messages=parts) == post(client, "/tokenize", messages=joined)


# --------------------------------------------------------------------------- completions and chat


def test_completion_stream_joins_to_the_whole_text(client: httpx.Client) -> None:
    body = {"prompt": "The three primary colors are", "max_tokens": 12, "ignore_eos": True, **GREEDY}
    whole = post(client, "/v1/completions", **body)
    assert whole["id"].startswith("cmpl-") and whole["object"] == "text_completion"
    assert isinstance(whole["created"], int) and whole["choices"][0]["finish_reason"] == "length"

    events = stream(client, "/v1/completions", **body, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert {c["id"] for c in events[:-1]} == {usage_chunk["id"]} and usage_chunk["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and isinstance(c["created"], int) for c in chunks)
    assert joined_text(events) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_chat_stream_joins_to_the_whole_message(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Say something about cats."}], "max_tokens": 10,
            "ignore_eos": True, **GREEDY}
    whole = post(client, "/v1/chat/completions", **body)
    assert whole["id"].startswith("chatcmpl-") and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 10

    events = stream(client, "/v1/chat/completions", **body, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in events[:-1])
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert joined_text(events) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: httpx.Client, path: str) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it), which needs ``include_usage``."""
    body = {"max_tokens": 6, "ignore_eos": True, **GREEDY}
    body |= ({"messages": [{"role": "user", "content": "Count to ten."}]} if "chat" in path
             else {"prompt": "One, two, three,"})
    options = {"include_usage": True, "continuous_usage_stats": True}

    events = stream(client, path, **body, stream_options=options)

    *chunks, usage_chunk = events[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == usage_chunk["usage"]["prompt_tokens"] for c in chunks)
    assert counts == sorted(counts) and counts[-1] == usage_chunk["usage"]["completion_tokens"] == 6
    plain = stream(client, path, **body, stream_options={"continuous_usage_stats": True})
    assert all(c.get("usage") is None for c in plain[:-1])
    # Each choice counts its own tokens, as vLLM does.
    chunks = stream(client, path, **body, n=2, stream_options=options)[:-2]
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 6


def test_server_text_equals_offline_llm_text(client: httpx.Client) -> None:
    """Greedy text over HTTP (streamed and not) equals ``LLM.generate`` / ``LLM.chat`` in-process."""
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(max_model_len=1024, kv_cache_memory_bytes="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = "The three primary colors are"
    offline = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, **GREEDY}
    assert post(client, "/v1/completions", **body)["choices"][0]["text"] == offline
    assert joined_text(stream(client, "/v1/completions", **body)) == offline
    messages = [{"role": "user", "content": "Name a fruit."}]
    offline_chat = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    chat = post(client, "/v1/chat/completions", messages=messages, max_tokens=16, ignore_eos=True, **GREEDY)
    assert chat["choices"][0]["message"]["content"] == offline_chat


def test_usage_counts_match_tokenize(client: httpx.Client) -> None:
    prompt = "Count the tokens of this prompt, please."
    completion = post(client, "/v1/completions", prompt=prompt, max_tokens=5, **GREEDY)
    usage = completion["usage"]
    assert usage["prompt_tokens"] == post(client, "/tokenize", prompt=prompt)["count"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    messages = [{"role": "user", "content": prompt}]
    chat = post(client, "/v1/chat/completions", messages=messages, max_tokens=5, **GREEDY)
    chat_usage = chat["usage"]
    assert chat_usage["prompt_tokens"] == post(client, "/tokenize", messages=messages)["count"]
    assert chat_usage["total_tokens"] == chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]


def test_prompts_times_n_give_choice_indexes_in_order(client: httpx.Client) -> None:
    body = {"prompt": ["Hello", "Goodbye"], "n": 2, "max_tokens": 3, "ignore_eos": True,
            "temperature": 1.0, "seed": 7}
    completion = post(client, "/v1/completions", **body)
    assert [c["index"] for c in completion["choices"]] == [0, 1, 2, 3]
    assert completion["usage"]["completion_tokens"] == 2 * 2 * 3

    events = stream(client, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], n=2,
                    max_tokens=3, temperature=1.0, seed=7)
    role_chunks = [c["choices"][0] for c in events[:2]]
    assert [(c["index"], c["delta"]) for c in role_chunks] == [(0, {"role": "assistant", "content": ""}),
                                                              (1, {"role": "assistant", "content": ""})]
    finished = {c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_echo_with_logprobs_has_the_openai_legacy_shape(client: httpx.Client) -> None:
    prompt = "Paris is the capital of"
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 4, "ignore_eos": True, **GREEDY}
    choice = post(client, "/v1/completions", **body)["choices"][0]
    logprobs = choice["logprobs"]
    num_prompt_tokens = post(client, "/tokenize", prompt=prompt)["count"]
    assert choice["text"].startswith(prompt)
    assert {len(values) for values in logprobs.values()} == {num_prompt_tokens + 4}
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    for token, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:], strict=True):
        assert token in top and 2 <= len(top) <= 3  # the chosen token, plus the top 2
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False))

    events = stream(client, "/v1/completions", **body)
    assert events[0]["choices"][0]["text"].startswith(prompt)
    assert joined_text(events) == choice["text"]
    streamed = [c["choices"][0]["logprobs"] for c in events[:-1]]
    assert [t for lp in streamed for t in lp["tokens"]] == logprobs["tokens"]
    assert [o for lp in streamed for o in lp["text_offset"]] == offsets


def test_chat_logprobs_have_the_openai_chat_shape(openai_client: openai.OpenAI) -> None:
    response = openai_client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=5, logprobs=True,
        top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert "".join(entry.token for entry in content) == response.choices[0].message.content


def test_openai_sdk_streams_completions_and_chat(openai_client: openai.OpenAI) -> None:
    model = openai_client.models.list().data[0].id
    body = {"model": model, "prompt": "One, two,", "max_tokens": 6, "temperature": 0}
    completion = openai_client.completions.create(**body)
    chunks = list(openai_client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text

    messages = [{"role": "user", "content": "Count to three."}]
    chat = openai_client.chat.completions.create(model=model, messages=messages, max_completion_tokens=6,
                                                 temperature=0)
    chat_chunks = list(openai_client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chat_chunks[-1].usage.total_tokens == chat.usage.total_tokens


def test_stop_string_split_across_tokens_never_leaks(client: httpx.Client) -> None:
    body = {"prompt": "The quick brown fox jumps over the lazy dog. The quick", "max_tokens": 16,
            "ignore_eos": True, **GREEDY}
    choice = post(client, "/v1/completions", **body, logprobs=0)["choices"][0]
    text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    # A stop string made of the end of one token and the start of the next, found first at that boundary.
    stop = next(s for k in range(1, len(tokens) - 1)
                if len(tokens[k]) >= 2 and len(tokens[k + 1]) >= 2
                and text.find(s := tokens[k][-2:] + tokens[k + 1][:2]) == offsets[k + 1] - 2)
    expected = text[:text.find(stop)]

    whole = post(client, "/v1/completions", **body, stop=[stop])["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == (expected, "stop")
    events = stream(client, "/v1/completions", **body, stop=stop)
    assert joined_text(events) == expected and stop not in joined_text(events)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    kept = post(client, "/v1/completions", **body, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == expected + stop


@pytest.mark.parametrize("prompt", ["中文：你好，世界。我是一个", "🎉🎉🎉 Party time! 🎊"])
def test_multibyte_text_streams_without_replacement_chars(client: httpx.Client, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, **GREEDY}
    events = stream(client, "/v1/completions", **body)
    pieces = [c["choices"][0]["text"] for c in events[:-1]]
    assert not any("\ufffd" in piece for piece in pieces)
    assert any(ord(ch) > 0x2E80 for ch in "".join(pieces))  # the model did write CJK or emoji
    assert "".join(pieces) == post(client, "/v1/completions", **body)["choices"][0]["text"]


# --------------------------------------------------------------------------- load and disconnects


def test_64_concurrent_streams_all_complete_with_correct_text(client: httpx.Client, served: Served) -> None:
    prompts = [f"Fact number {i} about the ocean:" for i in range(8)]
    body = {"max_tokens": 8, "ignore_eos": True, **GREEDY}
    reference = [post(client, "/v1/completions", prompt=p, **body)["choices"][0]["text"] for p in prompts]

    async def one(http: httpx.AsyncClient, prompt: str) -> str:
        async with http.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, **body}
                               ) as r:
            assert r.status_code == 200
            events = sse_payloads([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        return joined_text(events)

    async def run_all() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=served.url, timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(http, prompts[i % 8]) for i in range(64)))

    assert asyncio.run(run_all()) == [reference[i % 8] for i in range(64)]
    wait_until_idle(served.engine)


def test_disconnect_storm_frees_the_kv_cache(client: httpx.Client, served: Served) -> None:
    wait_until_idle(served.engine)
    body = {"max_tokens": 1000, "ignore_eos": True, "stream": True, **GREEDY}

    async def open_and_drop(http: httpx.AsyncClient, i: int) -> None:
        async with http.stream("POST", "/v1/completions", json={"prompt": f"Story {i}:", **body}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
            await asyncio.gather(*(open_and_drop(http, i) for i in range(20)))

    asyncio.run(storm())
    wait_until_idle(served.engine)
    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={**body, "prompt": "Story:", "stream": False}, timeout=1.0)
    wait_until_idle(served.engine)
    # Seeded, and min_tokens so that a first sampled EOS cannot empty the text: the engine must still serve.
    assert post(client, "/v1/completions", prompt="Still there?", max_tokens=3, min_tokens=3,
                seed=0)["choices"][0]["text"]


# --------------------------------------------------------------------------- CLI and configuration


def parse_serve(argv: list[str]) -> tuple[EngineArgs, ServerArgs]:
    return resolve_settings(build_parser().parse_args(["serve", *argv]))


def test_flags_override_yaml_which_overrides_defaults(tmp_path: Any) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 1024\nblock_size: 32\nport: 9000\nkv_cache_memory_bytes: 256MiB\n"
                      "allowed_origins: ['http://a.example']\nenable_prefix_caching: true\n")
    engine_args, server_args = parse_serve(["some/model.gguf", "--config", str(config), "--max-model-len",
                                            "512", "--no-enable-prefix-caching", "--host", "0.0.0.0"])
    assert engine_args.model == "some/model.gguf"
    assert (engine_args.max_model_len, engine_args.block_size) == (512, 32)
    assert engine_args.kv_cache_memory_bytes == 256 * 2**20 and engine_args.enable_prefix_caching is False
    assert engine_args.max_num_seqs == EngineArgs().max_num_seqs
    assert (server_args.host, server_args.port, server_args.allowed_origins) == ("0.0.0.0", 9000, ["http://a.example"])


def test_yaml_unknown_keys_and_wrong_types_are_rejected_by_name(tmp_path: Any) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("max_model_len: 512\nmax_modle_len: 2\nfoo: 1\n")
    with pytest.raises(ValueError, match="unknown keys foo, max_modle_len"):
        parse_serve(["--config", str(config)])
    config.write_text("max_num_seqs: lots\n")
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse_serve(["--config", str(config)])


def test_invalid_settings_exit_with_a_usage_error(tmp_path: Any, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("no_such_setting: 1\n")
    assert main(["serve", "--config", str(config)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pagedserve serve: error: ") and "no_such_setting" in error and error.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:  # argparse's own choices check
        main(["serve", "--dtype", "float64"])
    assert exit_info.value.code == 2


def test_api_key_comes_from_the_environment_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert parse_serve([])[1].api_key == "from-env"
    assert parse_serve(["--api-key", "from-flag"])[1].api_key == "from-flag"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "")
    assert parse_serve([])[1].api_key is None
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    assert parse_serve([])[1].api_key is None


def test_help_documents_every_setting_with_unit_and_default(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for cls in (EngineArgs, ServerArgs):
        for f in cls.__dataclass_fields__.values():
            assert f"--{f.name.replace('_', '-')}" in text
            assert not f.metadata["unit"] or f"[{f.metadata['unit']}]" in text
    assert "[requests] (default: 64)" in text and "(default: 16MiB)" in text


def test_sigterm_lets_the_in_flight_stream_finish(tmp_path: Any) -> None:
    """``python -m pagedserve serve`` end to end: YAML config, a stream, SIGTERM, a clean exit."""
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 256\nkv_cache_memory_bytes: 32MiB\nshutdown_timeout: 60\n")
    with cli_server(tmp_path, "--config", str(config)) as (url, process):
        body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            events = sse_payloads([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 40
        # After its graceful shutdown uvicorn re-raises the signal, so the exit status says SIGTERM.
        assert process.wait(timeout=120) == -signal.SIGTERM


def test_a_dead_engine_fails_the_stream_and_ends_the_process_non_zero(tmp_path: Any) -> None:
    """As vLLM does: the in-flight request gets an error, then the process exits 1 (Docker's restart
    policy and Kubernetes restart it) instead of answering 503 forever."""
    fault = engine_step_fault(tmp_path, 2, 'raise RuntimeError("injected engine fault")')
    args = ("--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB")
    with cli_server(tmp_path, *args, env=fault) as (url, process):
        body = {"prompt": "Once upon a time", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            events = sse_payloads(response.iter_lines())
        assert "engine" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        assert process.wait(timeout=60) == 1
    assert "injected engine fault" in (tmp_path / "server.log").read_text()


@pytest.mark.server  # runs `python -m pagedserve serve`
@pytest.mark.parametrize("args, message", [
    (["/no/such/model"], "model path '/no/such/model' is not a folder or a .gguf file"),
    (["--max-model-len", "8192", "--kv-cache-memory-bytes", "64MiB"],
     "cannot hold one request of max_model_len 8192 tokens"),
    (["--block-size", "0"], "block_size must be >= 1"),
])
def test_start_up_errors_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--port", str(free_port()), *args],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr


@pytest.mark.server  # runs `python -m pagedserve serve`
def test_port_in_use_is_found_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--port", str(port)], capture_output=True,
                                text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    expected = f"pagedserve serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert result.stderr.strip() == expected


# --------------------------------------------------------------------------- fields honoured as vLLM does


def test_chat_echo_prepends_the_last_assistant_message(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": "Hello"}]
    body = {"messages": messages, "max_tokens": 4, "ignore_eos": True, **GREEDY}
    reply = post(client, "/v1/chat/completions", **body)["choices"][0]["message"]["content"]
    echoed = post(client, "/v1/chat/completions", **body, echo=True)
    assert echoed["choices"][0]["message"]["content"] == "Hello" + reply
    events = stream(client, "/v1/chat/completions", **body, echo=True)
    assert events[1]["choices"][0]["delta"] == {"content": "Hello"}  # right after the role chunk
    assert joined_text(events) == "Hello" + reply
    # The last message is the user's: nothing to echo.
    user_only = {**body, "messages": messages[:1], "echo": True}
    assert post(client, "/v1/chat/completions", **user_only)["choices"][0]["message"]["content"] == (
        post(client, "/v1/chat/completions", **{**user_only, "echo": False})["choices"][0]["message"]["content"])


def test_chat_add_generation_prompt_false_renders_as_tokenize_does(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    response = post(client, "/v1/chat/completions", messages=messages, max_tokens=1, add_generation_prompt=False)
    tokens = post(client, "/tokenize", messages=messages, add_generation_prompt=False)
    assert response["usage"]["prompt_tokens"] == tokens["count"]
    assert tokens["count"] < post(client, "/tokenize", messages=messages)["count"]


def test_best_of_equal_to_n_is_served(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2, "best_of": 2}
    assert len(post(client, "/v1/chat/completions", **body)["choices"]) == 2


def _check_prompt_logprobs(entries: list[Any], prompt_ids: list[int], k: int) -> None:
    """vLLM's shape: per prompt position, token id -> {logprob, rank, decoded_token}; None first."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        assert str(token_id) in entry and 1 <= len(entry) <= k + 1
        assert {rank for rank in range(1, k + 1)} <= {v["rank"] for v in entry.values()}
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values())


def test_prompt_logprobs_in_vllm_shape_on_chat_and_completions(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = post(client, "/v1/chat/completions", messages=messages, max_tokens=1, prompt_logprobs=2)
    _check_prompt_logprobs(chat["prompt_logprobs"], post(client, "/tokenize", messages=messages)["tokens"], 2)
    assert "prompt_logprobs" not in post(client, "/v1/chat/completions", messages=messages, max_tokens=1)

    completion = post(client, "/v1/completions", prompt="Paris is", max_tokens=1, prompt_logprobs=1)
    prompt_ids = post(client, "/tokenize", prompt="Paris is")["tokens"]
    _check_prompt_logprobs(completion["choices"][0]["prompt_logprobs"], prompt_ids, 1)
    assert "prompt_logprobs" not in post(client, "/v1/completions", prompt="Paris is", max_tokens=1)["choices"][0]


# --------------------------------------------------------------------------- the model's generation config


def test_the_embedded_model_has_no_generation_config(served: Served) -> None:
    assert served.engine.default_sampling_params == {}


def _tiny_chat_model(folder: Any, generation_config: dict[str, Any]) -> None:
    """A tiny random llama with the embedded SmolLM2's tokenizer (and chat template) and ``generation_config``."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=True,
                                  eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(generation_config))


def test_unset_sampling_fields_take_the_models_generation_config(
        tmp_path: Any, serve_fresh_engine: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _tiny_chat_model(tmp_path, {"temperature": 0.25, "top_k": 7, "repetition_penalty": 1.1,
                                "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2})
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.generation_config"):
        tiny = serve_fresh_engine(model=str(tmp_path), served_model_name="org/tiny", max_model_len=256,
                                  kv_cache_memory_bytes="8MiB")
    expected = {"temperature": 0.25, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 5}
    assert f"overridden by the model's generation config: {expected}" in caplog.text
    seen: list[SamplingParams] = []  # what the engine was asked to run, latest last
    core = tiny.engine.client.core
    add_request = core.add_request

    def recording_add_request(request: EngineCoreRequest) -> None:
        seen.append(request.sampling_params)
        add_request(request)

    monkeypatch.setattr(core, "add_request", recording_add_request)
    messages = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=tiny.url, timeout=120) as http:
        unset = post(http, "/v1/chat/completions", messages=messages, ignore_eos=True)
        assert (seen[-1].temperature, seen[-1].top_k, seen[-1].repetition_penalty) == (0.25, 7, 1.1)
        assert seen[-1].top_p == 1.0  # not in the file: the engine's default
        assert unset["usage"]["completion_tokens"] == 5  # max_new_tokens caps an open budget
        explicit = post(http, "/v1/chat/completions", messages=messages, ignore_eos=True, temperature=1.0,
                        top_k=0, repetition_penalty=1.0, max_tokens=8)
        assert (seen[-1].temperature, seen[-1].top_k, seen[-1].repetition_penalty) == (1.0, 0, 1.0)
        assert explicit["usage"]["completion_tokens"] == 8
        post(http, "/v1/completions", prompt="Hi", max_tokens=None, ignore_eos=True)
        assert seen[-1].temperature == 0.25 and seen[-1].max_tokens == 5
        post(http, "/v1/completions", prompt="Hi", ignore_eos=True)
        assert seen[-1].max_tokens == 16  # OpenAI's default for completions
    # The openai SDK retrieves a hub-style id with a slash (it sends it as %2F).
    sdk = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0)
    assert sdk.models.retrieve("org/tiny").id == "org/tiny"

    untouched = serve_fresh_engine(model=str(tmp_path), generation_config="vllm", max_model_len=256,
                                   kv_cache_memory_bytes="8MiB")
    assert untouched.engine.default_sampling_params == {}
    with httpx.Client(base_url=untouched.url, timeout=120) as http:
        post(http, "/v1/chat/completions", messages=messages, max_tokens=2)

    # The offline LLM uses the same defaults when given no parameters, as vLLM's does.
    from pagedserve.engine import LLM

    offline = LLM(str(tmp_path), max_model_len=256, kv_cache_memory_bytes="8MiB").get_default_sampling_params()
    assert (offline.temperature, offline.top_k, offline.repetition_penalty, offline.max_tokens) == (0.25, 7, 1.1, 5)


def test_generation_config_can_come_from_another_folder_or_be_off(tmp_path: Any) -> None:
    from pagedserve.engine.generation_config import load_generation_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.9, "top_k": null}')
    assert load_generation_defaults("/nonexistent", str(tmp_path)) == {"temperature": 0.7, "top_p": 0.9}
    assert load_generation_defaults(str(tmp_path), "auto") == {"temperature": 0.7, "top_p": 0.9}
    assert load_generation_defaults(str(tmp_path), "none") == {}
    assert load_generation_defaults(str(tmp_path / "missing"), "auto") == {}
    with pytest.raises(ValueError, match="not a folder holding a generation_config.json"):
        load_generation_defaults(str(tmp_path), str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        load_generation_defaults(str(tmp_path), "auto")
    parse = build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert resolve_settings(parse)[0].generation_config == "vllm"
