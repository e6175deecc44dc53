"""The soak benchmark's client, briefly, against the test server: the mix runs with no failure."""

from __future__ import annotations

import asyncio
import json
import os
import time

from benchmarks.soak import SoakResult, make_report, rss_drift, soak


def test_a_short_soak_has_no_failures_and_frees_every_block(served):
    # However slow the machine, each client sends its first request: with seed 6 a streamed completion,
    # seeded logprobs, a streamed chat and an invalid request, so that "ok" and "invalid-refused" both count.
    result = asyncio.run(soak(served.url, os.getpid(), seconds=8, concurrency=4, sample_s=2, seed=6))
    assert result.outcomes["failure"] == 0, result.failures
    assert result.outcomes["ok"] > 0 and result.outcomes["invalid-refused"] > 0
    assert len(result.rss_mib) >= 2
    # Abandoned streams are aborted within a step; then every block is back.
    deadline = time.monotonic() + 60
    while served.engine.get_stats().kv_cache_usage > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served.engine.get_stats().kv_cache_usage == 0


def test_rss_drift_is_measured_after_the_warm_up():
    samples = [(0.0, 100.0), (10.0, 500.0), (20.0, 510.0), (30.0, 495.0)]
    assert rss_drift(samples, warmup_s=10.0) == 0.02
    assert rss_drift(samples, warmup_s=100.0) == 0.0


def test_the_report_is_json():
    """Regression: ``dataclasses.asdict`` turned the outcome Counter into one keyed by tuples."""
    result = SoakResult()
    result.outcomes["ok"] += 3
    result.rss_mib.append((0.0, 100.0))
    report = json.loads(json.dumps(make_report(result, 1.0, 4, True, 0.0)))
    assert report["outcomes"] == {"ok": 3} and report["rss_drift_after_warmup"] == 0.0
