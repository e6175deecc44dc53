"""Benchmark plots (server/bench/plots.py): PNGs written and readable, empty input refused.

No server or model: results are built from synthetic timestamps, except one run of
``pagedserve.server.bench.serve.main --plot`` against the tiny in-process fake server of test_benchmarks.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI
from matplotlib.image import imread

from pagedserve.server.bench import plots, serve
from pagedserve.server.bench.serve import TimedResult
from pagedserve.server.bench.summary import compute_metrics, result_from_timestamps
from tests.test_benchmarks import WordTokenizer, fake_app, fake_server  # noqa: F401 (fixtures)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000  # a figure of four (or three) drawn panels; an empty canvas is far smaller


def _timed(sent_s: float, arrivals_s: list[float], output_tokens: int) -> TimedResult:
    """A successful result on the run's clock: sent at ``sent_s``, chunks at ``arrivals_s`` (s)."""
    result = result_from_timestamps(sent_s, arrivals_s, arrivals_s[-1], 10, output_tokens)
    return TimedResult(**vars(result), sent_s=sent_s)


def _synthetic_run(num_requests: int = 12, tokens: int = 40, seed: int = 0) -> tuple[list[TimedResult], float]:
    """Requests four at a time, 40 tokens at ~20 ms gaps, plus one failure; returns (results, duration s)."""
    rng = np.random.default_rng(seed)
    results = []
    for i in range(num_requests):
        sent = 0.9 * (i // 4)
        first = sent + rng.uniform(0.05, 0.3)
        arrivals = (first + np.concatenate([[0.0], np.cumsum(rng.uniform(0.01, 0.03, tokens - 1))])).tolist()
        results.append(_timed(sent, arrivals, tokens))
    results.append(TimedResult(success=False, error="HTTP 500", sent_s=0.0))
    return results, max(r.sent_s + r.latency_s for r in results)


def _assert_png(path: Path) -> np.ndarray:
    """``path`` is a PNG of a real figure that matplotlib reads back; returns its pixels."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > MIN_PNG_BYTES, len(data)
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert pixels.std() > 0.05  # not a blank canvas
    return pixels


def test_serve_plot_is_a_png_with_every_panel(tmp_path: Path) -> None:
    results, duration = _synthetic_run()
    path = plots.save_serve_plot(tmp_path / "sub" / "run.png", results, duration, title="synthetic")
    assert path == tmp_path / "sub" / "run.png"
    _assert_png(path)
    fig = plots.serve_run_figure(results, duration)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[:4] == ["TTFT (n = 12 requests)", "TPOT (n = 12 requests)",
                          "ITL (n = 468 gaps between chunks)", "output throughput over time (1 s bins)"]
    # p50 / p99 are marked with the report's values.
    metrics = compute_metrics(results, duration)
    ttft_labels = fig.axes[0].get_legend_handles_labels()[1]
    assert ttft_labels == [f"p50 {metrics['p50_ttft_ms']:.1f} ms", f"p99 {metrics['p99_ttft_ms']:.1f} ms"]


def test_throughput_timeline_counts_every_output_token_once() -> None:
    results, duration = _synthetic_run()
    done = [r for r in results if r.success]
    times, tokens = plots.spread_chunk_tokens([r.chunk_times_s() for r in done], [r.output_tokens for r in done])
    assert times.size == sum(len(r.itl_s) + 1 for r in done)
    assert times.max() == pytest.approx(duration)
    edges, tok_per_s = plots.throughput_timeline(times, tokens, duration)
    assert edges[0] == 0 and edges[-1] == pytest.approx(duration)
    assert np.allclose(np.diff(edges)[:-1], 1.0)
    assert float(np.sum(tok_per_s * np.diff(edges))) == pytest.approx(12 * 40)
    # A chunk carrying several tokens: the server's count is spread over the chunks.
    times, tokens = plots.spread_chunk_tokens([[0.5, 1.5]], [6])
    assert tokens.tolist() == [3.0, 3.0]
    # A last sliver shorter than half a bin joins the bin before it: no spike at the end.
    edges, tok_per_s = plots.throughput_timeline([0.5, 1.5, 2.1], [1, 1, 1], duration_s=2.2)
    assert edges.tolist() == [0.0, 1.0, 2.2] and tok_per_s.tolist() == pytest.approx([1.0, 2 / 1.2])


def test_comparison_plot_is_a_png(tmp_path: Path) -> None:
    runs = [{"server": server, "scenario": scenario, "output_throughput": tput, "p50_ttft_ms": 100 * tput,
             "p99_ttft_ms": 300 * tput, "p50_tpot_ms": 1000 / tput, "p99_tpot_ms": 1500 / tput}
            for server, factor in (("pagedserve", 3.0), ("llama-server", 2.0), ("naive", 1.0))
            for scenario, tput in (("P1", 20 * factor), ("P16", 60 * factor), ("D64", 100 * factor))
            if (server, scenario) != ("naive", "D64")]  # a missing run leaves a gap
    path = plots.save_comparison_plot(tmp_path / "bench.png", runs, title="synthetic")
    _assert_png(path)
    fig = plots.comparison_figure(runs)
    assert [ax.get_title() for ax in fig.axes] == [
        "output throughput", "TTFT (bar p50, whisker p99)", "TPOT (bar p50, whisker p99)"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["P1", "P16", "D64"]
    assert len(fig.axes[0].patches) == 8  # 3 servers x 3 scenarios, less the missing one


def test_plots_main_redraws_a_make_bench_report(tmp_path: Path) -> None:
    report = tmp_path / "bench-x.json"
    run = {"server": "pagedserve", "scenario": "P1", "output_throughput": 20.0, "p50_ttft_ms": 600.0,
           "p99_ttft_ms": 800.0, "p50_tpot_ms": 45.0, "p99_tpot_ms": 47.0}
    report.write_text(json.dumps({"date": "today", "runs": [run]}))
    assert plots.main([str(report)]) == 0
    _assert_png(tmp_path / "bench-x.png")
    report.write_text('{"runs": []}')
    assert plots.main([str(report)]) == 1


def test_empty_input_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to plot: no successful request"):
        plots.save_serve_plot(tmp_path / "a.png", [], 1.0)
    with pytest.raises(ValueError, match="nothing to plot: no successful request"):
        plots.save_serve_plot(tmp_path / "a.png", [TimedResult(success=False, error="HTTP 500")], 1.0)
    with pytest.raises(ValueError, match="nothing to plot: no benchmark runs"):
        plots.save_comparison_plot(tmp_path / "b.png", [])
    with pytest.raises(ValueError, match="lacks p50_tpot_ms, p99_tpot_ms"):
        plots.comparison_figure([{"server": "s", "scenario": "P1", "output_throughput": 1.0,
                                  "p50_ttft_ms": 1.0, "p99_ttft_ms": 2.0}])
    with pytest.raises(ValueError, match="nothing to plot: no TTFT values"):
        plots.plot_latency_ecdf(plots.Figure().add_subplot(), [], "TTFT")
    with pytest.raises(ValueError, match="nothing to plot: no streamed chunks"):
        plots.spread_chunk_tokens([[], []], [0, 0])
    with pytest.raises(ValueError, match="nothing to plot: no chunk times"):
        plots.throughput_timeline([], [], 1.0)
    with pytest.raises(ValueError, match="duration_s and bin_s must be > 0"):
        plots.throughput_timeline([0.1], [1], 0.0)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_serve_plot_flag_draws_a_real_run(fake_server: str, tmp_path: Path,  # noqa: F811 (fixture)
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr("pagedserve.server.bench.serve.load_tokenizer", lambda name: WordTokenizer())
    out = tmp_path / "run.png"
    argv = ["--base-url", fake_server, "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "4",
            "--output-len", "5", "--no-progress", "--plot", str(out)]
    assert serve.main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _assert_png(out)
    # A plot that cannot be written fails the run with one line, not a traceback.
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert serve.main([*argv[:-1], str(blocker / "run.png")]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot write the plot {blocker / 'run.png'}: ")


def test_chunk_times_place_a_result_on_the_run_clock() -> None:
    result = _timed(2.0, [2.5, 2.6, 2.8], output_tokens=3)
    assert result.chunk_times_s() == pytest.approx([2.5, 2.6, 2.8])
    assert TimedResult(success=False).chunk_times_s() == []


def test_plot_without_matplotlib_fails_before_the_run(fake_server: str, fake_app: FastAPI,  # noqa: F811 (fixture)
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    loaded = []
    monkeypatch.setattr("pagedserve.server.bench.serve.load_tokenizer", lambda name: loaded.append(name))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "matplotlib" else find_spec(name, *args))
    fake_app.state.authorizations.clear()
    assert serve.main(["--base-url", fake_server, "--no-progress", "--plot", "run.png"]) == 1
    assert capsys.readouterr().err == "error: --plot needs matplotlib: pip install 'matplotlib>=3.8'\n"
    assert not loaded and not fake_app.state.authorizations  # no tokenizer, no request: the run never began
