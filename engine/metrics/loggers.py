"""Stat loggers: what ``AsyncLLM`` reports every engine step to, and the periodic log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.core.spec_decode import SpecDecodingStats
from pagedserve.engine.metrics.stats import IterationStats

logger = logging.getLogger(__name__)


class StatLogger(Protocol):
    """Receives the engine's stats once per step (and once per batch of frontend aborts).

    ``record`` runs on the event loop, between the processing of two steps'
    outputs: it must be cheap (no I/O, no waiting).
    """

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


class LoggingStatLogger:
    """Sums the stats between two ``log()`` calls and logs them as one INFO line, unless idle.

    Idle means no token was processed since the previous line and no request
    is running or waiting. Throughputs are tokens per second over the interval;
    the prefix-cache hit rate and the preemptions are the interval's too. An interval
    that verified drafts adds a speculative decoding line, as vLLM's ``SpecDecodingLogging``:
    mean acceptance length (tokens per draft step: 1 + accepted / drafts), accepted and
    drafted tokens per second, the acceptance rate (accepted / drafted tokens) and the
    acceptance rate at each draft position (accepted there / drafts).

    Args:
        clock: seconds, monotonic; ``time.monotonic`` unless a test needs another.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_log_time = clock()
        self._scheduler_stats: SchedulerStats | None = None
        self._interval = IterationStats()

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._scheduler_stats = scheduler_stats
        total = self._interval
        total.num_prompt_tokens += iteration_stats.num_prompt_tokens
        total.num_generation_tokens += iteration_stats.num_generation_tokens
        total.num_preemptions += iteration_stats.num_preemptions
        total.prefix_cache_queries += iteration_stats.prefix_cache_queries
        total.prefix_cache_hits += iteration_stats.prefix_cache_hits
        if iteration_stats.spec_decoding is not None:
            if total.spec_decoding is None:
                total.spec_decoding = SpecDecodingStats()
            total.spec_decoding.add(iteration_stats.spec_decoding)

    def log(self) -> None:
        """Log the interval since the previous call (if busy) and start a new one."""
        now = self._clock()
        elapsed_s = max(now - self._last_log_time, 1e-9)
        total, stats = self._interval, self._scheduler_stats
        self._last_log_time, self._interval = now, IterationStats()
        has_requests = stats is not None and (stats.num_running_reqs or stats.num_waiting_reqs)
        if stats is None or not (total.num_prompt_tokens or total.num_generation_tokens or has_requests):
            return
        hit_rate = total.prefix_cache_hits / total.prefix_cache_queries if total.prefix_cache_queries else 0.0
        logger.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d reqs, waiting %d reqs, "
            "KV cache usage %.1f%%, prefix cache hit rate %.1f%%, preemptions %d",
            total.num_prompt_tokens / elapsed_s, total.num_generation_tokens / elapsed_s, stats.num_running_reqs,
            stats.num_waiting_reqs, 100 * stats.kv_cache_usage, 100 * hit_rate, total.num_preemptions)
        spec = total.spec_decoding
        if spec is not None and spec.num_drafts:
            logger.info(
                "speculative decoding: mean acceptance length %.2f, accepted throughput %.1f tok/s, drafted "
                "throughput %.1f tok/s, acceptance rate %.1f%%, per-position acceptance rate %s, drafts %d",
                1 + spec.num_accepted_tokens / spec.num_drafts, spec.num_accepted_tokens / elapsed_s,
                spec.num_draft_tokens / elapsed_s, 100 * spec.num_accepted_tokens / spec.num_draft_tokens,
                ", ".join(f"{count / spec.num_drafts:.2f}" for count in spec.num_accepted_tokens_per_pos),
                spec.num_drafts)
