"""One large request never holds up the others: it is refused by its length, without tokenizing."""

from __future__ import annotations

import threading
import time

import httpx

from tests.conftest import Served

HUGE_PROMPT = "hello world " * 1_300_000  # 15.6 MB


def test_a_huge_prompt_is_refused_while_health_stays_fast(served: Served) -> None:
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=served.url, timeout=10) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        started = time.monotonic()
        response = httpx.post(f"{served.url}/v1/completions", json={"prompt": HUGE_PROMPT, "max_tokens": 1},
                              timeout=60)
        elapsed = time.monotonic() - started
    finally:
        done.set()
        prober.join()
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "maximum context length" in response.json()["error"]["message"]
    print(f"refused in {elapsed:.2f} s; /health max {max(latencies) * 1000:.0f} ms over {len(latencies)}")
    assert max(latencies) < 1.0  # generous on a shared 2-core machine; see the printed figure


def test_a_huge_conversation_is_refused_by_length(served: Served) -> None:
    body = {"messages": [{"role": "user", "content": HUGE_PROMPT}], "max_tokens": 1}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_prompt_that_fits_is_never_refused_by_its_length(served: Served) -> None:
    """Long tokens: many characters per token, still under max_model_len tokens."""
    processor = served.engine.processor
    longest = max(processor.tokenizer.get_vocab(), key=len)
    text = processor.tokenizer.convert_tokens_to_string([longest]) * 100
    processor.check_length(len(text), "prompt")  # raises if refused
