"""Operations: /metrics against usage, request timestamps, the stats log, log formats, /health and /version."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sys
import time
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import pagedserve
from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.core.spec_decode import SpecDecodingStats
from pagedserve.engine.metrics.loggers import LoggingStatLogger
from pagedserve.engine.metrics.prometheus import SPEC_DECODE_ALIASES, PrometheusStatLogger, buckets_1_2_5
from pagedserve.engine.metrics.stats import IterationStats, RequestStatsTracker
from pagedserve.engine.outputs import EngineCoreOutput, FinishReason
from pagedserve.server.app import ServerArgs, build_app
from pagedserve.server.logging_config import JsonFormatter, log_config
from tests.conftest import Served, cli_server, sse_payloads
from tests.test_server import wait_until_idle
from tests.test_spec_decode import NGRAM, PASSAGE

MODEL_METRICS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "request_success_total", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, parsed by prometheus_client: (name, sorted labels) -> value."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample ``pagedserve:<name>`` with these labels besides ``model_name``."""
    matches = [v for (n, sample_labels), v in samples.items()
               if n == f"pagedserve:{name}" and {k: x for k, x in sample_labels if k != "model_name"} == labels]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def scheduler_stats(**counts: object) -> SchedulerStats:
    fields = {"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_cache_usage": 0.0, "prefix_cache_queries": 0,
              "prefix_cache_hits": 0, "num_preemptions": 0, "num_scheduled_tokens": 0}
    return SchedulerStats(**(fields | counts))


def output(request_id: str, tokens: list[int], finish: FinishReason | None = None,
           scheduled: float | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, tokens, finish_reason=finish, first_scheduled_time=scheduled)


# --------------------------------------------------------------------------- timestamps and counts


def test_timestamps_become_queue_time_ttft_itl_and_e2e() -> None:
    tracker = RequestStatsTracker(scheduler_stats())
    tracker.add_request(["a"], num_prompt_tokens=7, arrival_time=10.0)
    prefill = tracker.make_iteration_stats([output("a", [5], scheduled=10.5)], (), scheduler_stats(), now=11.0)
    assert prefill.time_to_first_tokens_s == [1.0] and prefill.inter_token_latencies_s == []
    assert (prefill.num_prompt_tokens, prefill.num_generation_tokens, prefill.finished_requests) == (7, 1, [])
    last = tracker.make_iteration_stats([output("a", [6], FinishReason.LENGTH)], (), scheduler_stats(), now=11.25)
    assert last.inter_token_latencies_s == [0.25] and last.num_prompt_tokens == 0
    [finished] = last.finished_requests
    assert finished.finish_reason is FinishReason.LENGTH and finished.e2e_latency_s == 1.25
    assert finished.queue_time_s == 0.5 and (finished.num_prompt_tokens, finished.num_generation_tokens) == (7, 2)
    # Finished: later outputs (e.g. a step already under way) are not counted.
    assert tracker.make_iteration_stats([output("a", [7])], (), scheduler_stats(), now=12.0) == IterationStats()


def test_shared_prompt_counts_once_and_stop_strings_and_aborts_finish_requests() -> None:
    tracker = RequestStatsTracker(scheduler_stats())
    tracker.add_request(["0_p", "1_p"], num_prompt_tokens=4, arrival_time=0.0)
    tracker.add_request(["q"], num_prompt_tokens=3, arrival_time=0.0)
    stats = tracker.make_iteration_stats([output("1_p", [1]), output("0_p", [2, 3]), output("q", [])],
                                         stopped_ids={"1_p"}, scheduler_stats=scheduler_stats(), now=1.0)
    assert stats.num_prompt_tokens == 4 and stats.num_generation_tokens == 3  # the prompt once, as in usage
    assert [(f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens) for f in stats.finished_requests] == [
        (FinishReason.STOP, 4, 1)]
    aborted = tracker.abort_requests(["0_p", "q", "unknown"], now=3.0)
    assert [(f.finish_reason, f.e2e_latency_s, f.queue_time_s) for f in aborted.finished_requests] == [
        (FinishReason.ABORT, 3.0, None), (FinishReason.ABORT, 3.0, None)]


def test_scheduler_counters_are_reported_as_deltas_per_step() -> None:
    tracker = RequestStatsTracker(scheduler_stats(num_scheduled_tokens=100, prefix_cache_queries=50))
    step = scheduler_stats(num_scheduled_tokens=164, prefix_cache_queries=80, prefix_cache_hits=16,
                           num_preemptions=2)
    stats = tracker.make_iteration_stats([], (), step, now=0.0)
    assert (stats.num_scheduled_tokens, stats.prefix_cache_queries, stats.prefix_cache_hits,
            stats.num_preemptions) == (64, 30, 16, 2)
    assert tracker.make_iteration_stats([], (), step, now=0.0) == IterationStats()


def test_spec_decoding_counters_are_reported_as_deltas_and_exported_under_vllm_names() -> None:
    tracker = RequestStatsTracker(scheduler_stats(spec_decoding=SpecDecodingStats(2, 6, 3, [2, 1, 0])))
    step = scheduler_stats(spec_decoding=SpecDecodingStats(5, 15, 10, [5, 3, 2]))
    stats = tracker.make_iteration_stats([], (), step, now=0.0)
    assert stats.spec_decoding == SpecDecodingStats(3, 9, 7, [3, 2, 2])
    assert tracker.make_iteration_stats([], (), step, now=0.0).spec_decoding == SpecDecodingStats(0, 0, 0, [0, 0, 0])
    prometheus = PrometheusStatLogger("m", 2048)
    prometheus.record(step, stats)
    page = generate_latest(prometheus.registry).decode()
    for ours, (vllm,) in SPEC_DECODE_ALIASES.items():
        assert f"pagedserve:{ours}" in page and vllm in page
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in page
    assert 'pagedserve:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in page
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0' in page


def test_stats_line_adds_speculative_decoding_when_drafts_were_verified(caplog: pytest.LogCaptureFixture) -> None:
    stat_logger = LoggingStatLogger(clock=iter([0.0, 2.0]).__next__)
    caplog.set_level(logging.INFO, logger="pagedserve.engine.metrics.loggers")
    busy = scheduler_stats(num_running_reqs=1)
    for tokens, spec in ((10, SpecDecodingStats(2, 8, 4, [2, 1, 1, 0])), (6, SpecDecodingStats(2, 8, 2, [1, 1, 0, 0]))):
        stat_logger.record(busy, IterationStats(num_generation_tokens=tokens, spec_decoding=spec))
    stat_logger.log()
    assert caplog.records[-1].getMessage() == (
        "speculative decoding: mean acceptance length 2.50, accepted throughput 3.0 tok/s, drafted throughput 8.0 "
        "tok/s, acceptance rate 37.5%, per-position acceptance rate 0.75, 0.50, 0.25, 0.00, drafts 4")


def test_token_buckets_run_1_2_5_up_to_max_model_len() -> None:
    assert buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert buckets_1_2_5(1) == [1]


# --------------------------------------------------------------------------- /metrics on the real engine


def test_metrics_lists_every_metric_with_the_model_name(served: Served) -> None:
    samples = scrape(served.url)
    for name in MODEL_METRICS:
        found = [labels for (n, labels) in samples if n.removesuffix("_count") == f"pagedserve:{name}"]
        assert found and all(("model_name", served.engine.model_name) in labels for labels in found), name
    reasons = {dict(labels).get("finished_reason") for (n, labels) in samples
               if n == "pagedserve:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}


def test_counters_equal_the_usage_of_the_requests_served(client: httpx.Client, served: Served) -> None:
    wait_until_idle(served.engine)
    engine_before = served.engine.get_stats()
    before = scrape(served.url)
    # Non-streamed and streamed, completions and chat, n > 1, several prompts, a stop string,
    # and a prompt of several KV blocks twice (prefix-cache hits).
    long_prompt = " ".join(f"The capital of {country} is {city}." for country, city in (
        ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Austria", "Vienna"), ("Spain", "Madrid")))
    bodies = [
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 6, "ignore_eos": True}),
        ("/v1/completions", {"prompt": ["One", "Two three four"], "n": 2, "max_tokens": 4, "ignore_eos": True,
                             "seed": 3}),
        ("/v1/completions", {"prompt": "Count: one, two, three,", "max_tokens": 30, "stop": [","],
                             "temperature": 0.0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 5,
                                  "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 3, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}),
    ]
    usages, finish_reasons = [], []
    for path, body in bodies:
        if body.get("stream"):
            with client.stream("POST", path, json=body) as response:
                events = sse_payloads(response.iter_lines())
            usages.append(events[-2]["usage"])
            finish_reasons += [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]]
        else:
            response = client.post(path, json=body).json()
            usages.append(response["usage"])
            finish_reasons += [choice["finish_reason"] for choice in response["choices"]]
    wait_until_idle(served.engine)
    after = scrape(served.url)
    engine_after = served.engine.get_stats()

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    generation_tokens = sum(u["completion_tokens"] for u in usages)
    num_requests = len(finish_reasons)  # one per completion: 1 + 4 + 1 + 1 + 1
    assert num_requests == 8 and finish_reasons.count("stop") == 1
    assert delta(before, after, "prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "generation_tokens_total") == generation_tokens
    for reason in ("stop", "length"):
        assert delta(before, after, "request_success_total", finished_reason=reason) == finish_reasons.count(reason)
    assert delta(before, after, "request_success_total", finished_reason="abort") == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert delta(before, after, f"{histogram}_count") == num_requests, histogram
    # One token per step and request: every token after a request's first one follows an inter-token gap.
    assert delta(before, after, "inter_token_latency_seconds_count") == generation_tokens - num_requests
    assert delta(before, after, "request_generation_tokens_sum") == generation_tokens
    assert 0 < delta(before, after, "time_to_first_token_seconds_sum") <= delta(
        before, after, "e2e_request_latency_seconds_sum")
    # Engine-side counters come from the scheduler's totals; no step is lost or counted twice.
    assert delta(before, after, "iteration_tokens_total_sum") == (
        engine_after.num_scheduled_tokens - engine_before.num_scheduled_tokens)
    assert delta(before, after, "prefix_cache_queries_total") == (
        engine_after.prefix_cache_queries - engine_before.prefix_cache_queries) > 0
    assert delta(before, after, "prefix_cache_hits_total") == (
        engine_after.prefix_cache_hits - engine_before.prefix_cache_hits) > 0
    assert value(after, "num_requests_running") == value(after, "num_requests_waiting") == 0
    assert value(after, "kv_cache_usage_perc") == 0.0


def test_a_dropped_stream_counts_as_an_aborted_request(served: Served) -> None:
    wait_until_idle(served.engine)
    before = scrape(served.url)
    body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_until_idle(served.engine)
    after = scrape(served.url)
    assert delta(before, after, "request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "e2e_request_latency_seconds_count") == 1
    assert delta(before, after, "request_generation_tokens_sum") == delta(before, after, "generation_tokens_total")


# --------------------------------------------------------------------------- stats log and log formats


def test_stats_line_sums_the_interval_and_is_skipped_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    clock = iter([0.0, 2.0, 4.0, 6.0]).__next__
    stat_logger = LoggingStatLogger(clock=clock)
    caplog.set_level(logging.INFO, logger="pagedserve.engine.metrics.loggers")
    busy = scheduler_stats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25)
    stat_logger.record(busy, IterationStats(num_prompt_tokens=100, num_generation_tokens=20,
                                            prefix_cache_queries=80, prefix_cache_hits=20, num_preemptions=1))
    stat_logger.record(busy, IterationStats(num_generation_tokens=4))
    stat_logger.log()
    assert [r.getMessage() for r in caplog.records] == [
        "prompt throughput 50.0 tok/s, generation throughput 12.0 tok/s, running 3 reqs, waiting 1 reqs, "
        "KV cache usage 25.0%, prefix cache hit rate 25.0%, preemptions 1"]
    stat_logger.record(scheduler_stats(), IterationStats(num_generation_tokens=2))  # the last tokens
    stat_logger.log()
    assert len(caplog.records) == 2
    assert "generation throughput 1.0 tok/s, running 0 reqs" in caplog.records[1].getMessage()
    stat_logger.log()  # nothing since: idle
    assert len(caplog.records) == 2


def test_json_log_lines_carry_time_level_logger_message_and_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("pagedserve.engine.x", logging.ERROR, __file__, 1, "failed %s", ("twice",),
                                   sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert (line["level"], line["logger"], line["message"]) == ("ERROR", "pagedserve.engine.x", "failed twice")
    assert line["time"].endswith("+00:00") and "ValueError: boom" in line["exception"]
    config = log_config("json")
    assert config["loggers"]["uvicorn.access"]["propagate"] and not config["disable_existing_loggers"]
    with pytest.raises(ValueError, match="log_format"):
        log_config("xml")
    with pytest.raises(ValueError, match="log_format"):
        ServerArgs(log_format="xml")
    with pytest.raises(ValueError, match="log_stats_interval_s"):
        ServerArgs(log_stats_interval_s=-1)


def _log_lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _stats_lines(log: Path) -> list[dict[str, Any]]:
    return [line for line in _log_lines(log) if line["logger"] == "pagedserve.engine.metrics.loggers"]


def _logged_at(line: dict[str, Any]) -> float:
    """When the server logged ``line``: UNIX seconds."""
    return datetime.fromisoformat(line["time"]).timestamp()


def _wait_for_stats_line(log: Path, text: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Poll the log until a stats line holds ``text``; returns it."""
    deadline = time.monotonic() + timeout_s
    while not (found := [line for line in _stats_lines(log) if text in line["message"]]):
        assert time.monotonic() < deadline, f"no stats line with {text!r} after {timeout_s} s"
        time.sleep(0.05)
    return found[0]


def _wait_for_server_time(url: str, log: Path, moment: float, timeout_s: float = 120.0) -> None:
    """Ask for /health until the server logs an access line at ``moment`` (UNIX seconds) or later.

    However loaded the machine, the server's event loop has then run every periodic stats log due before
    ``moment``: a line they logged would be in the log by now.
    """
    deadline = time.monotonic() + timeout_s
    while not any(line["logger"] == "uvicorn.access" and _logged_at(line) >= moment for line in _log_lines(log)):
        assert time.monotonic() < deadline, f"the server's log did not reach {moment} within {timeout_s} s"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        time.sleep(0.05)


def test_served_process_logs_json_access_lines_and_stats_only_while_busy(tmp_path: Path) -> None:
    """``python -m pagedserve serve --log-format json --access-log``: every line is JSON, uvicorn's included.

    With ``--speculative-config`` and a prompt the model copies from: the speculative decoding counters
    on /metrics, under our names and vLLM's, and their line in the stats log.
    """
    interval_s = 0.5
    log = tmp_path / "server.log"
    args = ["--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB", "--log-format", "json", "--access-log",
            "--log-stats-interval-s", str(interval_s), "--speculative-config", json.dumps(NGRAM)]
    # TQDM_DISABLE: the weight loader's progress bar is no log line (the image sets it too).
    with cli_server(tmp_path, *args, env={"TQDM_DISABLE": "1"}) as (url, process):
        started = next(line for line in _log_lines(log) if "startup complete" in line["message"])
        _wait_for_server_time(url, log, _logged_at(started) + 3 * interval_s)
        assert _stats_lines(log) == [], "a stats line while idle, before any request"
        body = {"prompt": PASSAGE * 2 + PASSAGE[:60].rstrip(), "max_tokens": 48, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        # The interval holding the request's end is logged after it: nothing runs any more. Then idle
        # intervals pass, which log nothing: that line stays the last.
        ended = _wait_for_stats_line(log, "running 0 reqs, waiting 0 reqs")
        _wait_for_server_time(url, log, _logged_at(ended) + 3 * interval_s)
        lines = _stats_lines(log)
        throughput = [line for line in lines if "generation throughput" in line["message"]]
        speculative = [line for line in lines if line["message"].startswith("speculative decoding: mean ")]
        assert throughput and speculative and len(throughput) + len(speculative) == len(lines)
        assert throughput[-1] == ended, "stats lines while idle"
        # One line per interval, not per step (the log's times are rounded to the millisecond).
        logged = [_logged_at(line) for line in throughput]
        assert all(later - earlier >= interval_s - 0.002 for earlier, later in itertools.pairwise(logged)), logged
        samples = scrape(url)
        assert value(samples, "spec_decode_num_accepted_tokens_total") > 0
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            ours, vllm = ({labels: v for (n, labels), v in samples.items() if n == f"{prefix}:spec_decode_{name}_total"}
                          for prefix in ("pagedserve", "vllm"))
            assert ours and ours == vllm, name
        access = [json.loads(line) for line in log.read_text().splitlines() if "POST /v1/completions" in line]
        assert [line["logger"] for line in access] == ["uvicorn.access"]
        uvicorn_lines = [json.loads(line) for line in log.read_text().splitlines() if "startup complete" in line]
        assert [line["logger"] for line in uvicorn_lines] == ["uvicorn"]  # not "uvicorn.error"
        process.terminate()
        process.wait(timeout=120)


# --------------------------------------------------------------------------- /health and /version


def test_health_is_503_until_the_engine_has_started() -> None:
    """Without its lifespan (the engine's start) the app has no engine: 503, not 200 or 500."""
    async def get_health() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.get("/health")

    response = asyncio.run(get_health())
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"


def test_health_is_200_and_version_is_the_package_version(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/version").json() == {"version": version("pagedserve")} == {"version": pagedserve.__version__}
