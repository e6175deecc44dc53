"""Reasoning models (``--reasoning-parser``): the thinking split from the answer, whole and streamed, and
structured output applied after it.

The served model is the embedded SmolLM2 with a tokenizer in which two unused added tokens (``<repo_name>``,
``<reponame>``) are renamed ``<think>`` and ``</think>`` (plain tokens, as in Qwen3's and DeepSeek-R1's
tokenizers), and a chat template of each family's shape: DeepSeek-R1's opens the thinking in the prompt,
Qwen3's closes an empty one when ``enable_thinking`` is false. ``logit_bias`` on ``</think>`` decides whether
the reply ends its thinking.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path
from pagedserve.engine.reasoning import REASONING_FORMATS, ReasoningStream, split_reasoning
from tests.conftest import TEST_ENGINE_ARGS, sse_payloads

THINK, END_THINK = 3, 4  # the renamed token ids
TEMPLATES = {
    "deepseek_r1": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\nLet me think.{% endif %}"),
    "qwen3": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}"),
}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": [3, 4, 5]}}, "required": ["answer"],
          "additionalProperties": False}
QUESTION = [{"role": "user", "content": "What is two plus two?"}]


# --- the format alone ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "reply", "expected"), [
    ("deepseek_r1", "Let me add.</think>It is 4.", ("Let me add.", "It is 4.")),
    ("deepseek_r1", "<think>Let me add.</think>\n\nIt is 4.", ("Let me add.", "\n\nIt is 4.")),
    ("deepseek_r1", "Still thinking when the budget ran out", ("Still thinking when the budget ran out", None)),
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", ("\nLet me add.\n", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),
    ("qwen3", "\n<think>cut short", ("cut short", None)),
    ("qwen3", "<think></think>It is 4.", (None, "It is 4.")),
    ("qwen3", "A < B and <thin ice", (None, "A < B and <thin ice")),
])
def test_a_whole_reply_splits_into_reasoning_and_content(name: str, reply: str, expected: tuple) -> None:
    assert split_reasoning(REASONING_FORMATS[name], reply) == expected


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
@pytest.mark.parametrize("reply", ["<think>Let me add.</think>It is 4.", "Let me add.</think>It is 4.",
                                   "It is 4 <thin", "<think>cut</thi"])
def test_streamed_deltas_split_as_the_whole_reply_does_wherever_the_tags_are_cut(name: str, reply: str) -> None:
    """Every way of cutting the reply into three deltas, tags cut across deltas included."""
    fmt = REASONING_FORMATS[name]
    expected = tuple(part or "" for part in split_reasoning(fmt, reply))
    for first in range(len(reply) + 1):
        for second in range(first, len(reply) + 1):
            stream = ReasoningStream(fmt)
            pieces = [stream.feed(d) for d in (reply[:first], reply[first:second], reply[second:])]
            pieces.append(stream.finish())
            assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == expected, (first, second)


# --- served -------------------------------------------------------------------------------------------


def thinking_model(folder: Path, template: str) -> str:
    """The embedded model in ``folder``, its tokenizer with ``<think>`` and ``</think>``, and ``template``."""
    source = Path(gguf_cache_folder(resolve_model_path(None)).path)
    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    os.symlink(source / "model.safetensors", folder / "model.safetensors")
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    renamed = {THINK: "<think>", END_THINK: "</think>"}
    for token in tokenizer["added_tokens"]:
        if token["id"] in renamed:
            token["content"], token["special"] = renamed[token["id"]], False
    vocab = tokenizer["model"]["vocab"]
    for token_id, word in renamed.items():
        for old in [w for w, i in vocab.items() if i == token_id]:
            del vocab[old]
        vocab[word] = token_id
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for token_id, word in renamed.items():
        if str(token_id) in config.get("added_tokens_decoder", {}):
            config["added_tokens_decoder"][str(token_id)] |= {"content": word, "special": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    return str(folder)


@pytest.fixture(scope="module")
def servers(serve_fresh_engine, tmp_path_factory) -> dict[str, httpx.Client]:
    """One server per reasoning format."""
    clients = {}
    for name, template in TEMPLATES.items():
        model = thinking_model(tmp_path_factory.mktemp(name) / "model", template)
        served = serve_fresh_engine(model=model, reasoning_parser=name, **TEST_ENGINE_ARGS)
        clients[name] = httpx.Client(base_url=served.url, timeout=120)
    yield clients
    for client in clients.values():
        client.close()


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": QUESTION, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def chat_stream(client: httpx.Client, **body: Any) -> tuple[str, str]:
    """The joined ``(reasoning_content, content)`` deltas of a streamed reply; ``reasoning`` must equal the
    former delta by delta."""
    with client.stream("POST", "/v1/chat/completions", json={"messages": QUESTION, "temperature": 0,
                                                               "stream": True, **body}) as response:
        assert response.status_code == 200
        events = sse_payloads(response.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    return "".join(d.get("reasoning_content") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas)


def test_a_reply_still_thinking_is_all_reasoning_and_no_grammar_holds_it(servers) -> None:
    """DeepSeek-R1's template opens the thinking: without ``</think>`` (banned) the whole reply is reasoning,
    free text even with a JSON schema, whose grammar waits for the thinking to end."""
    body = {"max_tokens": 12, "ignore_eos": True, "logit_bias": {str(END_THINK): -100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    message = chat(servers["deepseek_r1"], **body)
    assert message["content"] is None and message["reasoning_content"] == message["reasoning"]
    assert not message["reasoning_content"].lstrip().startswith("{")
    assert chat_stream(servers["deepseek_r1"], **body) == (message["reasoning_content"], "")


def test_structured_output_applies_after_the_reasoning_ends(servers) -> None:
    """``</think>`` (pushed by the bias) ends the thinking; the grammar then holds the answer to the schema."""
    body = {"max_tokens": 24, "logit_bias": {str(END_THINK): 100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    message = chat(servers["deepseek_r1"], **body)
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert chat_stream(servers["deepseek_r1"], **body) == ("", message["content"])


def test_enable_thinking_false_reaches_the_template_and_the_grammar_holds_from_the_start(servers) -> None:
    """Qwen3's template closes an empty thinking block when ``enable_thinking`` is false: the prompt has
    ended the reasoning, so the grammar holds the whole reply, which has no reasoning."""
    client = servers["qwen3"]
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    with_flag = client.post("/tokenize", json={"messages": QUESTION, **kwargs}).json()["tokens"]
    without = client.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert END_THINK in with_flag and END_THINK not in without
    message = chat(client, max_tokens=24, **kwargs,
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert "reasoning_content" not in message and "reasoning" not in message


def test_a_qwen3_reply_that_does_not_open_with_think_is_held_to_the_grammar_from_its_first_token(servers) -> None:
    """Regression: with thinking optional and undecided by the prompt, the grammar waited for a ``</think>`` that
    never came. The first token's mask now allows the grammar's tokens and ``<think>``; banning the latter leaves
    an answer held to the schema from the start."""
    message = chat(servers["qwen3"], max_tokens=24, logit_bias={str(THINK): -100},
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert "reasoning_content" not in message


def test_a_qwen3_reply_without_thinking_is_all_content_through_the_sdk(servers) -> None:
    client = openai.OpenAI(base_url=f"{servers['qwen3'].base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="model", messages=QUESTION, max_tokens=8, temperature=0,
                                           logit_bias={str(THINK): -100, str(END_THINK): -100},
                                           extra_body={"ignore_eos": True})
    message = reply.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None


def test_the_responses_api_returns_the_thinking_as_a_reasoning_item(servers) -> None:
    """Whole and streamed (``response.reasoning_text.delta`` events); passed back as input, it is dropped."""
    client = openai.OpenAI(base_url=f"{servers['deepseek_r1'].base_url}/v1", api_key="unused", max_retries=0)
    request = {"model": "model", "input": "What is two plus two?", "max_output_tokens": 10, "temperature": 0}
    response = client.responses.create(**request)
    assert [item.type for item in response.output] == ["reasoning"] and response.status == "incomplete"
    thinking = response.output[0].content[0].text
    assert thinking and response.output_text == ""

    events = list(client.responses.create(**request, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thinking
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [thinking]

    follow_up = client.responses.create(**{**request, "max_output_tokens": 2, "input": [
        {"role": "user", "content": "What is two plus two?"}, *[item.model_dump() for item in response.output],
        {"role": "user", "content": "And three plus three?"}]})
    assert follow_up.status in ("completed", "incomplete")


def test_chat_template_kwargs_may_not_set_what_the_request_sets(servers) -> None:
    response = servers["qwen3"].post("/v1/chat/completions", json={
        "messages": QUESTION, "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"
    assert "add_generation_prompt" in response.json()["error"]["message"]
