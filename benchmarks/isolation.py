"""Isolation: one hostile request must not stall the other clients, nor grow memory without bound.

Each attack is a request (or a few) that a client sends once. Per attack a fresh server is started,
and the script measures, in the same run:

- ``solo_s``: a probe request's latency (median of 3) with nothing else running: a one-line greedy
  completion, or for the grammar attack a small ``json_schema`` chat request;
- ``under_attack_s``: the same probe's latency, sent right after the attack, and ``ratio`` the two's
  quotient (the goal is <= 2);
- ``health_max_s``: the slowest ``/health`` answer while the attack was in flight;
- ``rss_mib``: the server's resident memory before the attack and after it (its objects released);
- what the attack got back (status codes, response bytes).

    python -m benchmarks.isolation --attacks stop_strings,logit_bias --result-json isolation.json
    python -m benchmarks.isolation --server-cwd /tmp/base   # the same attacks against another checkout

The attacks are those of issue 26; sizes are the issue's. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import string
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.run_all import HOST, ServerProcess, free_port, rss_mib

VOCAB_SIZE = 49_152  # SmolLM2's
ATTACK_TIMEOUT_S = 600.0
PLAIN = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
SCHEMA_CHAT = {"messages": [{"role": "user", "content": "Give me a JSON object with a name."}], "max_tokens": 16,
               "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": {
                   "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}


@dataclass
class Result:
    """What one attack did to its server (module docstring)."""

    attack: str
    solo_s: float = 0.0
    under_attack_s: float = 0.0
    ratio: float = 0.0
    health_solo_s: float = 0.0
    health_max_s: float = 0.0
    attack_s: float = 0.0
    rss_mib: tuple[float, float] = (0.0, 0.0)
    statuses: list[int | str] = field(default_factory=list)
    response_bytes: int = 0
    note: str = ""


def words(rng: random.Random, count: int, length: int = 12) -> list[str]:
    """``count`` distinct random lowercase strings of ``length`` letters."""
    return [f"{i:06d}" + "".join(rng.choices(string.ascii_lowercase, k=length - 6)) for i in range(count)]


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any], result: Result, **kwargs: Any) -> None:
    """Send one attack request; record its status and size (or the transport error's type)."""
    try:  # serialized on a thread: megabytes of JSON on this loop would delay the probe, not the server
        content = await asyncio.to_thread(json.dumps, body)
        response = await client.post(path, content=content, headers={"Content-Type": "application/json"},
                                     **kwargs)
        result.statuses.append(response.status_code)
        result.response_bytes += len(response.content)
    except httpx.HTTPError as exc:
        result.statuses.append(type(exc).__name__)


async def timed(client: httpx.AsyncClient, path: str, body: dict[str, Any] | None = None) -> float:
    """Seconds one request takes (GET without a body); raises on a non-200."""
    start = time.perf_counter()
    response = await (client.post(path, json=body) if body is not None else client.get(path))
    response.raise_for_status()
    return time.perf_counter() - start


# The attacks: each takes a client and a Result, sends its requests once and returns when they are answered.
Attack = Callable[[httpx.AsyncClient, Result], Awaitable[None]]


async def stop_strings(client: httpx.AsyncClient, result: Result) -> None:
    """``n: 128``, ``max_tokens: 6`` and 100,000 stop strings (1.3 MB)."""
    stops = words(random.Random(0), 100_000)
    await post(client, "/v1/completions", {"prompt": "Once upon a time", "n": 128, "max_tokens": 6,
                                           "stop": stops}, result)


async def stop_token_ids(client: httpx.AsyncClient, result: Result) -> None:
    """``stop_token_ids`` of 2,000,000 entries with ``n: 128`` (14 MB)."""
    ids = [1000 + i * 7919 % (VOCAB_SIZE - 1000) for i in range(2_000_000)]
    await post(client, "/v1/completions", {"prompt": "Once upon a time", "n": 128, "max_tokens": 16,
                                           "stop_token_ids": ids}, result)


def long_prompt() -> str:
    """About 7.4k tokens of distinct words (about 8 tokens a word: each digit is one)."""
    return " ".join(words(random.Random(2), 900, length=8))


async def prompt_logprobs(client: httpx.AsyncClient, result: Result) -> None:
    """A 7.4k-token prompt with ``prompt_logprobs: 20``, ``n: 8``, ``max_tokens: 1``."""
    await post(client, "/v1/completions", {"prompt": long_prompt(), "n": 8, "max_tokens": 1, "prompt_logprobs": 20},
               result)


# Controls: an attack's request without its hostile field, the load any such request puts on the engine. The
# probe shares every step with it, so its ratio is what the field itself adds on top.

async def control_n128(client: httpx.AsyncClient, result: Result) -> None:
    """``stop_strings`` without its stop strings: ``n: 128``, ``max_tokens: 6``."""
    await post(client, "/v1/completions", {"prompt": "Once upon a time", "n": 128, "max_tokens": 6}, result)


async def control_n64(client: httpx.AsyncClient, result: Result) -> None:
    """``logit_bias`` without its bias: ``n: 64``, ``max_tokens: 16``."""
    await post(client, "/v1/completions", {"prompt": "Once upon a time", "n": 64, "max_tokens": 16}, result)


async def control_long_prompt(client: httpx.AsyncClient, result: Result) -> None:
    """``prompt_logprobs`` without prompt logprobs: the 7.4k-token prompt, ``n: 8``, ``max_tokens: 1``."""
    await post(client, "/v1/completions", {"prompt": long_prompt(), "n": 8, "max_tokens": 1}, result)


async def logit_bias(client: httpx.AsyncClient, result: Result) -> None:
    """``logit_bias`` over every token id with ``n: 64`` (0.7 MB)."""
    await post(client, "/v1/completions", {"prompt": "Once upon a time", "n": 64, "max_tokens": 16,
                                           "logit_bias": {str(i): 0.5 for i in range(VOCAB_SIZE)}}, result)


async def guided_choice_disconnects(client: httpx.AsyncClient, result: Result) -> None:
    """6 ``guided_choice`` lists of 100,000 strings whose clients leave after 3-8 s."""
    rng = random.Random(3)

    async def one(i: int) -> None:
        body = {"prompt": "Pick one:", "max_tokens": 8, "guided_choice": words(rng, 100_000)}
        await post(client, "/v1/completions", body, result, timeout=3.0 + i)

    await asyncio.gather(*(one(i) for i in range(6)))


async def detokenize(client: httpx.AsyncClient, result: Result) -> None:
    """``/detokenize`` with 2,000,000 ids."""
    await post(client, "/detokenize", {"tokens": [i % 1000 + 100 for i in range(2_000_000)]}, result)


async def dashboard_followers(client: httpx.AsyncClient, result: Result) -> None:
    """100 followers of ``/v1/dashboard/steps?history=100000&every_step=true`` that never read, once the step
    record buffer is full (a 2,100-token generation fills the default 2,048 records first)."""
    await post(client, "/v1/completions", {"prompt": "Count:", "max_tokens": 2_100, "ignore_eos": True}, result)
    request = (f"GET /v1/dashboard/steps?history=100000&every_step=true HTTP/1.1\r\nHost: {HOST}\r\n"
               "Accept: text/event-stream\r\n\r\n").encode()
    port = client.base_url.port
    sockets = []
    for _ in range(100):
        sock = socket.create_connection((HOST, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request)
        sockets.append(sock)
    await asyncio.sleep(10)  # the followers' backlogs are written meanwhile; the probes run now
    for sock in sockets:
        sock.close()


async def grammar_cache(client: httpx.AsyncClient, result: Result) -> None:
    """50 distinct ``guided_choice`` requests of 20,000 strings, one after another."""
    rng = random.Random(4)
    for _ in range(50):
        await post(client, "/v1/completions", {"prompt": "Pick one:", "max_tokens": 4,
                                               "guided_choice": words(rng, 20_000)}, result)


async def responses_metadata(client: httpx.AsyncClient, result: Result) -> None:
    """20 stored ``/v1/responses`` whose ``metadata`` holds a 4 MB value."""
    for i in range(20):
        await post(client, "/v1/responses", {"input": "Hi", "max_output_tokens": 4,
                                             "metadata": {"k": str(i) * 4_000_000}}, result)


async def unknown_fields(client: httpx.AsyncClient, result: Result) -> None:
    """20 requests each with an unknown field whose name is 8 MB."""
    for i in range(20):
        await post(client, "/v1/completions", {**PLAIN, chr(97 + i) * 8_000_000: 1}, result)


async def huge_prompt(client: httpx.AsyncClient, result: Result) -> None:
    """A 15.6 MB prompt (``"hello world " * 1_300_000``), refused by its length without being tokenized."""
    await post(client, "/v1/completions", {"prompt": "hello world " * 1_300_000, "max_tokens": 1}, result)


async def model_name(client: httpx.AsyncClient, result: Result) -> None:
    """``"model": "m" * 5_000_000``: how much of it the 404 echoes."""
    await post(client, "/v1/completions", {**PLAIN, "model": "m" * 5_000_000}, result)


async def unread_stream(client: httpx.AsyncClient, result: Result) -> None:
    """A stream of 3,500 tokens with ``logprobs: 20`` whose client reads nothing for 90 s."""
    body = json.dumps({"prompt": "Count:", "max_tokens": 3_500, "ignore_eos": True, "logprobs": 20,
                       "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    sock = socket.create_connection((HOST, client.base_url.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(request)
    await asyncio.sleep(90)
    sock.close()


ATTACKS: dict[str, tuple[Attack, list[str]]] = {  # name -> (attack, extra server arguments)
    "stop_strings": (stop_strings, []),
    "stop_token_ids": (stop_token_ids, []),
    "prompt_logprobs": (prompt_logprobs, ["--max-model-len", "8192"]),
    "logit_bias": (logit_bias, []),
    "guided_choice_disconnects": (guided_choice_disconnects, []),
    "detokenize": (detokenize, []),
    "dashboard_followers": (dashboard_followers, []),
    "grammar_cache": (grammar_cache, []),
    "responses_metadata": (responses_metadata, []),
    "unknown_fields": (unknown_fields, []),
    "model_name": (model_name, []),
    "unread_stream": (unread_stream, ["--max-model-len", "4096"]),
    "huge_prompt": (huge_prompt, []),
    "control_n128": (control_n128, []),
    "control_n64": (control_n64, []),
    "control_long_prompt": (control_long_prompt, ["--max-model-len", "8192"]),
}


async def watch_health(client: httpx.AsyncClient, done: asyncio.Event, result: Result) -> None:
    """Probe ``/health`` every 100 ms until ``done``; keep the slowest answer."""
    while not done.is_set():
        result.health_max_s = max(result.health_max_s, await timed(client, "/health"))
        await asyncio.sleep(0.1)


async def measure(name: str, base_url: str, pid: int) -> Result:
    """Run attack ``name`` against the server at ``base_url`` (process ``pid``)."""
    attack = ATTACKS[name][0]
    result = Result(name)
    probe_path, probe_body = (("/v1/chat/completions", SCHEMA_CHAT) if name == "guided_choice_disconnects"
                              else ("/v1/completions", PLAIN))
    timeout = httpx.Timeout(ATTACK_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client, \
            httpx.AsyncClient(base_url=base_url, timeout=timeout) as attacker:
        await timed(client, probe_path, probe_body)  # warm-up (and the grammar compiled once)
        result.solo_s = statistics.median([await timed(client, probe_path, probe_body) for _ in range(3)])
        result.health_solo_s = statistics.median([await timed(client, "/health") for _ in range(5)])
        result.rss_mib = (rss_mib(pid), 0.0)
        done = asyncio.Event()
        start = time.perf_counter()
        attack_task = asyncio.create_task(attack(attacker, result))
        health_task = asyncio.create_task(watch_health(client, done, result))
        await asyncio.sleep(0.5)  # the attack is in the server now
        # The probe's own client: the health watcher shares the other one.
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as prober:
            result.under_attack_s = await timed(prober, probe_path, probe_body)
        await attack_task
        result.attack_s = time.perf_counter() - start
        done.set()
        await health_task
        await asyncio.sleep(2.0)  # let the server drop what the finished requests held
        result.rss_mib = (result.rss_mib[0], rss_mib(pid))
    result.ratio = result.under_attack_s / result.solo_s
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated names (default: all)")
    parser.add_argument("--server-cwd", type=Path, default=None,
                        help="start `python -m pagedserve serve` in this checkout instead of this one")
    parser.add_argument("--log-dir", type=Path, default=Path("."))
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    results = []
    for name in args.attacks.split(","):
        port = free_port()
        command = [sys.executable, "-m", "pagedserve", "serve", "--port", str(port), *ATTACKS[name][1]]
        server = ServerProcess(f"isolation-{name}", command, port, args.log_dir, cwd=args.server_cwd)
        try:
            if (why := server.wait_ready(300)) is not None:
                raise SystemExit(f"the server did not start: {why}: {server.log_tail()}")
            result = asyncio.run(measure(name, server.base_url, server.process.pid))
            if server.process.poll() is not None:
                result.note = f"the server exited with code {server.process.returncode}"
        finally:
            server.stop()
        results.append(result)
        print(json.dumps(asdict(result)), flush=True)
    print("\n| attack | probe solo s | under attack s | ratio | /health max s | attack s | RSS MiB before → after "
          "| statuses | response bytes |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        statuses = ",".join(sorted({str(s) for s in r.statuses}))
        print(f"| {r.attack} | {r.solo_s:.2f} | {r.under_attack_s:.2f} | {r.ratio:.2f} | {r.health_max_s:.2f} "
              f"| {r.attack_s:.1f} | {r.rss_mib[0]:.0f} → {r.rss_mib[1]:.0f} | {statuses} | {r.response_bytes:,} |")
    if args.result_json:
        args.result_json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
