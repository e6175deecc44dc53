"""Embeddings per second over HTTP: ``--num-inputs`` single-input ``/v1/embeddings`` requests of random token ids,
``--min-len`` to ``--max-len`` tokens each (uniform), sent by ``--concurrency`` clients at once to a server started
here with ``--runner pooling`` (the embedded SmolLM2 by default, LAST pooling). Prints embeddings/s, prompt tokens/s
and the latency percentiles; run it on a quiet machine, and repeat it (``--repeats``): the figure is the median.

    python -m benchmarks.embeddings_speed [--num-inputs 256] [--concurrency 16] [--min-len 32] [--max-len 512]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np


async def run_once(url: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list[float]]:
    """(wall seconds for every prompt, each request's latency in seconds)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            start = time.perf_counter()
            response = await http.post(f"{url}/v1/embeddings", json={"input": prompt})
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - start, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="pagedserve serve's --model; default the embedded SmolLM2")
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=8311)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, int(n)).tolist()
               for n in rng.integers(args.min_len, args.max_len + 1, args.num_inputs)]
    command = [sys.executable, "-m", "pagedserve", "serve", "--runner", "pooling", "--port", str(args.port)]
    server = subprocess.Popen(command + (["--model", args.model] if args.model else []), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        asyncio.run(run_once(url, prompts[:args.concurrency], args.concurrency))  # warm-up
        rates, p50s, p99s = [], [], []
        for _ in range(args.repeats):
            seconds, latencies = asyncio.run(run_once(url, prompts, args.concurrency))
            rates.append(len(prompts) / seconds)
            p50s.append(float(np.percentile(latencies, 50)))
            p99s.append(float(np.percentile(latencies, 99)))
    finally:
        server.terminate()
        server.wait(timeout=60)
    num_tokens = sum(map(len, prompts))
    rate = statistics.median(rates)
    print(f"| inputs | tokens | concurrency | embeddings/s (median of {args.repeats}; spread) | prompt tokens/s | "
          "latency p50 / p99 (s) |")
    print("|---|---|---|---|---|---|")
    print(f"| {len(prompts)} | {num_tokens} | {args.concurrency} | {rate:.1f} ({min(rates):.1f}-{max(rates):.1f}) | "
          f"{rate * num_tokens / len(prompts):.0f} | {statistics.median(p50s):.2f} / {statistics.median(p99s):.2f} |")


if __name__ == "__main__":
    main()
