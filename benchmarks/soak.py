"""Soak: mixed traffic with aborts against one server for a long time, sampling its memory.

``concurrency`` clients loop until the time is up, each drawing its next
request from a fixed mix: streamed and plain completions and chat, ``n`` > 1,
seeded sampling, logprobs, invalid requests (which must get a 400), and
streams the client abandons after a few chunks (an abort in the engine). A
failure is anything else: a 5xx, a transport error, a 400 for a valid request,
a 200 for an invalid one, a stream that ends without ``[DONE]``. The server's
resident memory (RSS, from ``/proc``) is sampled every ``sample_s`` seconds.

    python -m benchmarks.soak --minutes 30 --concurrency 32 --result-json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.run_all import ServerProcess, free_port, rss_mib

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly bard".split()


@dataclass
class SoakResult:
    """Counts by outcome, failures (first few in full) and RSS samples ``(seconds since start, MiB)``."""

    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    rss_mib: list[tuple[float, float]] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.outcomes["failure"] += 1
        if len(self.failures) < 20:
            self.failures.append(what)


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))


def _request(rng: random.Random) -> tuple[str, str, dict[str, Any], bool]:
    """``(kind, path, body, valid)`` drawn from the mix."""
    kind = rng.choice(["completion", "completion-stream", "chat", "chat-stream", "n", "seeded-logprobs",
                       "abandoned-stream", "invalid"])
    chat = kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    if kind.endswith("stream") or kind == "abandoned-stream":
        body["stream"] = True
    if kind == "n":
        body |= {"n": rng.randint(2, 4), "temperature": 0.8}
    if kind == "seeded-logprobs":
        body |= {"seed": rng.randint(0, 2**32), "logprobs": 3}
    if kind == "invalid":
        body |= rng.choice([{"temperature": -1}, {"max_tokens": -5}, {"n": 1000}, {"top_p": 2.0},
                            {"seed": 2**70}])
    return kind, path, body, kind != "invalid"


async def _one(client: httpx.AsyncClient, rng: random.Random, result: SoakResult) -> None:
    kind, path, body, valid = _request(rng)
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    _check_status(kind, valid, response, result)
                    return
                chunks, done = 0, False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunks += 1
                        if kind == "abandoned-stream" and chunks >= 2:
                            result.outcomes["abandoned"] += 1
                            return  # leaving the block closes the connection: the server aborts
                if not done:
                    result.fail(f"{kind}: stream ended without [DONE]")
                    return
        else:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                _check_status(kind, valid, response, result)
                return
        result.outcomes["ok" if valid else "invalid-accepted"] += 1
        if not valid:
            result.fail(f"{kind}: 200 for an invalid request {body}")
    except httpx.HTTPError as exc:
        result.fail(f"{kind}: {type(exc).__name__}: {exc}")


def _check_status(kind: str, valid: bool, response: httpx.Response, result: SoakResult) -> None:
    status = response.status_code
    if status == 400 and not valid:
        result.outcomes["invalid-refused"] += 1
    elif status == 429:
        result.outcomes["429"] += 1  # back-pressure: the queue was full, not a fault
    else:
        result.fail(f"{kind}: HTTP {status}: {response.text[:200]}")


async def soak(base_url: str, pid: int, seconds: float, concurrency: int, sample_s: float, seed: int) -> SoakResult:
    """Run the mix for ``seconds`` with ``concurrency`` clients against ``base_url`` (server ``pid``)."""
    result = SoakResult()
    start = time.monotonic()
    deadline = start + seconds

    async def client_loop(index: int) -> None:
        rng = random.Random(seed + index)
        async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300.0)) as client:
            while time.monotonic() < deadline:
                await _one(client, rng, result)

    async def sampler() -> None:
        while time.monotonic() < deadline:
            result.rss_mib.append((round(time.monotonic() - start, 1), round(rss_mib(pid), 1)))
            await asyncio.sleep(sample_s)

    await asyncio.gather(sampler(), *(client_loop(i) for i in range(concurrency)))
    result.rss_mib.append((round(time.monotonic() - start, 1), round(rss_mib(pid), 1)))
    return result


def rss_drift(samples: list[tuple[float, float]], warmup_s: float) -> float:
    """Largest relative distance of a post-warm-up RSS sample from the first post-warm-up one."""
    after = [rss for t, rss in samples if t >= warmup_s]
    return max(abs(rss - after[0]) / after[0] for rss in after) if after else 0.0


def make_report(result: SoakResult, minutes: float, concurrency: int, healthy: bool, warmup_s: float
                ) -> dict[str, Any]:
    """The run as JSON-ready data (``dataclasses.asdict`` would rebuild the Counter from its items)."""
    return {"minutes": minutes, "concurrency": concurrency, "healthy_after": healthy,
            "rss_drift_after_warmup": round(rss_drift(result.rss_mib, warmup_s), 4),
            "outcomes": dict(result.outcomes), "failures": result.failures, "rss_mib": result.rss_mib}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=30.0, help="seconds between RSS samples")
    parser.add_argument("--warmup-minutes", type=float, default=5.0, help="RSS drift is measured after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("."))
    parser.add_argument("--result-json", type=Path)
    parser.add_argument("server_args", nargs="*", help="extra `pagedserve serve` arguments (after --)")
    args = parser.parse_args(argv)

    port = free_port()
    command = [sys.executable, "-m", "pagedserve", "serve", "--port", str(port), *args.server_args]
    server = ServerProcess("soak", command, port, args.log_dir)
    try:
        if (why := server.wait_ready(300)) is not None:
            raise SystemExit(f"the server did not start: {why}: {server.log_tail()}")
        result = asyncio.run(soak(server.base_url, server.process.pid, args.minutes * 60, args.concurrency,
                                  args.sample_s, args.seed))
        healthy = httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    finally:
        server.stop()
    report = make_report(result, args.minutes, args.concurrency, healthy, args.warmup_minutes * 60)
    print(json.dumps(report, indent=1))
    if args.result_json:
        args.result_json.write_text(json.dumps(report, indent=1))
    return 0 if healthy and result.outcomes["failure"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
