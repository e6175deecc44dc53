"""Latency and throughput metrics of one benchmark run, from per-request timings.

Definitions follow ``vllm bench serve``:
- TTFT: request sent -> first non-empty streamed text.
- ITL: gaps between consecutive non-empty streamed chunks (one chunk is usually
  one token; servers that stream words make it per word).
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with a single
  output token have none.
- E2E: request sent -> end of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one streamed request measured. Times in seconds."""

    success: bool
    prompt_tokens: int = 0  # as the server reported it, else as the dataset counted it
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, or None with < 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def result_from_timestamps(start_s: float, arrivals_s: list[float], end_s: float,
                           prompt_tokens: int, output_tokens: int) -> RequestResult:
    """A successful request's result from its clock readings (seconds, any origin).

    Args:
        start_s: when the request was sent.
        arrivals_s: when each non-empty chunk arrived, ascending; at least one.
        end_s: when the stream ended.
    Raises:
        ValueError: when ``arrivals_s`` is empty.
    """
    if not arrivals_s:
        raise ValueError("arrivals_s must hold at least one chunk time")
    return RequestResult(success=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                         ttft_s=arrivals_s[0] - start_s, itl_s=np.diff(arrivals_s).tolist(),
                         latency_s=end_s - start_s)


def latency_stats(name: str, values_s: list[float]) -> dict[str, float]:
    """Mean and percentiles of a latency sample, converted to milliseconds.

    Returns:
        ``{"mean_<name>_ms": ..., "p50_<name>_ms": ..., "p90_...", "p99_..."}``;
        all 0.0 for an empty sample.
    """
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {f"mean_{name}_ms": float(values_ms.mean()) if values_ms.size else 0.0}
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(values_ms, p)) if values_ms.size else 0.0
    return stats


def compute_metrics(results: list[RequestResult], duration_s: float) -> dict[str, float | int]:
    """Aggregate per-request results of a run lasting ``duration_s`` seconds.

    Throughputs count successful requests only. Raises:
        ValueError: when ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in results if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    metrics: dict[str, float | int] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "mean_output_tokens": output_tokens / len(done) if done else 0.0,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
    }
    metrics |= latency_stats("ttft", [r.ttft_s for r in done])
    metrics |= latency_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None])
    metrics |= latency_stats("itl", [gap for r in done for gap in r.itl_s])
    metrics |= latency_stats("e2el", [r.latency_s for r in done])
    return metrics


def format_report(metrics: dict[str, float | int], title: str = "Serving Benchmark Result") -> str:
    """Render metrics as the fixed-width table ``vllm bench serve`` prints."""
    rows: list[tuple[str, str]] = [
        ("Successful requests:", f"{metrics['completed']}"),
        ("Failed requests:", f"{metrics['failed']}"),
        ("Benchmark duration (s):", f"{metrics['duration_s']:.2f}"),
        ("Total input tokens:", f"{metrics['total_prompt_tokens']}"),
        ("Total generated tokens:", f"{metrics['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    lines = [f"{' ' + title + ' ':=^60}"] + [f"{k:<44}{v:>16}" for k, v in rows]
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^60}")
        lines.append(f"{'Mean ' + name.upper() + ' (ms):':<44}{metrics[f'mean_{name}_ms']:>16.2f}")
        lines += [f"{f'P{p} {name.upper()} (ms):':<44}{metrics[f'p{p}_{name}_ms']:>16.2f}"
                  for p in PERCENTILES]
    lines.append("=" * 60)
    return "\n".join(lines)
