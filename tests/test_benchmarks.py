"""Benchmark tooling: dataset, metrics, the load generator against a fake server, MFU.

No model weights or real tokenizer are loaded: a word-level fake tokenizer
stands in, and a tiny in-process SSE server plays the OpenAI API.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.roofline import decode_bandwidth_bound_s, model_flops_utilisation
from pagedserve.server.bench import serve
from pagedserve.server.bench.dataset import SyntheticRequest, parse_len_range, sample_requests
from pagedserve.server.bench.summary import RequestResult, compute_metrics, result_from_timestamps

FAKE_TOKENS = ["alpha", "beta", "gamma", "delta", "epsilon"]  # streamed one per chunk
FAKE_PROMPT_TOKENS = 7


class WordTokenizer:
    """One token per space-separated word ``w<id>``; ids 0 and 1 are special."""

    vocab_size = 100
    all_special_ids = [0, 1]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(word[1:]) if word.startswith("w") and word[1:].isdigit() else 2 for word in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in token_ids)


def test_dataset_is_deterministic_for_a_seed_and_lengths_stay_in_range() -> None:
    tok = WordTokenizer()
    first = sample_requests(tok, 20, (4, 9), (3, 5), seed=7)
    assert first == sample_requests(tok, 20, (4, 9), (3, 5), seed=7)
    assert first != sample_requests(tok, 20, (4, 9), (3, 5), seed=8)
    for request in first:
        assert 4 <= request.prompt_len <= 9
        assert request.prompt_len == len(tok.encode(request.prompt))
        assert 3 <= request.output_len <= 5
        assert not {0, 1} & set(tok.encode(request.prompt))


def test_dataset_prefix_is_the_same_whatever_the_prompt_count() -> None:
    tok = WordTokenizer()
    assert sample_requests(tok, 3, (4, 9), (3, 5)) == sample_requests(tok, 10, (4, 9), (3, 5))[:3]


def test_length_range_parses_single_ints_and_rejects_inverted_bounds() -> None:
    assert parse_len_range("64:512") == (64, 512)
    assert parse_len_range("128") == (128, 128)
    with pytest.raises(ValueError):
        parse_len_range("9:4")
    with pytest.raises(ValueError):
        parse_len_range("a:b")


def test_ttft_itl_tpot_come_from_chunk_timestamps() -> None:
    result = result_from_timestamps(start_s=10.0, arrivals_s=[10.5, 10.6, 10.8, 11.1], end_s=11.1,
                                    prompt_tokens=5, output_tokens=4)
    assert result.ttft_s == pytest.approx(0.5)
    assert result.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert result.latency_s == pytest.approx(1.1)
    assert result.tpot_s == pytest.approx(0.6 / 3)
    assert result_from_timestamps(0.0, [0.2], 0.2, 5, 1).tpot_s is None


def test_metrics_aggregate_percentiles_and_skip_failures() -> None:
    results = [RequestResult(True, prompt_tokens=10, output_tokens=11, ttft_s=t, itl_s=[0.01] * 10,
                             latency_s=t + 1.0) for t in (0.1, 0.2, 0.3, 0.4, 0.5)]
    results.append(RequestResult(False, error="HTTP 500"))
    m = compute_metrics(results, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (5, 1)
    assert m["total_prompt_tokens"] == 50 and m["total_output_tokens"] == 55
    assert m["request_throughput"] == pytest.approx(2.5)
    assert m["output_throughput"] == pytest.approx(27.5)
    assert m["total_token_throughput"] == pytest.approx(52.5)
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["p50_ttft_ms"] == pytest.approx(300.0)
    assert m["p90_ttft_ms"] == pytest.approx(460.0)  # linear interpolation between 400 and 500
    assert m["p99_e2el_ms"] == pytest.approx(1496.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # 1.0 s over 10 tokens after the first
    assert m["p99_itl_ms"] == pytest.approx(10.0)


def test_mfu_and_bandwidth_bound_on_known_numbers() -> None:
    # 100 prompt tokens * 2 * 1e6 + 10 output tokens * 2 * 2e6 = 2.4e8 FLOPs in 2 s = 1.2e8 FLOP/s.
    assert model_flops_utilisation(100, 10, 10**6, 2 * 10**6, 2.0, 1.2e9) == pytest.approx(0.1)
    assert decode_bandwidth_bound_s(540 * 10**6, 20e9) == pytest.approx(0.027)
    with pytest.raises(ValueError):
        model_flops_utilisation(1, 1, 1, 1, 0.0, 1.0)


FAKE_REFUSED_KEY = "Bearer refused-key"


def _fake_openai_app() -> FastAPI:
    """Streams FAKE_TOKENS one per chunk, then usage unless the body says ``omit_usage``.

    It records each request's ``Authorization`` header in ``app.state.authorizations`` and answers
    ``FAKE_REFUSED_KEY`` with a 401 in OpenAI's error shape.
    """
    app = FastAPI()
    app.state.authorizations = []

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Any:
        app.state.authorizations.append(request.headers.get("authorization"))
        if request.headers.get("authorization") == FAKE_REFUSED_KEY:
            error = {"message": "Incorrect API key provided.", "type": "invalid_request_error", "param": None,
                     "code": "invalid_api_key"}
            return JSONResponse({"error": error}, status_code=401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        assert body["stream"] and body["model"] == "fake-model"

        async def events() -> AsyncIterator[str]:
            for token in FAKE_TOKENS:
                await asyncio.sleep(0.005)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f'w{len(token)} '}]})}\n\n"
            if body["stream_options"]["include_usage"] and not body.get("omit_usage"):
                usage = {"prompt_tokens": FAKE_PROMPT_TOKENS, "completion_tokens": len(FAKE_TOKENS)}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_app() -> FastAPI:
    return _fake_openai_app()


@pytest.fixture(scope="module")
def fake_server(fake_app: FastAPI) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake_app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server.should_exit = True
    thread.join(timeout=5)


def _requests(n: int) -> list[SyntheticRequest]:
    return [SyntheticRequest(prompt="w5 w6 w7", prompt_len=3, output_len=5) for _ in range(n)]


def test_serve_counts_tokens_from_the_usage_chunk(fake_server: str) -> None:
    model = asyncio.run(serve.fetch_first_model(fake_server))
    options = serve.ServeOptions(base_url=fake_server, model=model, max_concurrency=2, show_progress=False)
    metrics, results = asyncio.run(serve.benchmark(_requests(6), options, tokenizer=None))
    assert (metrics["completed"], metrics["failed"]) == (6, 0)
    assert metrics["total_output_tokens"] == 6 * len(FAKE_TOKENS)
    assert metrics["total_prompt_tokens"] == 6 * FAKE_PROMPT_TOKENS
    assert all(len(r.itl_s) == len(FAKE_TOKENS) - 1 and r.ttft_s > 0 for r in results)


def test_serve_falls_back_to_the_tokenizer_without_usage(fake_server: str) -> None:
    options = serve.ServeOptions(base_url=fake_server, model="fake-model", show_progress=False,
                                 extra_body={"omit_usage": True})
    metrics, _ = asyncio.run(serve.benchmark(_requests(2), options, tokenizer=WordTokenizer()))
    assert metrics["total_output_tokens"] == 2 * len(FAKE_TOKENS)
    assert metrics["total_prompt_tokens"] == 2 * 3  # the dataset's count


def test_serve_main_writes_the_result_json(fake_server: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pagedserve.server.bench.serve.load_tokenizer", lambda name: WordTokenizer())
    out = tmp_path / "result.json"
    code = serve.main(["--base-url", fake_server, "--num-prompts", "3", "--input-len", "4:6",
                       "--output-len", "5", "--ignore-eos", "--request-rate", "100",
                       "--result-json", str(out), "--label", "fake", "--no-progress"])
    record = json.loads(out.read_text())
    assert code == 0
    assert record["completed"] == 3 and record["label"] == "fake" and record["model"] == "fake-model"
    assert record["total_output_tokens"] == 3 * len(FAKE_TOKENS)


def test_api_key_is_sent_as_a_bearer_token_on_every_request(
        fake_server: str, fake_app: FastAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pagedserve.server.bench.serve.load_tokenizer", lambda name: WordTokenizer())
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    out = tmp_path / "result.json"
    fake_app.state.authorizations.clear()
    argv = ["--base-url", fake_server, "--num-prompts", "2", "--input-len", "4", "--output-len", "5",
            "--no-progress", "--result-json", str(out)]
    assert serve.main(argv) == 0
    assert fake_app.state.authorizations == ["Bearer from-env"] * 3  # /v1/models, then 2 completions
    fake_app.state.authorizations.clear()
    assert serve.main([*argv, "--api-key", "from-flag"]) == 0
    assert fake_app.state.authorizations == ["Bearer from-flag"] * 3
    assert "from-flag" not in out.read_text()  # the key stays out of the result file
    monkeypatch.delenv("OPENAI_API_KEY")
    fake_app.state.authorizations.clear()
    assert serve.main(argv) == 0
    assert fake_app.state.authorizations == [None] * 3


def test_refused_api_key_is_one_line_not_a_traceback(fake_server: str, capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = []
    monkeypatch.setattr("pagedserve.server.bench.serve.load_tokenizer", lambda name: loaded.append(name))
    code = serve.main(["--base-url", fake_server, "--api-key", FAKE_REFUSED_KEY.removeprefix("Bearer "),
                       "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and not loaded  # the server was asked before the tokenizer loaded
    assert err.splitlines() == [
        f"error: GET {serve.api_root(fake_server)}/v1/models answered HTTP 401 (pass --api-key or set "
        "OPENAI_API_KEY): Incorrect API key provided."]
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert serve.main(["--base-url", closed, "--no-progress"]) == 1
    assert capsys.readouterr().err.startswith(f"error: GET {closed}/v1/models failed: ConnectError")


def test_ignore_eos_sends_vllm_and_llama_cpp_fields() -> None:
    options = serve.ServeOptions(base_url="http://x", model="m", endpoint="chat", ignore_eos=True)
    body = serve.build_payload(SyntheticRequest("hi", 1, 32), options)
    assert body["ignore_eos"] is True and body["n_predict"] == 32 and body["max_tokens"] == 32
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream_options"] == {"include_usage": True}


def test_run_all_skips_a_server_that_exits_at_startup(tmp_path: Path) -> None:
    from benchmarks import run_all

    spec = run_all.ServerSpec("broken", lambda port, s: [sys.executable, "-c", "raise SystemExit(3)"],
                              missing=lambda: None, weight_dtype="float32")
    scenario = run_all.SCENARIOS["P1"]
    runs, skipped = run_all.benchmark_server(spec, [scenario], {"P1": _requests(1)}, None,
                                             WordTokenizer(), startup_timeout_s=10, log_dir=tmp_path)
    assert runs == []
    assert skipped[0]["server"] == "broken" and "exited with code 3" in skipped[0]["reason"]


def test_run_all_adds_mfu_and_the_batch_1_bandwidth_bound() -> None:
    from benchmarks import run_all
    from benchmarks.model_files import WeightStats

    weights = WeightStats(weight_bytes=10**6, all_params=2 * 10**6, embedding_params=10**6)
    roofline = {"peak_matmul_flops": {"float32": 1.2e9, "bfloat16": 2.4e9}, "bandwidth_bytes_per_s": 5e9,
                "gemv_bandwidth_bytes_per_s": 8e9}
    expected = {  # weight dtype -> (MFU, bound in ms): 8 MB of fp32 weights at 8 GB/s take 1 ms
        "float32": (0.1, 1.0), "bfloat16": (0.05, 0.5), None: (0.1, 0.125)}
    for weight_dtype, (mfu, bound_ms) in expected.items():
        spec = run_all.ServerSpec("x", lambda port, s: [], missing=lambda: None, weight_dtype=weight_dtype)
        run = {"total_prompt_tokens": 100, "total_output_tokens": 10, "duration_s": 2.0, "max_concurrency": 1}
        run_all.add_derived_metrics(run, spec, weights, roofline)
        assert run["mfu"] == pytest.approx(mfu), weight_dtype
        assert run["bandwidth_bound_ms_per_token"] == pytest.approx(bound_ms), weight_dtype


def test_run_all_summarizes_repeats_and_compares_with_the_best_peer_format() -> None:
    """Medians over interleaved repeats; per scenario the best llama-server format by the figure a user feels
    (TPOT for one user, output tok/s under load), and our servers' ratios to it."""
    from benchmarks import run_all

    def run(server: str, scenario: str, tpot: float, throughput: float) -> dict:
        return {"server": server, "scenario": scenario, "output_throughput": throughput, "p50_tpot_ms": tpot,
                "p50_ttft_ms": 50.0, "p50_e2el_ms": 1000.0}

    runs = [run("pagedserve-gguf", "P1", tpot, 0) for tpot in (6.0, 9.0, 7.0)]
    runs += [run("llama-server", "P1", tpot, 0) for tpot in (12.0, 11.0, 13.0)]  # Q4_1, the slow format
    runs += [run("llama-server-q4_0", "P1", tpot, 0) for tpot in (8.0, 7.5, 9.0)]
    runs += [run("pagedserve-gguf", "P16", 0, tput) for tput in (300.0, 320.0, 310.0)]
    runs += [run("llama-server-bf16", "P16", 0, tput) for tput in (100.0, 110.0, 90.0)]
    summary = run_all.summarize(runs)
    ours = next(e for e in summary if e["server"] == "pagedserve-gguf" and e["scenario"] == "P1")
    assert ours["repeats"] == 3 and ours["p50_tpot_ms"] == {"median": 7.0, "min": 6.0, "max": 9.0}
    rows = {(r["scenario"], r["server"]): r for r in run_all.compare_to_best_peer(summary)}
    assert rows["P1", "pagedserve-gguf"]["best_peer"] == "llama-server-q4_0"
    assert rows["P1", "pagedserve-gguf"]["ratio"] == pytest.approx(7.0 / 8.0)
    assert rows["P16", "pagedserve-gguf"]["ratio"] == pytest.approx(310.0 / 100.0)
    assert set(rows) == {("P1", "pagedserve-gguf"), ("P16", "pagedserve-gguf")}


def test_requantized_files_are_made_once_by_llama_quantize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.model_files import requantized_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    fake = tmp_path / "llama-quantize"  # appends its arguments to `calls`, writes "<source> as <type>"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "$(cat $2) as $4" > $3\n')
    fake.chmod(0o755)
    source = tmp_path / "Model-1B.Q4_1.gguf"
    source.write_text("weights")
    for _ in range(2):
        made = requantized_gguf("Q4_0", str(fake), source)
    assert made.name == "Model-1B.Q4_0.gguf" and made.read_text() == "weights as Q4_0\n"
    assert calls.read_text().splitlines() == [f"--allow-requantize {source} {made.with_suffix('')}"
                                              f".partial-{os.getpid()} Q4_0"]


def test_the_amx_permission_preload_builds_and_loads_anywhere() -> None:
    """On a CPU without AMX its request fails harmlessly; run_all preloads it only where /proc/cpuinfo has AMX."""
    from benchmarks import run_all
    from pagedserve.engine.model.c_kernels import load_c_library

    lib = load_c_library(Path(run_all.__file__).parent / "baselines" / "amx_permission.c", "a test")
    assert lib is not None and lib.amx_permission_loaded() == 1
    assert (run_all.amx_preload() is not None) == ("amx_tile" in Path("/proc/cpuinfo").read_text())


def test_rss_counts_the_server_and_its_children(tmp_path: Path) -> None:
    """A tensor-parallel server's ranks are its children: their memory is the server's too."""
    import subprocess

    from benchmarks.run_all import rss_mib

    alone = rss_mib(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; data = bytearray(200 << 20); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while rss_mib(os.getpid()) < alone + 150 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rss_mib(os.getpid()) >= alone + 150
    finally:
        child.kill()
        child.wait()


def test_the_benchmarks_import_nothing_from_the_tests() -> None:
    """Tests may use the benchmarks' helpers (tiny models, step metadata), never the other way round: a
    benchmark does not depend on the test suite."""
    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    importers = [str(path.relative_to(benchmarks)) for path in sorted(benchmarks.rglob("*.py"))
                 if any(line.lstrip().startswith(("from tests", "import tests"))
                        for line in path.read_text().splitlines())]
    assert importers == []
