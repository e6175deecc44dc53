"""Figures of benchmark runs, drawn with matplotlib's Agg backend (no display, no pyplot state).

- ``save_serve_plot``: one run of ``server/bench/serve.py`` (``pagedserve bench serve --plot out.png``):
  ECDFs of TTFT, TPOT and ITL with p50/p99 marked, and output tokens/s over time in 1 s bins
  with the requests in flight.
- ``save_comparison_plot``: the runs of ``make bench`` (``benchmarks/run_all.py``): output tok/s,
  TTFT and TPOT (p50 bars, whiskers to p99) per scenario, one bar per server.

Every function refuses empty input with a ``ValueError`` that says what was missing.
Percentiles are ``np.percentile``'s, as in ``server/bench/summary.py``, so the marked values
equal the printed report's.

    python -m pagedserve.server.bench.plots benchmarks/results/bench-20261130-040504.json  # -> .png beside it
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from pagedserve.server.bench.serve import TimedResult

MARKED_PERCENTILES = (50, 99)
DPI = 100
HEADROOM = 1.3  # y axis top / highest value on the throughput panel, leaving room for its legend


def _require(values: Sequence[Any] | np.ndarray, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` when ``values`` is empty."""
    if len(values) == 0:
        raise ValueError(f"nothing to plot: no {what}")


def plot_latency_ecdf(ax: Axes, values_s: Sequence[float], name: str, unit_of_count: str = "requests") -> None:
    """Draw the empirical CDF of a latency sample on ``ax``, with p50 and p99 marked.

    Args:
        values_s: the sample, in seconds; drawn in milliseconds.
        name: what it measures (``"TTFT"``), for the title and x label.
        unit_of_count: what one value is (``"requests"``, ``"gaps"``), for the y label.
    Raises:
        ValueError: when ``values_s`` is empty.
    """
    _require(values_s, f"{name} values")
    values_ms = np.sort(np.asarray(values_s, dtype=np.float64) * 1000.0)
    fraction = np.arange(1, values_ms.size + 1) / values_ms.size
    ax.step(values_ms, fraction, where="post", color="tab:blue", linewidth=1.5)
    for p, color in zip(MARKED_PERCENTILES, ("tab:green", "tab:red"), strict=True):
        value = float(np.percentile(values_ms, p))
        ax.axvline(value, color=color, linestyle="--", linewidth=1, label=f"p{p} {value:.1f} ms")
        ax.plot([value], [p / 100], "o", color=color, markersize=4)
    if values_ms[0] > 0 and values_ms[-1] / values_ms[0] > 100:  # a tail that would squash the body
        ax.set_xscale("log")
    ax.set_title(f"{name} (n = {values_ms.size} {unit_of_count})")
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel(f"fraction of {unit_of_count}")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")


def spread_chunk_tokens(chunk_times_s: Sequence[Sequence[float]],
                        output_tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every streamed chunk's arrival time and token count, from per-request chunk times.

    A request's output tokens (as the server reported them) are spread evenly over its chunks,
    so the counts add up to the run's output tokens even when a chunk carries several.

    Args:
        chunk_times_s: per request, when each non-empty chunk arrived, seconds after the run started.
        output_tokens: per request, its output tokens.
    Returns:
        Arrival times (s) and tokens (may be fractional) of all chunks, in request order.
    Raises:
        ValueError: when no request has a chunk, or the two sequences differ in length.
    """
    if len(chunk_times_s) != len(output_tokens):
        raise ValueError(f"{len(chunk_times_s)} requests' chunk times but {len(output_tokens)} token counts")
    times = [np.asarray(t, dtype=np.float64) for t in chunk_times_s if len(t)]
    _require(times, "streamed chunks")
    tokens = [np.full(len(t), n / len(t)) for t, n in zip(chunk_times_s, output_tokens, strict=True) if len(t)]
    return np.concatenate(times), np.concatenate(tokens)


def throughput_timeline(times_s: Sequence[float] | np.ndarray, tokens: Sequence[float] | np.ndarray,
                        duration_s: float, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in consecutive bins of ``bin_s`` seconds from the run's start.

    Args:
        times_s: when each chunk arrived, seconds after the run started.
        tokens: tokens each chunk carried.
        duration_s: the run's length in seconds; the last bin ends there, and one shorter than half a
            bin joins the bin before it (so a sliver at the end is no spike).
        bin_s: bin width in seconds.
    Returns:
        Bin edges in seconds (one more than bins) and tokens/s in each bin.
    Raises:
        ValueError: when there is no chunk, the lengths differ, or ``duration_s`` or ``bin_s`` is not positive.
    """
    _require(times_s, "chunk times")
    if len(times_s) != len(tokens):
        raise ValueError(f"{len(times_s)} chunk times but {len(tokens)} token counts")
    if duration_s <= 0 or bin_s <= 0:
        raise ValueError(f"duration_s and bin_s must be > 0, got {duration_s} and {bin_s}")
    edges = np.arange(0.0, duration_s, bin_s)
    if edges.size > 1 and duration_s - edges[-1] < bin_s / 2:
        edges = edges[:-1]
    edges = np.append(edges, max(duration_s, float(np.max(times_s))))
    counts, _ = np.histogram(np.asarray(times_s, dtype=np.float64), bins=edges,
                             weights=np.asarray(tokens, dtype=np.float64))
    return edges, counts / np.diff(edges)


def requests_in_flight(starts_s: Sequence[float], ends_s: Sequence[float], at_s: np.ndarray) -> np.ndarray:
    """How many requests were running (sent, stream not yet ended) at each of ``at_s`` (seconds)."""
    starts, ends = np.asarray(starts_s, dtype=np.float64), np.asarray(ends_s, dtype=np.float64)
    return (starts[None, :] <= at_s[:, None]).sum(axis=1) - (ends[None, :] <= at_s[:, None]).sum(axis=1)


def plot_throughput(ax: Axes, edges_s: np.ndarray, tok_per_s: np.ndarray, mean_tok_per_s: float,
                    starts_s: Sequence[float] = (), ends_s: Sequence[float] = ()) -> None:
    """Draw output tokens/s per bin on ``ax``, the run's mean dashed, and requests in flight on a twin axis.

    Args:
        edges_s: bin edges in seconds after the run started (``throughput_timeline``'s).
        tok_per_s: output tokens per second in each bin.
        mean_tok_per_s: the run's output throughput (output tokens / duration), tokens/s.
        starts_s, ends_s: when each successful request was sent and its stream ended, seconds
            after the run started; without them no in-flight line is drawn.
    Raises:
        ValueError: when there is no bin.
    """
    _require(tok_per_s, "throughput bins")
    ax.stairs(tok_per_s, edges_s, fill=True, color="tab:blue", alpha=0.5, label="output tok/s per bin")
    ax.axhline(mean_tok_per_s, color="black", linestyle="--", linewidth=1,
               label=f"mean {mean_tok_per_s:.1f} tok/s")
    ax.set_xlim(0, edges_s[-1])
    ax.set_ylim(0, HEADROOM * max(float(np.max(tok_per_s)), mean_tok_per_s, 1e-9))  # room for the legend
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("output tokens / s")
    width = float(np.median(np.diff(edges_s)))
    ax.set_title(f"output throughput over time ({width:g} s bins)")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if len(starts_s):
        at = np.linspace(0.0, float(edges_s[-1]), 400)
        twin = ax.twinx()
        in_flight = requests_in_flight(starts_s, ends_s, at)
        twin.step(at, in_flight, where="post", color="tab:orange", linewidth=1)
        twin.set_ylabel("requests in flight", color="tab:orange")
        twin.set_ylim(0, HEADROOM * max(int(in_flight.max()), 1))
        handles.append(twin.lines[-1])
        labels.append("requests in flight")
    ax.legend(handles, labels, loc="upper center", ncols=len(handles), fontsize="small")


def serve_run_figure(results: Sequence[TimedResult], duration_s: float, title: str = "",
                     bin_s: float = 1.0) -> Figure:
    """One figure of a ``server/bench/serve.py`` run: TTFT, TPOT and ITL ECDFs and throughput over time.

    Args:
        results: the run's per-request results (``serve.TimedResult``: ``sent_s`` places each on the
            run's clock); failed ones are left out.
        duration_s: the run's length in seconds.
        title: the figure's title (server, model, load).
        bin_s: width of the throughput bins in seconds.
    Raises:
        ValueError: when no request succeeded.
    """
    done = [r for r in results if r.success]
    _require(done, "successful request")
    fig = Figure(figsize=(13, 8.5), layout="constrained")
    (ttft_ax, tpot_ax), (itl_ax, tput_ax) = fig.subplots(2, 2)
    plot_latency_ecdf(ttft_ax, [r.ttft_s for r in done], "TTFT")
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    if tpots:
        plot_latency_ecdf(tpot_ax, tpots, "TPOT")
    else:
        tpot_ax.text(0.5, 0.5, "no TPOT: every request had one output token", ha="center", va="center")
        tpot_ax.set_axis_off()
    itls = [gap for r in done for gap in r.itl_s]
    if itls:
        plot_latency_ecdf(itl_ax, itls, "ITL", unit_of_count="gaps between chunks")
    else:
        itl_ax.text(0.5, 0.5, "no ITL: every request streamed one chunk", ha="center", va="center")
        itl_ax.set_axis_off()
    times, tokens = spread_chunk_tokens([r.chunk_times_s() for r in done], [r.output_tokens for r in done])
    edges, tok_per_s = throughput_timeline(times, tokens, duration_s, bin_s)
    plot_throughput(tput_ax, edges, tok_per_s, sum(r.output_tokens for r in done) / duration_s,
                    [r.sent_s for r in done], [r.sent_s + r.latency_s for r in done])
    failed = len(results) - len(done)
    fig.suptitle((title + "\n" if title else "") + f"{len(done)} requests ok, {failed} failed, {duration_s:.1f} s")
    return fig


def _group_positions(num_servers: int, num_groups: int) -> tuple[np.ndarray, float]:
    """Bar centres (server x group) and width for grouped bars."""
    width = 0.8 / num_servers
    offsets = (np.arange(num_servers) - (num_servers - 1) / 2) * width
    return np.arange(num_groups)[None, :] + offsets[:, None], width


def comparison_figure(runs: Sequence[dict[str, Any]], title: str = "") -> Figure:
    """Grouped bars comparing servers per scenario: output tok/s, TTFT and TPOT (p50 bar, whisker to p99).

    Args:
        runs: ``make bench`` run records (``benchmarks/run_all.py``'s ``report["runs"]``), each with
            ``server``, ``scenario``, ``output_throughput`` (tokens/s) and ``p50_/p99_`` ``ttft_ms`` /
            ``tpot_ms`` (milliseconds). A server without a run in a scenario leaves a gap.
        title: the figure's title.
    Raises:
        ValueError: when ``runs`` is empty or a run lacks one of those keys.
    """
    _require(runs, "benchmark runs")
    needed = ("server", "scenario", "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")
    for run in runs:
        missing = [key for key in needed if key not in run]
        if missing:
            raise ValueError(f"run {run.get('server', '?')}/{run.get('scenario', '?')} lacks {', '.join(missing)}")
    servers = list(dict.fromkeys(run["server"] for run in runs))
    scenarios = list(dict.fromkeys(run["scenario"] for run in runs))
    by_key = {(run["server"], run["scenario"]): run for run in runs}
    centres, width = _group_positions(len(servers), len(scenarios))
    colors = [f"C{i % 10}" for i in range(len(servers))]

    fig = Figure(figsize=(max(12, 2.2 * len(scenarios) * 3), 5.5), layout="constrained")
    axes = fig.subplots(1, 3)
    panels = (("output throughput", "output tokens / s", "output_throughput", None),
              ("TTFT (bar p50, whisker p99)", "TTFT (ms, log scale)", "p50_ttft_ms", "p99_ttft_ms"),
              ("TPOT (bar p50, whisker p99)", "TPOT (ms)", "p50_tpot_ms", "p99_tpot_ms"))
    for ax, (panel_title, ylabel, key, whisker_key) in zip(axes, panels, strict=True):
        for i, server in enumerate(servers):
            cells = [(j, by_key[server, s]) for j, s in enumerate(scenarios) if (server, s) in by_key]
            x = np.array([centres[i, j] for j, _ in cells])
            values = np.array([run[key] for _, run in cells], dtype=np.float64)
            bars = ax.bar(x, values, width, color=colors[i], label=server)
            if whisker_key is None:
                ax.bar_label(bars, fmt=lambda v: f"{v:.0f}" if v >= 100 else f"{v:.1f}", fontsize="x-small", padding=1)
            else:
                tops = np.array([run[whisker_key] for _, run in cells], dtype=np.float64)
                ax.errorbar(x, values, yerr=[np.zeros_like(values), np.maximum(tops - values, 0)],
                            fmt="none", ecolor="black", capsize=3, linewidth=1)
        ax.set_xticks(np.arange(len(scenarios)), scenarios)
        ax.set_xlabel("scenario")
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.grid(True, axis="y", alpha=0.3)
        if key == "p50_ttft_ms":
            ax.set_yscale("log")
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def save_figure(fig: Figure, path: Path | str) -> Path:
    """Render ``fig`` with the Agg backend to ``path`` (format from its suffix), creating folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    return path


def save_serve_plot(path: Path | str, results: Sequence[TimedResult], duration_s: float, title: str = "",
                    bin_s: float = 1.0) -> Path:
    """Write ``serve_run_figure`` to ``path``; see it for the arguments and errors."""
    return save_figure(serve_run_figure(results, duration_s, title, bin_s), path)


def save_comparison_plot(path: Path | str, runs: Sequence[dict[str, Any]], title: str = "") -> Path:
    """Write ``comparison_figure`` to ``path``; see it for the arguments and errors."""
    return save_figure(comparison_figure(runs, title), path)


def main(argv: list[str] | None = None) -> int:
    """Draw the comparison plot of a ``make bench`` JSON report (again); returns the exit code."""
    parser = argparse.ArgumentParser(description="Comparison plot of a make bench report (bench-*.json).")
    parser.add_argument("report", type=Path, help="bench-*.json written by benchmarks/run_all.py")
    parser.add_argument("-o", "--output", type=Path, default=None, help="default: the report's path, .png")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    out = args.output or args.report.with_suffix(".png")
    try:
        save_comparison_plot(out, report.get("runs") or [], title=f"Serving benchmark, {report.get('date', '')}")
    except ValueError as exc:
        print(f"error: {args.report}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
