"""Per-request timestamps turned into the latencies and token counts that metrics report.

Every timestamp is ``time.monotonic()`` seconds in this process:

- arrival: the frontend, when the request is added;
- first scheduled: the scheduler, the first time it gives the request tokens,
  carried to the frontend on ``EngineCoreOutput.first_scheduled_time``;
- first token, later tokens, finished: the frontend, when it processes the
  step's outputs (what a client sees, give or take the HTTP write).

Queue time = first scheduled - arrival; time to first token (TTFT) = first
token - arrival; inter-token latency (ITL) = time between two outputs with
tokens; end-to-end latency = finished - arrival.

The frontend calls ``RequestStatsTracker`` on its own thread (the event loop):
the engine thread only stamps ``first_scheduled_time`` once per request and
counts scheduled tokens once per step.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.core.spec_decode import SpecDecodingStats
from pagedserve.engine.outputs import EngineCoreOutput, FinishReason


@dataclass
class FinishedRequestStats:
    """One finished request (one completion: a request with ``n`` completions makes ``n``).

    Attributes:
        finish_reason: stop, length, abort or error.
        e2e_latency_s: seconds from arrival to finish.
        queue_time_s: seconds from arrival to first scheduled; None when the
            frontend never heard of its scheduling (aborted before any output).
        num_prompt_tokens: tokens of its prompt.
        num_generation_tokens: output tokens the frontend received (as counted in ``usage``).
    """

    finish_reason: FinishReason
    e2e_latency_s: float
    queue_time_s: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What changed since the previous record: one engine step, or requests aborted between steps.

    Attributes:
        num_scheduled_tokens: tokens the step ran (0 when the record covers no step,
            or a step that only cleaned up finished requests).
        num_prompt_tokens: prompt tokens of requests whose first token arrived;
            a prompt shared by ``n`` completions counts once, as in ``usage``.
        num_generation_tokens: output tokens that arrived.
        num_preemptions: requests preempted.
        prefix_cache_queries: prompt tokens looked up in the prefix cache.
        prefix_cache_hits: of those, tokens found.
        time_to_first_tokens_s: one TTFT (seconds) per request whose first token arrived.
        inter_token_latencies_s: one ITL (seconds) per later output with tokens.
        finished_requests: the requests that finished.
        spec_decoding: drafts and accepted tokens (speculative decoding); None when the engine has no drafter.
    """

    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    spec_decoding: SpecDecodingStats | None = None


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    num_prompt_tokens_counted: int  # num_prompt_tokens, or 0 for the siblings of a shared prompt
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class RequestStatsTracker:
    """Follows each request from arrival to finish and builds one ``IterationStats`` per record.

    Args:
        scheduler_stats: the engine's stats now; later steps are counted from them.
    """

    def __init__(self, scheduler_stats: SchedulerStats) -> None:
        self._prev_scheduler_stats = scheduler_stats
        self._requests: dict[str, _RequestTimes] = {}

    def add_request(self, request_ids: list[str], num_prompt_tokens: int, arrival_time: float) -> None:
        """Start following the engine requests of one prompt.

        Args:
            request_ids: the engine request of each completion (``n`` of them) sharing the prompt.
            num_prompt_tokens: tokens of the prompt.
            arrival_time: ``time.monotonic()`` seconds when the frontend got the request.
        """
        for index, request_id in enumerate(request_ids):
            self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens,
                                                       num_prompt_tokens if index == 0 else 0)

    def make_iteration_stats(self, outputs: Iterable[EngineCoreOutput], stopped_ids: Collection[str],
                             scheduler_stats: SchedulerStats, now: float) -> IterationStats:
        """Account one engine step.

        Args:
            outputs: the step's outputs; those of requests no longer followed
                (aborted, or finished by a stop string) are ignored, as the frontend ignores them.
            stopped_ids: requests the frontend finished this step with a stop string.
            scheduler_stats: the engine's stats right after the step.
            now: ``time.monotonic()`` seconds when the frontend processed the outputs.
        """
        prev, self._prev_scheduler_stats = self._prev_scheduler_stats, scheduler_stats
        stats = IterationStats(
            num_scheduled_tokens=scheduler_stats.num_scheduled_tokens - prev.num_scheduled_tokens,
            num_preemptions=scheduler_stats.num_preemptions - prev.num_preemptions,
            prefix_cache_queries=scheduler_stats.prefix_cache_queries - prev.prefix_cache_queries,
            prefix_cache_hits=scheduler_stats.prefix_cache_hits - prev.prefix_cache_hits)
        if scheduler_stats.spec_decoding is not None:
            stats.spec_decoding = scheduler_stats.spec_decoding.minus(prev.spec_decoding)
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if times.first_scheduled_time is None:
                times.first_scheduled_time = output.first_scheduled_time
            if output.new_token_ids:
                if times.last_token_time is None:
                    stats.time_to_first_tokens_s.append(now - times.arrival_time)
                    stats.num_prompt_tokens += times.num_prompt_tokens_counted
                else:
                    stats.inter_token_latencies_s.append(now - times.last_token_time)
                times.last_token_time = now
                times.num_generation_tokens += len(output.new_token_ids)
                stats.num_generation_tokens += len(output.new_token_ids)
            reason = FinishReason.STOP if output.request_id in stopped_ids else output.finish_reason
            if reason is not None:
                stats.finished_requests.append(self._finish(output.request_id, reason, now))
        return stats

    def abort_requests(self, request_ids: Iterable[str], now: float) -> IterationStats:
        """Finish requests the frontend aborted (client gone, shutdown); unknown ids are ignored."""
        return IterationStats(finished_requests=[self._finish(request_id, FinishReason.ABORT, now)
                                                 for request_id in request_ids if request_id in self._requests])

    def _finish(self, request_id: str, reason: FinishReason, now: float) -> FinishedRequestStats:
        times = self._requests.pop(request_id)
        scheduled = times.first_scheduled_time
        return FinishedRequestStats(
            finish_reason=reason, e2e_latency_s=now - times.arrival_time,
            queue_time_s=None if scheduled is None else scheduled - times.arrival_time,
            num_prompt_tokens=times.num_prompt_tokens, num_generation_tokens=times.num_generation_tokens)
