"""One large request never holds up the others: it is refused by its length, without tokenizing."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.conftest import Served

HUGE_PROMPT = "hello world " * 1_300_000  # 15.6 MB


# Polls /health from a process of its own: says "ready" after its first answer, then polls until its stdin
# closes and prints the latencies (s) as JSON. A thread of the test's process would share the GIL with the
# server under test and with the client's encoding.
HEALTH_PROBE = """
import json, select, sys, time
import httpx
latencies = []
with httpx.Client(base_url=sys.argv[1], timeout=10) as client:
    while not latencies or not select.select([sys.stdin], [], [], 0.01)[0]:
        started = time.monotonic()
        assert client.get("/health").status_code == 200
        latencies.append(time.monotonic() - started)
        if len(latencies) == 1:
            print("ready", flush=True)
print(json.dumps(latencies))
"""


def test_a_huge_prompt_is_refused_while_health_stays_fast(served: Served) -> None:
    body = json.dumps({"prompt": HUGE_PROMPT, "max_tokens": 1}).encode()
    prober = subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, served.url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout.readline() == "ready\n"
        started = time.monotonic()
        response = httpx.post(f"{served.url}/v1/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=60)
        elapsed = time.monotonic() - started
    finally:
        try:
            out, _ = prober.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            prober.kill()
            prober.communicate()
            raise
    assert prober.returncode == 0
    latencies = json.loads(out.splitlines()[-1])
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "maximum context length" in response.json()["error"]["message"]
    print(f"refused in {elapsed:.2f} s; /health max {max(latencies) * 1000:.0f} ms over {len(latencies)}")
    assert max(latencies) < 1.0  # generous on a shared 2-core machine; see the printed figure (about 40 ms)


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
