"""One large request never holds up the others: it is refused by its length, without tokenizing.

How long ``/health`` takes meanwhile is a measurement, not a test: ``python -m benchmarks.isolation
--attacks huge_prompt`` (its ``health_max_s``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import Served

HUGE_PROMPT = "hello world " * 1_300_000  # 15.6 MB


def _record_inputs(monkeypatch: pytest.MonkeyPatch, served: Served, *methods: str) -> list[int]:
    """The sizes (characters, or messages) of the inputs the processor's ``methods`` tokenize from now on."""
    processor = served.engine.processor
    sizes: list[int] = []

    def recording(method: Callable[..., Any]) -> Callable[..., Any]:
        def record(text: Any, *args: Any, **kwargs: Any) -> Any:
            sizes.append(len(text))
            return method(text, *args, **kwargs)
        return record

    for name in methods:
        monkeypatch.setattr(processor, name, recording(getattr(processor, name)))
    return sizes


def test_a_huge_prompt_is_refused_by_its_length_without_tokenizing(served: Served,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tokenized = _record_inputs(monkeypatch, served, "process", "tokenize")
    body = json.dumps({"prompt": HUGE_PROMPT, "max_tokens": 1}).encode()
    response = httpx.post(f"{served.url}/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "maximum context length" in response.json()["error"]["message"]
    assert tokenized == []
    assert httpx.post(f"{served.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60
                      ).status_code == 200
    assert tokenized and set(tokenized) == {len("Hi")}  # the recording sees what is tokenized


def test_a_huge_conversation_is_refused_by_length(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = _record_inputs(monkeypatch, served, "render_chat")
    body = {"messages": [{"role": "user", "content": HUGE_PROMPT}], "max_tokens": 1}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert rendered == []


def test_a_prompt_that_fits_is_never_refused_by_its_length(served: Served) -> None:
    """Long tokens: many characters per token, still under max_model_len tokens."""
    processor = served.engine.processor
    longest = max(processor.tokenizer.get_vocab(), key=len)
    text = processor.tokenizer.convert_tokens_to_string([longest]) * 100
    processor.check_length(len(text), "prompt")  # raises if refused
