"""Prompt logprobs are computed once per request, not once per child of ``n`` (issue 26), and converted
to the response once, off the event loop: the values are those of ``n = 1``, in every choice."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.server import chat, completions
from tests.conftest import Served

BLOCK_SIZE = 16  # the engine's default
# Long enough to fill many KV blocks, short enough for the test server's max_model_len (2048).
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based inks and a wooden screw press into a practical system. ") * 8


def post(client: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def num_cached(num_prompt_tokens: int) -> int:
    """Prompt tokens a sibling takes from the prefix cache: its full blocks, the last token excluded."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


class Spy:
    """Wraps a conversion function, counting its calls and the threads they ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.function = getattr(module, name)
        self.threads: list[str] = []
        monkeypatch.setattr(module, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.function(*args, **kwargs)


def test_llm_computes_prompt_logprobs_for_one_child_and_the_others_hit_its_blocks():
    """n = 4 used to prefill the prompt 4 times (no child got a cache hit); now child 0 alone computes it,
    and its siblings, added with it to an empty cache, take its blocks in the same step."""
    llm = LLM(max_model_len=1024, kv_cache_memory_bytes="64MiB")
    prompt = llm.get_tokenizer().encode(TEXT)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    before = llm.engine_core.make_stats()
    [shared] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3, n=4),
                            use_tqdm=False)
    after = llm.engine_core.make_stats()
    [alone] = llm.generate([prompt], params, use_tqdm=False)
    hits = num_cached(len(prompt))
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4 * len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * hits
    assert after.num_scheduled_tokens - before.num_scheduled_tokens == len(prompt) + 3 * (len(prompt) - hits)
    assert len(shared.outputs) == 4 and len(shared.prompt_logprobs) == len(prompt)
    assert shared.prompt_logprobs[0] is None
    for got, want in zip(shared.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
        assert got.token_ids == want.token_ids and got.rank == want.rank
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_completions_prompt_logprobs_with_n_are_computed_and_converted_once(
        served: Served, client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "Once more: " + TEXT
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2}
    num_prompt_tokens = post(client, "/tokenize", prompt=prompt)["count"]
    spy = Spy(monkeypatch, completions, "prompt_logprobs")
    before = served.engine.get_stats()
    choices = post(client, "/v1/completions", **body, n=4)["choices"]
    after = served.engine.get_stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * num_cached(num_prompt_tokens)
    assert len(spy.threads) == 1 and spy.threads[0].startswith("tokenizer")  # once, off the event loop
    alone = post(client, "/v1/completions", **body)["choices"][0]["prompt_logprobs"]
    assert len(choices) == 4
    for choice in choices:
        assert _same_prompt_logprobs(choice["prompt_logprobs"], alone)


def _same_prompt_logprobs(got: list[Any], want: list[Any]) -> bool:
    """Equal in tokens, ranks and decoded text, and in values up to float noise between batches."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for got_position, want_position in zip(got[1:], want[1:], strict=True):
        assert got_position.keys() == want_position.keys()
        for token_id, entry in got_position.items():
            expected = want_position[token_id]
            assert (entry["rank"], entry["decoded_token"]) == (expected["rank"], expected["decoded_token"])
            assert entry["logprob"] == pytest.approx(expected["logprob"], abs=1e-4)
    return True


def test_completions_echo_with_logprobs_and_n_converts_the_prompt_once(
        client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "Echo this: " + TEXT
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "echo": True, "logprobs": 2}
    alone = post(client, "/v1/completions", **body)["choices"][0]
    num_prompt_tokens = post(client, "/tokenize", prompt=prompt)["count"]
    spy = Spy(monkeypatch, completions, "_legacy_logprobs")
    choices = post(client, "/v1/completions", **body, n=3)["choices"]
    # One call for the prompt (off the event loop), then one per choice for its own two tokens.
    assert len(spy.threads) == 1 + 3 and spy.threads[0].startswith("tokenizer")
    assert len(choices) == 3
    for choice in choices:
        logprobs = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert {len(values) for values in logprobs.values()} == {num_prompt_tokens + 2}
        assert "".join(logprobs["tokens"]) == choice["text"]
        for name in ("tokens", "text_offset"):
            assert logprobs[name][:num_prompt_tokens] == alone["logprobs"][name][:num_prompt_tokens]
        for got, want in zip(logprobs["token_logprobs"][1:num_prompt_tokens],
                             alone["logprobs"]["token_logprobs"][1:num_prompt_tokens], strict=True):
            assert got == pytest.approx(want, abs=1e-4)
        assert [top.keys() for top in logprobs["top_logprobs"][1:num_prompt_tokens]] == [
            top.keys() for top in alone["logprobs"]["top_logprobs"][1:num_prompt_tokens]]


def test_chat_prompt_logprobs_with_n_are_converted_once_off_the_event_loop(
        client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [{"role": "user", "content": "Summarise: " + TEXT}]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
    alone = post(client, "/v1/chat/completions", **body)["prompt_logprobs"]
    spy = Spy(monkeypatch, chat, "prompt_logprobs")
    response = post(client, "/v1/chat/completions", **body, n=3)
    assert len(spy.threads) == 1 and spy.threads[0].startswith("tokenizer")
    assert len(response["choices"]) == 3 and _same_prompt_logprobs(response["prompt_logprobs"], alone)
