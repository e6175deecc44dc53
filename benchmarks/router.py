"""Prefix-cache affinity routing against round robin, on engine replicas behind Ray Serve.

The shared-prefix workload: ``--num-prefixes`` prompt prefixes (random text of ``--prefix-len``
tokens, as system prompts or few-shot examples are) with ``--requests-per-prefix`` requests each,
every request the prefix plus a suffix of its own (``--suffix-len`` tokens). The requests go in
rounds, one per prefix in a shuffled order each round, ``--max-concurrency`` in flight, streamed
(``pagedserve.server.bench.serve``). The replicas' KV caches (``--num-gpu-blocks``) are sized to hold the prefixes
a replica gets under affinity (num_prefixes / num_replicas) but not all of them.

For each router (``--routers``, default ``prefix`` then ``round_robin``) it deploys pagedserve's
replicas application (``pagedserve.server.replicas``) with ``--num-replicas`` fresh replicas on a local Ray
cluster, warms them up with unrelated prompts, runs the workload, reads every replica's prefix-cache
counters (``GET /metrics`` pinned to each replica with ``x-pagedserve-replica``) and deletes the
application. It prints, per router, the prefix-cache hit rate (prompt tokens found in the cache over
prompt tokens looked up, all replicas), TTFT p50/p99 and throughput.

    python -m benchmarks.router --num-replicas 2 --num-prefixes 8 --requests-per-prefix 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.bench.dataset import SyntheticRequest, Tokenizer, sample_requests
from pagedserve.server.bench.serve import ServeOptions, api_root, benchmark
from pagedserve.server.replicas.forwarding import REPLICA_HEADER, ROUTER_HEADER

#: The suffixes' seeds, apart from the prefixes' (``sample_requests`` draws request i from ``[seed, i]``).
SUFFIX_SEED_OFFSET = 1_000_003
#: The warm-up prompts' seed: text that shares no prefix with the workload's.
WARMUP_SEED = 2**31 - 1
HITS = "pagedserve:prefix_cache_hits_total"
QUERIES = "pagedserve:prefix_cache_queries_total"


@dataclass(frozen=True)
class Workload:
    """The shared-prefix workload's shape; lengths in tokens."""

    num_prefixes: int = 8
    requests_per_prefix: int = 8
    prefix_len: int = 256
    suffix_len: int = 16
    output_len: int = 16


def shared_prefix_requests(tokenizer: Tokenizer, workload: Workload, seed: int = 0) -> list[SyntheticRequest]:
    """The workload's requests in the order to send them: round after round, each round one request per
    prefix in a shuffled order (so that no routing policy meets a prefix at a fixed position).

    A prompt's token count is about ``prefix_len + suffix_len``: the tokenizer may merge a token across
    the boundary, which changes at most the prefix's last block.
    """
    length = (workload.output_len, workload.output_len)
    prefixes = sample_requests(tokenizer, workload.num_prefixes, (workload.prefix_len,) * 2, length, seed)
    suffixes = sample_requests(tokenizer, workload.num_prefixes * workload.requests_per_prefix,
                               (workload.suffix_len,) * 2, length, seed + SUFFIX_SEED_OFFSET)
    order = np.random.default_rng(seed)
    requests = []
    for round_index in range(workload.requests_per_prefix):
        for p in order.permutation(workload.num_prefixes):
            suffix = suffixes[p * workload.requests_per_prefix + round_index]
            requests.append(SyntheticRequest(prefixes[p].prompt + suffix.prompt,
                                             prefixes[p].prompt_len + suffix.prompt_len, workload.output_len))
    return requests


def replica_ids(base_url: str, num_replicas: int, timeout_s: float = 30.0) -> list[str]:
    """The ids of the replicas answering at ``base_url``, from ``GET /health`` routed in turn.

    Raises:
        RuntimeError: fewer than ``num_replicas`` answered in ``20 * num_replicas`` requests.
    """
    seen: list[str] = []
    with httpx.Client(base_url=api_root(base_url), timeout=timeout_s) as client:
        for _ in range(20 * num_replicas):
            response = client.get("/health", headers={ROUTER_HEADER: "round_robin"})
            replica = response.headers.get(REPLICA_HEADER)
            if replica and replica not in seen:
                seen.append(replica)
            if len(seen) == num_replicas:
                return seen
    raise RuntimeError(f"only replicas {seen} answered at {base_url}, expected {num_replicas}")


def replica_metrics(base_url: str, replicas: list[str], names: tuple[str, ...],
                    timeout_s: float = 30.0) -> dict[str, float]:
    """The samples ``names`` of the replicas' ``/metrics`` (each pinned to its replica), summed over them.

    Raises:
        RuntimeError: a replica did not answer its own ``/metrics`` (it was replaced).
    """
    totals = dict.fromkeys(names, 0.0)
    with httpx.Client(base_url=api_root(base_url), timeout=timeout_s) as client:
        for replica in replicas:
            response = client.get("/metrics", headers={REPLICA_HEADER: replica})
            if response.status_code != 200 or response.headers.get(REPLICA_HEADER) != replica:
                raise RuntimeError(f"replica {replica} did not answer /metrics (HTTP {response.status_code})")
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    if sample.name in totals:
                        totals[sample.name] += sample.value
    return totals


def prefix_cache_counters(base_url: str, replicas: list[str]) -> tuple[float, float]:
    """Prompt tokens found in the prefix cache and prompt tokens looked up, summed over ``replicas``
    (the counters count from each replica's start)."""
    totals = replica_metrics(base_url, replicas, (HITS, QUERIES))
    return totals[HITS], totals[QUERIES]


def run_workload(requests: list[SyntheticRequest], options: ServeOptions,
                 replicas: list[str]) -> dict[str, float | int]:
    """Send ``requests`` (``pagedserve.server.bench.serve.benchmark``) and measure them.

    Returns:
        ``benchmark``'s metrics, plus ``prefix_cache_hit_rate`` (hits / lookups, in prompt tokens, over
        ``replicas`` during the run), ``prefix_cache_hits`` and ``prefix_cache_queries`` (tokens).
    """
    hits_before, queries_before = prefix_cache_counters(options.base_url, replicas)
    metrics, _ = asyncio.run(benchmark(requests, options, None))
    hits, queries = prefix_cache_counters(options.base_url, replicas)
    hits, queries = hits - hits_before, queries - queries_before
    return metrics | {"prefix_cache_hits": hits, "prefix_cache_queries": queries,
                      "prefix_cache_hit_rate": hits / queries if queries else 0.0}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """One Markdown row per router: hit rate, TTFT p50/p99, throughput, failures."""
    lines = ["| router | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | requests/s | output tok/s | failed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for router, m in results.items():
        lines.append(f"| {router} | {m['prefix_cache_hit_rate']:.3f} | {m['p50_ttft_ms']:.0f} | {m['p99_ttft_ms']:.0f} "
                     f"| {m['request_throughput']:.2f} | {m['output_throughput']:.1f} | {m['failed']} |")
    return "\n".join(lines)


def _run_router(args: argparse.Namespace, router: str, tokenizer: Tokenizer, workload: Workload) -> dict[str, Any]:
    """Deploy fresh replicas with ``router``, warm them up, run the workload, delete them."""
    from ray import serve

    from pagedserve.engine.config import EngineArgs
    from pagedserve.server.app import ServerArgs
    from pagedserve.server.replicas.deployment import APP_NAME, build_application
    from pagedserve.server.replicas.settings import ReplicaSettings

    engine_args = EngineArgs(model=args.model, device=args.device, max_model_len=args.max_model_len,
                             num_gpu_blocks_override=args.num_gpu_blocks)
    settings = ReplicaSettings(num_replicas=args.num_replicas, request_router=router,
                               replica_num_cpus=args.replica_num_cpus, replica_num_gpus=args.replica_num_gpus)
    serve.run(build_application(engine_args, ServerArgs(log_stats_interval_s=0), settings), name=APP_NAME,
              route_prefix="/")
    try:
        base_url = f"http://127.0.0.1:{args.port}"
        options = ServeOptions(base_url=base_url, model="", max_concurrency=args.max_concurrency,
                               show_progress=False)
        replicas = replica_ids(base_url, args.num_replicas)
        warmup = replace(workload, num_prefixes=args.num_replicas, requests_per_prefix=1)
        asyncio.run(benchmark(shared_prefix_requests(tokenizer, warmup, WARMUP_SEED), options, None))
        return run_workload(shared_prefix_requests(tokenizer, workload, args.seed), options, replicas)
    finally:
        serve.delete(APP_NAME)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and benchmark each router; returns 0 when every request of every run completed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default="prefix,round_robin",
                        help="comma-separated --request-router values to compare")
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--num-prefixes", type=int, default=Workload.num_prefixes)
    parser.add_argument("--requests-per-prefix", type=int, default=Workload.requests_per_prefix)
    parser.add_argument("--prefix-len", type=int, default=Workload.prefix_len, help="tokens")
    parser.add_argument("--suffix-len", type=int, default=Workload.suffix_len, help="tokens")
    parser.add_argument("--output-len", type=int, default=Workload.output_len, help="max_tokens")
    parser.add_argument("--max-concurrency", type=int, default=8, help="requests in flight at most")
    parser.add_argument("--num-gpu-blocks", type=int, default=96,
                        help="KV cache blocks (16 tokens) per replica: 96 hold 5 prefixes of 256 tokens + 16")
    parser.add_argument("--max-model-len", type=int, default=1024, help="tokens")
    parser.add_argument("--replica-num-cpus", type=float, default=1.0, help="Ray CPUs (and torch threads) each")
    parser.add_argument("--replica-num-gpus", type=float, default=0.0,
                        help="Ray GPUs each; 0 = 1 on CUDA (0.5 puts 2 replicas on one GPU)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer", default=None, help="default: the embedded SmolLM2 GGUF's")
    parser.add_argument("--port", type=int, default=8000, help="Ray Serve's HTTP port")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from pagedserve.server.bench.dataset import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    workload = Workload(args.num_prefixes, args.requests_per_prefix, args.prefix_len, args.suffix_len,
                        args.output_len)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # a cluster of its own
    results: dict[str, dict[str, Any]] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for router in args.routers.split(","):
            results[router] = _run_router(args, router, tokenizer, workload)
            print(f"{router}: hit rate {results[router]['prefix_cache_hit_rate']:.3f}, TTFT p50 "
                  f"{results[router]['p50_ttft_ms']:.0f} ms, p99 {results[router]['p99_ttft_ms']:.0f} ms", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(format_table(results))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        record = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "command": sys.argv,
                  **{k: v for k, v in vars(args).items() if k != "result_json"}, "results": results}
        args.result_json.write_text(json.dumps(record, indent=2, default=str))
    return 0 if all(m["failed"] == 0 for m in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
