"""Where the engine core runs, measured over HTTP: a thread of the server (``PAGEDSERVE_ENABLE_MULTIPROCESSING=0``),
its own process (the default), and its own process with ``--async-scheduling``.

Per mode, ``make bench``'s scenarios P1, P16 and D64 (``benchmarks/run_all.py``: 1, 16 and 64 streams, EOS
ignored), with fewer prompts (4, 32, 64) to fit three rounds of three modes in a quarter of an hour:

- TTFT and TPOT p50, and output tokens per second, from ``pagedserve bench serve``'s load generator;
- ``/health`` p50 and p99, polled every 50 ms while the load runs: what an orchestrator's probe waits.

One server runs at a time, and the modes take turns (thread, process, async, thread, ...) for
``--repeats`` rounds, so that a slow minute of a shared machine falls on every mode. The report gives each
figure's median over the rounds, its spread, and each mode's ratio to the thread's.

    python -m benchmarks.engine_modes --repeats 3 --result-json engine-modes.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.run_all import SCENARIOS, ServerProcess, free_port, scenario_requests
from pagedserve.server.bench.dataset import load_tokenizer
from pagedserve.server.bench.serve import ServeOptions, benchmark

#: name -> (environment, extra flags).
MODES: dict[str, tuple[dict[str, str], list[str]]] = {
    "thread": ({"PAGEDSERVE_ENABLE_MULTIPROCESSING": "0"}, []),
    "process": ({}, []),
    "process+async": ({}, ["--async-scheduling"]),
}
HEALTH_PERIOD_S = 0.05


async def _poll_health(base_url: str, stop: asyncio.Event) -> list[float]:
    """``/health`` latencies in seconds, one probe every ``HEALTH_PERIOD_S`` until ``stop``."""
    latencies = []
    async with httpx.AsyncClient(timeout=60) as client:
        while not stop.is_set():
            start = time.perf_counter()
            await client.get(base_url + "/health")
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(HEALTH_PERIOD_S)
    return latencies


#: Prompts per scenario.
NUM_PROMPTS = {"P1": 4, "P16": 32, "D64": 64}


async def _measure(base_url: str, model: str, scenario: str, tokenizer: Any, seed: int) -> dict[str, float]:
    spec = dataclasses.replace(SCENARIOS[scenario], num_prompts=NUM_PROMPTS[scenario],
                               seed=SCENARIOS[scenario].seed + 100 * seed)
    options = ServeOptions(base_url=base_url, model=model, max_concurrency=spec.concurrency, ignore_eos=True,
                           show_progress=False)
    requests = scenario_requests(spec, tokenizer)
    stop = asyncio.Event()
    health = asyncio.create_task(_poll_health(base_url, stop))
    metrics, _ = await benchmark(requests, options, tokenizer)
    stop.set()
    latencies = await health
    if metrics["failed"]:
        raise RuntimeError(f"{metrics['failed']} requests failed in {scenario}")
    return {"ttft_p50_ms": metrics["p50_ttft_ms"], "tpot_p50_ms": metrics["p50_tpot_ms"],
            "output_tok_s": metrics["output_throughput"],
            "health_p50_ms": 1000 * float(np.percentile(latencies, 50)),
            "health_p99_ms": 1000 * float(np.percentile(latencies, 99))}


def run_mode(name: str, server_args: list[str], log_dir: Path, tokenizer: Any, seed: int,
             scenarios: list[str]) -> dict[str, dict]:
    environment, flags = MODES[name]
    port = free_port()
    command = [sys.executable, "-m", "pagedserve", "serve", "--port", str(port), *server_args, *flags]
    server = ServerProcess(name.replace("+", "-"), command, port, log_dir, env=environment)
    try:
        if (why := server.wait_ready(600)) is not None:
            raise RuntimeError(f"{name} did not start: {why}: {server.log_tail()}")
        model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(_measure(server.base_url, model, "P1", tokenizer, 99))  # warm-up: kernels, caches
        return {name: asyncio.run(_measure(server.base_url, model, name, tokenizer, seed)) for name in scenarios}
    finally:
        server.stop()


def summarize(rounds: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """mode -> scenario -> metric -> [median, min, max] over the rounds."""
    summary: dict[str, dict[str, dict[str, list[float]]]] = {}
    for mode in rounds[0]:
        summary[mode] = {}
        for name in rounds[0][mode]:
            values = {k: [r[mode][name][k] for r in rounds] for k in rounds[0][mode][name]}
            summary[mode][name] = {k: [statistics.median(v), min(v), max(v)] for k, v in values.items()}
    return summary


def markdown(summary: dict[str, dict[str, dict[str, list[float]]]], num_rounds: int) -> str:
    baseline = next(iter(summary))
    lines = [f"Median of {num_rounds} interleaved rounds [min-max]; ratio = mode / {baseline}.", "",
             "| mode | scenario | TTFT p50 ms | TPOT p50 ms | output tok/s | /health p50 ms | /health p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for mode, by_scenario in summary.items():
        for name, metrics in by_scenario.items():
            base = summary[baseline][name]
            cells = []
            for key in ("ttft_p50_ms", "tpot_p50_ms", "output_tok_s", "health_p50_ms", "health_p99_ms"):
                median, low, high = metrics[key]
                ratio = "" if mode == baseline else f" ({median / base[key][0]:.2f}x)"
                cells.append(f"{median:.1f} [{low:.1f}-{high:.1f}]{ratio}")
            lines.append(f"| {mode} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every mode")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    parser.add_argument("--scenarios", default=",".join(NUM_PROMPTS), help="comma-separated, of P1, P16, D64")
    parser.add_argument("--server-args", default="--max-model-len 1024 --kv-cache-memory-bytes 1GiB",
                        help="flags every server gets (e.g. add --quantization gguf)")
    parser.add_argument("--result-json", type=Path, help="write the rounds and the summary here")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    tokenizer = load_tokenizer()
    log_dir = Path(tempfile.mkdtemp(prefix="engine-modes-"))
    rounds = []
    for repeat in range(args.repeats):
        rounds.append({mode: run_mode(mode, args.server_args.split(), log_dir, tokenizer, repeat,
                                      args.scenarios.split(",")) for mode in modes})
        print(f"round {repeat + 1}: {json.dumps(rounds[-1])}", flush=True)
    summary = summarize(rounds)
    print(markdown(summary, len(rounds)))
    if args.result_json:
        args.result_json.write_text(json.dumps({"server_args": args.server_args, "rounds": rounds,
                                                "summary": summary}, indent=1))
    print(f"server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
