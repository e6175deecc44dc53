"""Benchmark our server and the baselines on the standard scenarios (``make bench``).

Each server is started here as a subprocess on a free loopback port, waited
for (GET /health or /v1/models answering 200), sent the same prompts per
scenario, and stopped. A server that is not installed or does not come up is
skipped with a note. The whole set runs ``--repeats`` times, the servers
interleaved (ours, the peers, ours, ...), so that a machine's drift reaches all
of them alike; the report gives each figure's median and spread over the
repeats, the best llama-server format per scenario, and our servers' ratios to
it. llama.cpp runs the formats its CPU kernels are fastest in (Q4_0, Q8_0,
BF16, made from the embedded file by ``llama-quantize``) beside the shipped
Q4_1, and our GGUF path runs the same files. The Markdown report, the JSON, a
comparison plot (``server/bench/plots.py``; same file stem, ``.png``) and every
server's log (its effective settings: ubatch, flash attention, threads,
slots) land in ``benchmarks/results/``; the roofline is measured before and
after the runs.

    python -m benchmarks.run_all --servers pagedserve-gguf-q4_0,llama-server-q4_0 --scenarios P1 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.model_files import (
    WeightStats,
    default_gguf_path,
    gguf_weight_stats,
    requantized_gguf,
)
from benchmarks.roofline import (
    DTYPES,
    cpu_model,
    decode_bandwidth_bound_s,
    format_roofline,
    measure_roofline,
    model_flops_utilisation,
    num_threads,
)
from pagedserve.server.bench.dataset import (
    SyntheticRequest,
    Tokenizer,
    grounded_requests,
    load_tokenizer,
    sample_requests,
)
from pagedserve.server.bench.serve import ServeOptions, benchmark, fetch_first_model, result_record

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
LLAMA_CPP_PYTHON_CTX = 2048  # tokens; the longest scenario needs 512 + 256
CTX_SLACK = 64  # tokens per llama-server slot beyond prompt + output, for BOS/template
# The warm-up prompt has its own seed so that it primes no prefix cache for the measured prompts.
WARMUP_SEED = 2**32 - 1
# Servers without batching take one request at a time; fewer prompts give the same
# throughput and keep `make bench` to tens of minutes on 2 cores.
DEFAULT_PROMPT_CAPS = {"naive": 8, "llama-cpp-python": 32}


@dataclass(frozen=True)
class Scenario:
    """One standard load pattern. Each has its own seed so no two share prompt prefixes."""

    name: str
    kind: str
    input_len: tuple[int, int]  # tokens, inclusive range
    output_len: int  # tokens, generated in full (ignore_eos)
    concurrency: int  # requests in flight
    num_prompts: int
    seed: int

    def describe(self) -> str:
        """One line for the report."""
        low, high = self.input_len
        return (f"{self.name} = {self.kind}: input {low}–{high} tokens, output {self.output_len}, "
                f"ignore_eos, concurrency {self.concurrency}, {self.num_prompts} prompts")


SCENARIOS = {s.name: s for s in (
    Scenario("P1", "prefill-heavy", (64, 512), 128, 1, 8, seed=1),
    Scenario("P16", "prefill-heavy", (64, 512), 128, 16, 64, seed=2),
    Scenario("D64", "decode-heavy", (16, 64), 256, 64, 128, seed=3),
    # Time to answer one long prompt: the request's latency, prefill nearly all of it.
    Scenario("L2k", "long-prompt", (2000, 2000), 1, 1, 2, seed=4),
    Scenario("L8k", "long-prompt", (8000, 8000), 1, 1, 2, seed=5),
    # The output copies a passage of the prompt (server/bench/dataset.py, grounded_requests): n-gram speculation's case.
    Scenario("G1", "grounded", (384, 384), 128, 1, 8, seed=6),
    Scenario("G16", "grounded", (384, 384), 128, 16, 32, seed=7),
)}
#: What the servers named ``*-ngram`` add: prompt-lookup speculative decoding (vLLM's JSON shape).
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def scenario_requests(scenario: Scenario, tokenizer: Tokenizer) -> list[SyntheticRequest]:
    """The prompts of ``scenario``: grounded passages for the grounded kind, random text for the others."""
    if scenario.kind == "grounded":
        return grounded_requests(tokenizer, scenario.num_prompts, scenario.input_len[0], scenario.output_len,
                                 scenario.seed)
    return sample_requests(tokenizer, scenario.num_prompts, scenario.input_len,
                           (scenario.output_len, scenario.output_len), scenario.seed)


def llama_server_binary() -> str | None:
    """``$LLAMA_SERVER``, else ``llama-server`` beside this Python or on PATH."""
    return _executable("LLAMA_SERVER", "llama-server")


def llama_quantize_binary() -> str | None:
    """``$LLAMA_QUANTIZE``, else ``llama-quantize`` beside the llama-server found, beside this Python or on PATH."""
    server = llama_server_binary()
    beside_server = str(Path(server).parent / "llama-quantize") if server else None
    return _executable("LLAMA_QUANTIZE", "llama-quantize", beside_server)


def _executable(variable: str, name: str, *extra: str | None) -> str | None:
    beside_python = Path(sys.executable).parent / name
    for candidate in (os.environ.get(variable), *extra, str(beside_python), shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def amx_preload() -> str | None:
    """On a CPU with AMX, the library (``baselines/amx_permission.c``, built once) that asks Linux for the AMX
    state before llama-server's main, so its AMX kernels run instead of dying of SIGILL; else None."""
    if "amx_tile" not in Path("/proc/cpuinfo").read_text():
        return None
    from pagedserve.engine.model.c_kernels import load_c_library

    lib = load_c_library(Path(__file__).parent / "baselines" / "amx_permission.c", "llama-server's AMX permission")
    return None if lib is None else lib._name


#: The GGUF types llama.cpp's CPU kernels are fastest in, made from the embedded Q4_1 file (``requantized_gguf``).
PEER_FORMATS = ("Q4_0", "Q8_0", "BF16")


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server and what its decode steps read."""

    name: str
    command: Callable[[int, Scenario], list[str]]  # (port, scenario) -> argv
    missing: Callable[[], str | None]  # why it cannot run here, or None
    # The dtype weights are served in ("float32", "bfloat16"); None: the GGUF's own quantized bytes.
    weight_dtype: str | None
    bans_eos_by_logit_bias: bool = False  # the server ignores ignore_eos; ban EOS through logit_bias
    # The GGUF file it serves when not the embedded one (made on first use), for its weight bytes.
    model_file: Callable[[], Path] | None = None

    @property
    def compute_dtype(self) -> str:
        """The roofline whose peak MFU is measured against; llama.cpp's kernels compute in fp32."""
        return self.weight_dtype or "float32"


def _server_specs(gguf: Path) -> dict[str, ServerSpec]:
    cores = str(num_threads())
    python = sys.executable

    def no_module(module: str, install: str) -> Callable[[], str | None]:
        return lambda: None if importlib.util.find_spec(module) else f"not installed ({install})"

    def pagedserve(dtype: str, *extra: str, model: Callable[[], Path] | None = None
                   ) -> Callable[[int, Scenario], list[str]]:
        return lambda port, _: [python, "-m", "pagedserve", "serve", "--host", HOST, "--port", str(port),
                                "--dtype", dtype, *extra, *(["--model", str(model())] if model else [])]

    preload = amx_preload()

    def llama_server(model: Callable[[], Path]) -> Callable[[int, Scenario], list[str]]:
        return lambda port, s: [
            *(["env", f"LD_PRELOAD={preload}"] if preload else []), llama_server_binary() or "llama-server",
            "-m", str(model()), "--host", HOST, "--port", str(port),
            "-np", str(s.concurrency), "-c", str((s.input_len[1] + s.output_len + CTX_SLACK) * s.concurrency),
            "-t", cores, "-tb", cores, "--cont-batching", "-lv", "4"]  # -lv 4: the log states ubatch, flash attn

    def no_llama_server() -> str | None:
        return None if llama_server_binary() else "binary not found (see benchmarks/baselines/README.md)"

    def no_llama_quantize() -> str | None:
        if llama_quantize_binary() is None:
            return "llama-quantize not found, to make the file (see benchmarks/baselines/README.md)"
        return None

    def no_peer_file() -> str | None:
        return no_llama_server() or no_llama_quantize()

    def requantized(fmt: str) -> Callable[[], Path]:
        return lambda: requantized_gguf(fmt, llama_quantize_binary() or "llama-quantize", gguf)

    specs = [
        ServerSpec("pagedserve", pagedserve("float32"), missing=lambda: None, weight_dtype="float32"),
        ServerSpec("pagedserve-bf16", pagedserve("bfloat16"), missing=lambda: None, weight_dtype="bfloat16"),
        # The GGUF's Q4_1/Q8_0 blocks multiplied as they are (pagedserve.engine.model.quant_kernels), as llama.cpp does.
        ServerSpec("pagedserve-gguf", pagedserve("float32", "--quantization", "gguf"), missing=lambda: None,
                   weight_dtype=None),
        ServerSpec("pagedserve-gguf-ngram", pagedserve("float32", "--quantization", "gguf", "--speculative-config",
                                                       NGRAM_CONFIG), missing=lambda: None, weight_dtype=None),
        # The layer-by-layer decode: what the fused decode step (pagedserve.engine.model.fused_decode) buys, in one run.
        ServerSpec("pagedserve-gguf-unfused", lambda port, s: [
            "env", "PAGEDSERVE_FUSED_DECODE=0", *pagedserve("float32", "--quantization", "gguf")(port, s)],
                   missing=lambda: None, weight_dtype=None),
        # The dashboard's step records off: their cost is the ratio to pagedserve-bf16 in one run.
        ServerSpec("pagedserve-bf16-no-records", pagedserve("bfloat16", "--step-record-buffer-size", "0"),
                   missing=lambda: None, weight_dtype="bfloat16"),
        ServerSpec("naive", lambda port, _: [python, "-m", "benchmarks.baselines.naive_server",
                                             "--host", HOST, "--port", str(port)],
                   missing=lambda: None, weight_dtype="float32"),
        ServerSpec("llama-cpp-python", lambda port, _: [
            python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", HOST, "--port", str(port),
            "--interrupt_requests", "False", "--n_threads", cores, "--n_threads_batch", cores,
            "--n_ctx", str(LLAMA_CPP_PYTHON_CTX)],
                   missing=no_module("llama_cpp", "see benchmarks/baselines/README.md"),
                   weight_dtype=None, bans_eos_by_logit_bias=True),
        ServerSpec("llama-server", llama_server(lambda: gguf), missing=no_llama_server, weight_dtype=None),
    ]
    for fmt in PEER_FORMATS:
        model, suffix = requantized(fmt), fmt.lower()
        weight_dtype = "bfloat16" if fmt == "BF16" else None
        specs.append(ServerSpec(f"llama-server-{suffix}", llama_server(model), missing=no_peer_file,
                                weight_dtype=weight_dtype, model_file=model))
        if weight_dtype is None:  # our GGUF path on the same blocks (BF16 is pagedserve-bf16's weights)
            specs.append(ServerSpec(f"pagedserve-gguf-{suffix}", pagedserve("float32", "--quantization", "gguf",
                                                                            model=model),
                                    missing=no_llama_quantize, weight_dtype=None, model_file=model))
    return {s.name: s for s in specs}


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        """Start ``command`` in ``cwd`` (default: this repository), with ``env`` added to this process's
        environment and its output in ``log_dir``."""
        self.command = command
        self.port = port
        self.base_url = f"http://{HOST}:{port}"
        self.log_path = log_dir / f"{name}-{port}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, cwd=cwd or REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            env=os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {}),
                                            start_new_session=True)

    def wait_ready(self, timeout_s: float) -> str | None:
        """Poll until the server answers; returns None when ready, else why not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return f"exited with code {self.process.returncode}"
            for path in ("/health", "/v1/models"):
                try:
                    if httpx.get(self.base_url + path, timeout=2.0).status_code == 200:
                        return None
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        return f"not ready within {timeout_s:.0f} s"

    def log_tail(self, num_lines: int = 5) -> str:
        """Last lines of the server's output, for a skip note."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(line.strip() for line in lines[-num_lines:])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 20 s."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its children (tensor-parallel ranks, compile helpers), in MiB."""
    pids = [pid] + [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    total_kib = 0
    for one in pids:
        for line in Path(f"/proc/{one}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


def eos_logit_bias(tokenizer: Tokenizer) -> dict[str, Any]:
    """Request fields that make greedy decoding never pick a special token (EOS included)."""
    return {"logit_bias": {str(i): -100.0 for i in tokenizer.all_special_ids}}


def run_scenario(server: ServerProcess, spec: ServerSpec, scenario: Scenario,
                 requests: list[SyntheticRequest], tokenizer: Tokenizer) -> dict[str, Any]:
    """Warm the server up with one short request of its own, then measure ``requests``."""
    model = asyncio.run(fetch_first_model(server.base_url))
    options = ServeOptions(base_url=server.base_url, model=model, max_concurrency=scenario.concurrency,
                           ignore_eos=True, seed=scenario.seed,
                           extra_body=eos_logit_bias(tokenizer) if spec.bans_eos_by_logit_bias else {},
                           show_progress=False)
    warmup = sample_requests(tokenizer, 1, (32, 32), (4, 4), seed=WARMUP_SEED)
    asyncio.run(benchmark(warmup, options, tokenizer))
    before = spec_decode_counts(server.base_url)
    metrics, results = asyncio.run(benchmark(requests, replace(options, show_progress=True), tokenizer))
    after = spec_decode_counts(server.base_url)
    config = {"server": spec.name, "scenario": scenario.name, "num_prompts": len(requests),
              "max_concurrency": scenario.concurrency, "command": server.command}
    record = result_record(metrics, results, config)
    if before and after and (drafted := after["draft_tokens"] - before["draft_tokens"]) > 0:
        record["spec_decode_acceptance_rate"] = (after["accepted_tokens"] - before["accepted_tokens"]) / drafted
    return record


#: vLLM's speculative-decoding counters, as ``/metrics`` exposes them.
SPEC_DECODE_COUNTERS = {"draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                        "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def spec_decode_counts(base_url: str) -> dict[str, float] | None:
    """The server's draft and accepted token counters, summed over labels; None when it has no such metrics."""
    try:
        response = httpx.get(base_url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    counts = dict.fromkeys(SPEC_DECODE_COUNTERS, 0.0)
    found = False
    for line in response.text.splitlines():
        for key, name in SPEC_DECODE_COUNTERS.items():
            if line.startswith(name) and line[len(name)] in " {":
                counts[key] += float(line.rsplit(" ", 1)[1])
                found = True
    return counts if found else None


def add_derived_metrics(run: dict[str, Any], spec: ServerSpec, weights: WeightStats,
                        roofline: dict[str, Any]) -> None:
    """Add MFU and, at concurrency 1, the bandwidth bound per output token (ms) to ``run``."""
    run["mfu"] = model_flops_utilisation(
        run["total_prompt_tokens"], run["total_output_tokens"], weights.non_embedding_params,
        weights.all_params, run["duration_s"], roofline["peak_matmul_flops"][spec.compute_dtype])
    run["mfu_dtype"] = spec.compute_dtype
    weight_bytes = (weights.all_params * DTYPES[spec.weight_dtype].itemsize if spec.weight_dtype
                    else weights.weight_bytes)
    run["decode_weight_bytes"] = weight_bytes
    if run["max_concurrency"] == 1:
        run["bandwidth_bound_ms_per_token"] = 1000 * decode_bandwidth_bound_s(
            weight_bytes, roofline["gemv_bandwidth_bytes_per_s"])


def _row(run: dict[str, Any]) -> str:
    bound = run.get("bandwidth_bound_ms_per_token")
    cells = [
        run["server"], run["scenario"], str(run["num_prompts"]), f"{run['completed']}/{run['failed']}",
        f"{run['duration_s']:.1f}", f"{run['request_throughput']:.2f}", f"{run['output_throughput']:.1f}",
        f"{run['total_token_throughput']:.1f}", f"{run['mean_output_tokens']:.0f}",
        f"{run['p50_ttft_ms']:.0f} / {run['p99_ttft_ms']:.0f}",
        f"{run['mean_tpot_ms']:.1f} / {run['p50_tpot_ms']:.1f}", f"{run['p50_itl_ms']:.1f}",
        f"{run['p50_e2el_ms']:.0f} / {run['p99_e2el_ms']:.0f}", f"{100 * run['mfu']:.2f}",
        f"{bound:.2f}" if bound is not None else "–",
        f"{100 * rate:.0f}" if (rate := run.get("spec_decode_acceptance_rate")) is not None else "–",
    ]
    return "| " + " | ".join(cells) + " |"


def headline_metric(scenario: Scenario) -> tuple[str, bool]:
    """The figure the summary ranks servers by in ``scenario``, and whether lower is better: the one a user
    feels, time per output token for one user, time to answer a long prompt, output throughput under load."""
    if scenario.kind == "long-prompt":
        return "p50_e2el_ms", True
    if scenario.concurrency == 1:
        return "p50_tpot_ms", True
    return "output_throughput", False


SUMMARY_METRICS = ("output_throughput", "p50_tpot_ms", "p50_ttft_ms", "p50_e2el_ms")
PEER_PREFIX = "llama-server"


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median, min and max of ``SUMMARY_METRICS`` per (server, scenario) over the repeats, in run order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["server"], run["scenario"]), []).append(run)
    return [{"server": server, "scenario": scenario, "repeats": len(group),
             **{m: {"median": statistics.median(r[m] for r in group), "min": min(r[m] for r in group),
                    "max": max(r[m] for r in group)} for m in SUMMARY_METRICS}}
            for (server, scenario), group in groups.items()]


def compare_to_best_peer(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario: the best llama-server format by its headline metric (median), and each of our servers'
    ratio to it (ours / best: below 1 is better for times, above 1 for throughput)."""
    rows = []
    for name, scenario in SCENARIOS.items():
        metric, lower_is_better = headline_metric(scenario)
        entries = [e for e in summary if e["scenario"] == name]
        peers = [e for e in entries if e["server"].startswith(PEER_PREFIX)]
        if not peers:
            continue
        best = (min if lower_is_better else max)(peers, key=lambda e: e[metric]["median"])
        for ours in (e for e in entries if not e["server"].startswith(PEER_PREFIX)):
            rows.append({"scenario": name, "metric": metric, "server": ours["server"],
                         "value": ours[metric]["median"], "best_peer": best["server"],
                         "peer_value": best[metric]["median"],
                         "ratio": ours[metric]["median"] / best[metric]["median"]})
    return rows


def _summary_lines(report: dict[str, Any]) -> list[str]:
    def cell(entry: dict[str, Any], metric: str, digits: int) -> str:
        stats = entry[metric]
        return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"

    lines = ["", "Medians over the interleaved repeats (min–max):", "",
             "| server | scenario | repeats | out tok/s | TPOT p50 ms | TTFT p50 ms | E2E p50 ms |", "|" + "---|" * 7]
    lines += [f"| {e['server']} | {e['scenario']} | {e['repeats']} | {cell(e, 'output_throughput', 1)} "
              f"| {cell(e, 'p50_tpot_ms', 1)} | {cell(e, 'p50_ttft_ms', 0)} | {cell(e, 'p50_e2el_ms', 0)} |"
              for e in report["summary"]]
    if report["versus_best_peer"]:
        lines += ["", "Against llama-server's best format per scenario (medians; ours ÷ best):", "",
                  "| scenario | figure | server | ours | llama-server (best) | best format | ours ÷ best |",
                  "|" + "---|" * 7]
        lines += [f"| {r['scenario']} | {r['metric']} | {r['server']} | {r['value']:.1f} | {r['peer_value']:.1f} "
                  f"| {r['best_peer']} | {r['ratio']:.2f}x |" for r in report["versus_best_peer"]]
    return lines


def markdown_report(report: dict[str, Any]) -> str:
    """The human-readable report: machine, roofline, scenarios, one table row per run, skips."""
    machine, roof, weights = report["machine"], report["roofline"], report["model"]
    bw = roof["gemv_bandwidth_bytes_per_s"]
    rows = " / ".join(next(iter(roof["matmul_flops"].values())))
    flops = "; ".join(f"{name} " + " / ".join(f"{f / 1e9:.1f}" for f in by_rows.values())
                      + f" (peak {roof['peak_matmul_flops'][name] / 1e9:.1f})"
                      for name, by_rows in roof["matmul_flops"].items())
    bounds = ", ".join(f"{1000 * decode_bandwidth_bound_s(dtype.itemsize * weights['all_params'], bw):.1f} "
                       f"ms/token with {name} weights" for name, dtype in DTYPES.items())
    after = report.get("roofline_after")
    lines = [
        f"# Serving benchmark, {report['date']}", "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"Python {machine['python']}.",
        f"Model: {weights['file']} ({weights['all_params'] / 1e6:.1f} M parameters, "
        f"{weights['non_embedding_params'] / 1e6:.1f} M without embedding; "
        f"{weights['weight_bytes'] / 1e6:.1f} MB as stored, "
        f"{4 * weights['all_params'] / 1e6:.1f} MB in fp32).",
        "",
        f"Roofline: matmul at the model's GEMMs, M = {rows} token rows, GFLOP/s: {flops}; memory bandwidth "
        f"(copy) {roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, read by a matrix-vector product {bw / 1e9:.1f} "
        f"GB/s. Batch-1 decode bound (weights / GEMV bandwidth): {bounds}, "
        f"{1000 * decode_bandwidth_bound_s(weights['weight_bytes'], bw):.1f} ms/token with the GGUF's."
        + (f" After the runs: copy {after['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, GEMV "
           f"{after['gemv_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s." if after else ""),
        "",
        "Scenarios:", *[f"- {line}" for line in report["scenarios"]], "",
        "| server | scenario | prompts | ok/failed | duration s | req/s | out tok/s | total tok/s "
        "| mean out len | TTFT p50/p99 ms | TPOT mean/p50 ms | ITL p50 ms | E2E p50/p99 ms | MFU % "
        "| BW bound ms/tok | draft acceptance % |",
        "|" + "---|" * 16,
        *[_row(run) for run in report["runs"]],
        "",
        "MFU = (prompt tokens × 2 × non-embedding params + output tokens × 2 × all params) / duration "
        "/ peak matmul FLOP/s in the server's compute dtype (bf16 peak for pagedserve-bf16, fp32 for the "
        "rest; llama.cpp computes in its quantized kernels, so its MFU is against the fp32 peak). "
        "BW bound = weight bytes a decode step reads / GEMV bandwidth (concurrency 1 only); compare with TPOT. "
        "Draft acceptance = accepted / drafted tokens over the run (speculative decoding, the *-ngram servers). "
        "A long-prompt scenario's time to answer is its E2E latency. "
        "A mean output length under the scenario's means the server stopped "
        "at EOS. The load generator shares the CPU with the server.",
        *_summary_lines(report),
    ]
    if report.get("logs"):
        lines += ["", f"Server logs (effective settings): `{report['logs']}`."]
    if report["skipped"]:
        lines += ["", "Skipped:", *[f"- {s['server']}: {s['reason']}" for s in report["skipped"]]]
    return "\n".join(lines) + "\n"


def _parse_caps(items: list[str]) -> dict[str, int]:
    caps = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise argparse.ArgumentTypeError(f"--prompt-cap wants NAME=N, got {item!r}")
        caps[name] = int(value)
    return caps


#: ``make bench``: our bf16 and GGUF paths against llama-server on the shipped file and on the formats it is
#: fastest in, ours on the same files. The rest (fp32, n-gram speculation, the Python baselines, ...) answer
#: one question each and run when named.
DEFAULT_SERVERS = ("pagedserve-bf16", "pagedserve-gguf", "pagedserve-gguf-q4_0", "pagedserve-gguf-q8_0",
                   "llama-server", "llama-server-q4_0", "llama-server-q8_0", "llama-server-bf16")


def parse_args(argv: list[str] | None, server_names: list[str]) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help=f"comma-separated subset of {','.join(server_names)} (default: "
                             f"{','.join(DEFAULT_SERVERS)}: ours against llama-server at its best)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per scenario (overrides all)")
    parser.add_argument("--prompt-cap", action="append", default=[],
                        help="NAME=N: at most N prompts per scenario for server NAME "
                        f"(defaults: {', '.join(f'{k}={v}' for k, v in DEFAULT_PROMPT_CAPS.items())})")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for a server")
    parser.add_argument("--roofline-time", type=float, default=0.5, help="seconds per roofline measurement")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times the whole set runs, the servers interleaved in each (default 3)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.prompt_cap = DEFAULT_PROMPT_CAPS | _parse_caps(args.prompt_cap)
    args.servers = args.servers.split(",")
    args.scenarios = args.scenarios.split(",")
    for name in args.servers:
        if name not in server_names:
            parser.error(f"unknown server {name!r}")
    for name in args.scenarios:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}")
    return args


def benchmark_server(spec: ServerSpec, scenarios: list[Scenario], datasets: dict[str, list[SyntheticRequest]],
                     cap: int | None, tokenizer: Tokenizer, startup_timeout_s: float,
                     log_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Run ``scenarios`` against one server, restarting it only when its command changes.

    Returns:
        Result records of the runs, and skip notes.
    """
    runs: list[dict[str, Any]] = []
    server: ServerProcess | None = None
    try:
        for scenario in scenarios:
            if server is None or spec.command(server.port, scenario) != server.command:
                if server is not None:
                    server.stop()
                port = free_port()
                print(f"[{spec.name}] starting for {scenario.name} (log {log_dir})", flush=True)
                server = ServerProcess(spec.name, spec.command(port, scenario), port, log_dir)
                why = server.wait_ready(startup_timeout_s)
                if why is not None:
                    return runs, [{"server": spec.name, "reason": f"{why}: {server.log_tail()}"}]
            requests = datasets[scenario.name][:cap]
            print(f"[{spec.name}] {scenario.describe()} -> {len(requests)} prompts", flush=True)
            runs.append(run_scenario(server, spec, scenario, requests, tokenizer))
    finally:
        if server is not None:
            server.stop()
    return runs, []


def main(argv: list[str] | None = None) -> int:
    """Run the selected servers and scenarios; write ``bench-<UTC time>.md/.json/.png``."""
    gguf = default_gguf_path()
    specs = _server_specs(gguf)
    args = parse_args(argv, list(specs))
    scenarios = [SCENARIOS[name] for name in args.scenarios]
    if args.num_prompts is not None:
        scenarios = [replace(s, num_prompts=args.num_prompts) for s in scenarios]
    weights = gguf_weight_stats(gguf)
    tokenizer = load_tokenizer(str(gguf))
    datasets = {s.name: scenario_requests(s, tokenizer) for s in scenarios}
    roofline = measure_roofline(args.roofline_time)
    print(format_roofline(roofline), flush=True)

    log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for repeat in range(args.repeats):
        for name in args.servers:
            if name in skipped:
                continue
            spec = specs[name]
            reason = spec.missing()
            if reason is None:
                server_runs, server_skips = benchmark_server(spec, scenarios, datasets, args.prompt_cap.get(name),
                                                             tokenizer, args.startup_timeout, log_dir)
                reason = server_skips[0]["reason"] if server_skips else None
                served = gguf_weight_stats(spec.model_file()) if spec.model_file else weights
                for run in server_runs:
                    add_derived_metrics(run, spec, served, roofline)
                    run["repeat"] = repeat
                runs += server_runs
            if reason is not None:
                print(f"[{name}] skipped: {reason}", flush=True)
                skipped[name] = reason
    roofline_after = measure_roofline(args.roofline_time)

    now = datetime.now(UTC)
    report = {
        "date": now.isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "model": {"file": gguf.name, **asdict(weights), "non_embedding_params": weights.non_embedding_params},
        "roofline": roofline,
        "roofline_after": roofline_after,
        "scenarios": [s.describe() for s in scenarios],
        "repeats": args.repeats,
        "runs": runs,
        "summary": (summary := summarize(runs)),
        "versus_best_peer": compare_to_best_peer(summary),
        "skipped": [{"server": name, "reason": reason} for name, reason in skipped.items()],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"bench-{now.strftime('%Y%m%d-%H%M%S')}"
    logs = stem.with_name(stem.name + "-logs")
    shutil.copytree(log_dir, logs)
    report["logs"] = str(logs.relative_to(REPO_ROOT) if logs.is_relative_to(REPO_ROOT) else logs)
    markdown = markdown_report(report)
    # The results first: a plot that cannot be drawn must not lose them.
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown)
    plotted = False
    if runs:
        try:
            from pagedserve.server.bench.plots import save_comparison_plot  # matplotlib: the bench extra

            plot = save_comparison_plot(stem.with_suffix(".png"), runs, title=comparison_title(report))
        except (ImportError, ValueError, OSError) as exc:
            print(f"no comparison plot: {exc}", file=sys.stderr)
        else:
            markdown += f"\n![output tok/s, TTFT and TPOT per server and scenario]({plot.name})\n"
            stem.with_suffix(".md").write_text(markdown)
            plotted = True
    print(markdown)
    print(f"wrote {stem}.md and {stem}.json" + (f" and {stem}.png" if plotted else ""))
    return 0 if runs else 1


def comparison_title(report: dict[str, Any]) -> str:
    """The comparison plot's title: date, machine and model of the report."""
    machine = report["machine"]
    return (f"Serving benchmark, {report['date']}: {machine['cpu']}, {machine['cores']} cores, "
            f"{report['model']['file']}")


if __name__ == "__main__":
    sys.exit(main())
