"""Load generator for any OpenAI-compatible server, after ``vllm bench serve``.

It streams every request (SSE) with ``stream_options.include_usage``, times the
chunks as they arrive, and reports throughput and TTFT/TPOT/ITL/E2E latency.
With ``--api-key`` (default: ``$OPENAI_API_KEY``) every request carries
``Authorization: Bearer <key>``, as the openai SDK sends it.

With ``--plot out.png`` it also draws the run (``server/bench/plots.py``): TTFT, TPOT
and ITL distributions and output tokens/s over time.

    python -m pagedserve.server.bench.serve --base-url http://127.0.0.1:8000 \
        --num-prompts 64 --max-concurrency 16 --input-len 64:512 --output-len 128 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from pagedserve.server.bench.dataset import (
    SyntheticRequest,
    Tokenizer,
    load_tokenizer,
    parse_len_range,
    sample_requests,
)
from pagedserve.server.bench.summary import RequestResult, compute_metrics, format_report, result_from_timestamps

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ServeOptions:
    """How to send the requests of one run."""

    base_url: str  # e.g. http://127.0.0.1:8000, with or without a trailing /v1
    model: str
    endpoint: str = "completions"  # a key of ENDPOINT_PATHS
    max_concurrency: int | None = None  # requests in flight at most; None = unlimited
    request_rate: float = float("inf")  # mean arrivals per second (Poisson); inf = all at once
    ignore_eos: bool = False
    seed: int = 0  # seeds the Poisson arrival times
    request_timeout_s: float = 3600.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    show_progress: bool = True
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token; None = no header
    headers: dict[str, str] = field(default_factory=dict)  # more HTTP headers on every request


@dataclass
class TimedResult(RequestResult):
    """A request's result that also knows when it was sent, to place its chunks on the run's clock."""

    sent_s: float = 0.0  # seconds after the run started

    def chunk_times_s(self) -> list[float]:
        """When each non-empty chunk arrived, in seconds after the run started; empty for a failure."""
        if not self.success:
            return []
        offsets = np.concatenate([[0.0], np.cumsum(self.itl_s)])
        return (self.sent_s + self.ttft_s + offsets).tolist()


class ServerRefused(RuntimeError):
    """The server is unreachable or refused the benchmark's first request; the message is one line."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header of ``api_key``, as the openai SDK sends it; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def api_root(base_url: str) -> str:
    """``http://host:port`` from a base URL that may end in ``/v1``."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def build_payload(request: SyntheticRequest, options: ServeOptions) -> dict[str, Any]:
    """The JSON body of one streamed request.

    With ``ignore_eos`` it sends vLLM's ``ignore_eos`` and llama.cpp's
    ``n_predict`` so both kinds of server generate exactly ``max_tokens``;
    OpenAI-compatible servers ignore fields they do not know.
    """
    body: dict[str, Any] = {
        "model": options.model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if options.ignore_eos:
        body |= {"ignore_eos": True, "n_predict": request.output_len}
    return body | options.extra_body


def _chunk_text(choice: dict[str, Any]) -> str:
    """Text carried by one streamed choice, completions or chat shape."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def send_request(client: httpx.AsyncClient, url: str, request: SyntheticRequest,
                       options: ServeOptions, tokenizer: Tokenizer | None) -> RequestResult:
    """Stream one request and time its chunks.

    Output tokens come from the final ``usage`` chunk; without one, the
    streamed text is re-encoded with ``tokenizer`` (or, lacking that, each
    non-empty chunk counts as one token). Never raises: failures are returned.
    """
    start = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=build_payload(request, options)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return RequestResult(success=False, error=f"HTTP {response.status_code}: {body[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                text = "".join(_chunk_text(c) for c in chunk.get("choices") or [])
                if text:
                    arrivals.append(time.perf_counter())
                    pieces.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(success=False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if not arrivals:
        return RequestResult(success=False, latency_s=end - start, error="stream carried no text")
    if usage and usage.get("completion_tokens") is not None:
        output_tokens = int(usage["completion_tokens"])
    elif tokenizer is not None:
        output_tokens = len(tokenizer.encode("".join(pieces), add_special_tokens=False))
    else:
        output_tokens = len(pieces)
    prompt_tokens = int((usage or {}).get("prompt_tokens") or request.prompt_len)
    return result_from_timestamps(start, arrivals, end, prompt_tokens, output_tokens)


async def fetch_first_model(base_url: str, api_key: str | None = None) -> str:
    """Id of the first model ``GET /v1/models`` lists.

    Raises:
        ServerRefused: when the server cannot be reached, answers other than 200 (401 without
            the right API key) or lists no model.
    """
    url = api_root(base_url) + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=30.0, headers=auth_headers(api_key)) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        raise ServerRefused(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        hint = " (pass --api-key or set OPENAI_API_KEY)" if response.status_code == 401 else ""
        raise ServerRefused(f"GET {url} answered HTTP {response.status_code}{hint}: {_error_message(response)}")
    models = response.json().get("data") or []
    if not models:
        raise ServerRefused(f"{url} lists no model")
    return models[0]["id"]


def _error_message(response: httpx.Response) -> str:
    """The message of an OpenAI error body, else the body's start, on one line."""
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return " ".join(message.split())


async def benchmark(requests: list[SyntheticRequest], options: ServeOptions,
                    tokenizer: Tokenizer | None) -> tuple[dict[str, float | int], list[TimedResult]]:
    """Send ``requests`` as ``options`` says and measure them.

    Returns:
        The aggregate metrics (see ``compute_metrics``) and per-request results,
        in dataset order, each with when it was sent after the run started.
    """
    url = api_root(options.base_url) + ENDPOINT_PATHS[options.endpoint]
    limit = options.max_concurrency or max(len(requests), 1)
    semaphore = asyncio.Semaphore(limit)
    rng = np.random.default_rng(options.seed)
    gaps_s = (rng.exponential(1.0 / options.request_rate, size=len(requests))
              if np.isfinite(options.request_rate) else np.zeros(len(requests)))
    send_times_s = np.cumsum(gaps_s)
    progress = tqdm(total=len(requests), disable=not options.show_progress, desc="requests")
    timeout = httpx.Timeout(options.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)

    headers = options.headers | auth_headers(options.api_key)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        async def run_one(request: SyntheticRequest) -> TimedResult:
            async with semaphore:
                sent_s = time.perf_counter() - start  # send_request reads its clock right after
                result = await send_request(client, url, request, options, tokenizer)
            progress.update(1)
            return TimedResult(**vars(result), sent_s=sent_s)

        start = time.perf_counter()
        tasks = []
        for request, send_at in zip(requests, send_times_s, strict=True):
            delay = start + send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run_one(request)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    progress.close()
    return compute_metrics(results, duration), results


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add this benchmark's options to ``parser`` (also used by ``pagedserve bench serve``)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    parser.add_argument("--model", default=None, help="model name; default: first of GET /v1/models")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most (default: unlimited)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="mean requests/s with Poisson arrivals (default inf: all at once)")
    parser.add_argument("--input-len", type=parse_len_range, default=(64, 512),
                        help="prompt tokens, N or MIN:MAX (uniform)")
    parser.add_argument("--output-len", type=parse_len_range, default=(128, 128),
                        help="max_tokens, N or MIN:MAX (uniform)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="ask the server to generate exactly max_tokens")
    parser.add_argument("--tokenizer", default=None,
                        help=".gguf file, folder or hub id (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset and arrival times")
    parser.add_argument("--extra-body", type=json.loads, default={},
                        help="JSON object merged into every request body")
    parser.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--result-json", type=Path, default=None, help="write metrics here")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="draw TTFT/TPOT/ITL distributions and output tok/s over time here (matplotlib)")
    parser.add_argument("--label", default="", help="free text stored in the result JSON")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer <key>' (default: $OPENAI_API_KEY)")
    return parser


def result_record(metrics: dict[str, float | int], results: list[RequestResult],
                  config: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of one run: when, configuration, metrics, per-request data."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **config,
        **metrics,
        "prompt_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts_s": [r.ttft_s for r in results],
        "errors": [r.error for r in results],
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with options parsed by a parser that ``add_cli_args`` filled.

    Returns:
        0 when at least one request completed (and ``--plot``, if given, was written), 1 otherwise
        (a server that cannot be reached or refuses the key is one line on stderr, not a traceback).
    """
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Before the run, not after it: a long run should not end without the plot it was asked for.
        print("error: --plot needs matplotlib: pip install 'matplotlib>=3.8'", file=sys.stderr)
        return 1
    # The server first: a wrong key or URL shows in a second, before the tokenizer loads.
    try:
        model = args.model or asyncio.run(fetch_first_model(args.base_url, args.api_key))
    except ServerRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tokenizer = load_tokenizer(args.tokenizer)
    requests = sample_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed)
    options = ServeOptions(
        base_url=args.base_url, model=model, endpoint=args.endpoint,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        ignore_eos=args.ignore_eos, seed=args.seed, request_timeout_s=args.request_timeout,
        extra_body=args.extra_body, show_progress=not args.no_progress, api_key=args.api_key)
    metrics, results = asyncio.run(benchmark(requests, options, tokenizer))
    print(format_report(metrics))
    for error in sorted({r.error for r in results if r.error})[:5]:
        print(f"error: {error}", file=sys.stderr)
    if args.result_json:
        # The key stays out of the file: result files are shared.
        config = {k: v for k, v in asdict(options).items() if k != "api_key"} | {
            "request_rate": args.request_rate if np.isfinite(args.request_rate) else "inf",
            "label": args.label, "num_prompts": args.num_prompts,
            "input_len": list(args.input_len), "output_len": list(args.output_len)}
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result_record(metrics, results, config), indent=2))
    plotted = _write_plot(args, options, metrics, results) if args.plot else True
    return 0 if metrics["completed"] and plotted else 1


def _write_plot(args: argparse.Namespace, options: ServeOptions, metrics: dict[str, float | int],
                results: list[TimedResult]) -> bool:
    """Draw the run to ``args.plot``; False, with why on stderr, when it cannot."""
    from pagedserve.server.bench.plots import save_serve_plot  # matplotlib loads only when a plot is asked for

    concurrency = options.max_concurrency or "unlimited"
    rate = f"{options.request_rate:g} req/s" if np.isfinite(options.request_rate) else "all at once"
    title = (f"{options.model} at {api_root(options.base_url)}{ENDPOINT_PATHS[options.endpoint]}: "
             f"{args.num_prompts} prompts, concurrency {concurrency}, {rate}"
             + (f" ({args.label})" if args.label else ""))
    try:
        path = save_serve_plot(args.plot, results, float(metrics["duration_s"]), title)
    except (ValueError, OSError) as exc:
        print(f"error: cannot write the plot {args.plot}: {exc}", file=sys.stderr)
        return False
    print(f"wrote {path}")
    return True


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default: sys.argv) and run; returns the exit code."""
    parser = add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
