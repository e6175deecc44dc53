"""Prometheus metrics in vLLM's style, under the ``pagedserve:`` prefix, labelled with ``model_name``.

Gauges describe the engine after its latest step; counters and histograms add
up the ``IterationStats`` recorded since this logger was created. Each logger
has its own ``CollectorRegistry``, so several can live in one process (tests,
several apps on one engine).

The gauges that the Gateway API Inference Extension's endpoint pickers read to
route requests (GIE's model-server protocol; llm-d's scheduler is built on it)
are also exported under vLLM's names (``GATEWAY_ALIASES``), with the same value
and labels, so that a gateway configured for vLLM routes to pagedserve unchanged
(docs/kubernetes.md). The speculative decoding counters are likewise exported under
vLLM's names too (``SPEC_DECODE_ALIASES``), for dashboards made for vLLM's.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.core.spec_decode import SpecDecodingStats
from pagedserve.engine.metrics.stats import IterationStats
from pagedserve.engine.outputs import FinishReason

PREFIX = "pagedserve:"
# Seconds. vLLM's buckets, so that dashboards made for it read ours alike.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

#: Our gauge -> the vLLM names it is exported under too: the defaults of the GIE endpoint picker's
#: --total-queued-requests-metric, --total-running-requests-metric, --kv-cache-usage-percentage-metric and
#: --cache-info-metric. The KV cache usage has two, because the picker's default followed vLLM's rename
#: (vLLM PRs 18354, 29330: gpu_cache_usage_perc deprecated, then removed): gpu_cache_usage_perc up to GIE v1.2,
#: kv_cache_usage_perc from v1.3; with both, pickers of either age read it without a flag.
#: lora_requests_info (--lora-info-metric) is exported with --enable-lora only, as vLLM does.
GATEWAY_ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_requests_running": ("vllm:num_requests_running",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "cache_config_info": ("vllm:cache_config_info",),
    "lora_requests_info": ("vllm:lora_requests_info",),
}

#: Our speculative decoding counters -> vLLM's names for them (vLLM's ``SpecDecodingProm``): acceptance rate =
#: rate(accepted_tokens) / rate(draft_tokens), mean acceptance length = 1 + rate(accepted_tokens) / rate(drafts).
#: Registered whether or not speculation is on (they stay 0 when it is off).
SPEC_DECODE_ALIASES: dict[str, tuple[str, ...]] = {
    name: (f"vllm:{name}",) for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                                         "spec_decode_num_accepted_tokens_total",
                                         "spec_decode_num_accepted_tokens_per_pos_total")}


def buckets_1_2_5(max_value: int) -> list[int]:
    """``[1, 2, 5, 10, 20, 50, ...]`` up to ``max_value`` (token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _Aliased:
    """One gauge or counter value kept under several names (``GATEWAY_ALIASES``, ``SPEC_DECODE_ALIASES``):
    ``set`` and ``inc`` change them all, so that every scrape reads the same value under each name (records
    and scrapes both run on the event loop)."""

    def __init__(self, children: list[Any]) -> None:
        self._children = children

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)

    def inc(self, amount: float) -> None:
        for child in self._children:
            child.inc(amount)


class PrometheusStatLogger:
    """Keeps the ``pagedserve:*`` metrics, and vLLM's names for the gateway's gauges and the speculative
    decoding counters, in ``self.registry``.

    Args:
        model_name: the value of every metric's ``model_name`` label.
        max_model_len: the longest sequence in tokens (top of the token-count buckets).
        block_size: tokens per KV cache block, and
        num_gpu_blocks: blocks in the KV cache: the labels of ``cache_config_info`` (vLLM's label names,
            which the endpoint picker's prefix-cache scorer reads), left out when either is None.
        max_loras: with ``--enable-lora``, its adapter slots: ``lora_requests_info`` is exported; None: not.
    """

    def __init__(self, model_name: str, max_model_len: int, block_size: int | None = None,
                 num_gpu_blocks: int | None = None, max_loras: int | None = None) -> None:
        self.registry = CollectorRegistry()
        token_buckets = buckets_1_2_5(max_model_len)

        def metric(kind: type, name: str, documentation: str, **options: Any) -> Any:
            return kind(PREFIX + name, documentation, ["model_name"], registry=self.registry,
                        **options).labels(model_name)

        def gauge(name: str, documentation: str, **labels: str) -> _Aliased:
            """``pagedserve:<name>`` and its ``GATEWAY_ALIASES``, labelled alike."""
            names = [PREFIX + name, *GATEWAY_ALIASES.get(name, ())]
            return _Aliased([
                Gauge(full_name, documentation, ["model_name", *labels], registry=self.registry)
                .labels(model_name, *labels.values()) for full_name in names])

        def spec_counters(name: str, documentation: str, *labels: str) -> list[Counter]:
            """``pagedserve:<name>`` and its ``SPEC_DECODE_ALIASES``: one family each, children not made yet."""
            return [Counter(full_name, documentation, ["model_name", *labels], registry=self.registry)
                    for full_name in (PREFIX + name, *SPEC_DECODE_ALIASES[name])]

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        if block_size is not None and num_gpu_blocks is not None:
            # An info gauge (always 1) as vLLM has it; the value is in the labels.
            gauge("cache_config_info", "KV cache configuration (in the labels).", block_size=str(block_size),
                  num_gpu_blocks=str(num_gpu_blocks)).set(1)
        # vLLM's LoRA info gauge, which gateways' LoRA affinity reads: the time of the latest step, the adapters
        # with running and with waiting requests (comma-separated names) and the slots in the labels. One series:
        # the previous one is removed when the adapters change.
        self._lora_info = None if max_loras is None else [
            Gauge(full_name, "LoRA adapters of the running and waiting requests (in the labels); the value is the "
                  "time of the latest step.", ["model_name", "max_lora", "waiting_lora_adapters",
                                               "running_lora_adapters"], registry=self.registry)
            for full_name in (PREFIX + "lora_requests_info", *GATEWAY_ALIASES["lora_requests_info"])]
        self._lora_labels: tuple[str, ...] | None = None
        self._max_loras = max_loras
        self.prompt_tokens = metric(Counter, "prompt_tokens_total",
                                    "Prompt tokens of requests that produced their first token.")
        self.generation_tokens = metric(Counter, "generation_tokens_total", "Output tokens generated.")
        self.num_preemptions = metric(Counter, "num_preemptions_total", "Requests preempted (to be recomputed).")
        self.prefix_cache_queries = metric(Counter, "prefix_cache_queries_total",
                                           "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = metric(Counter, "prefix_cache_hits_total",
                                        "Prompt tokens found in the prefix cache.")
        self.time_to_first_token = metric(Histogram, "time_to_first_token_seconds",
                                          "Seconds from arrival to the first output token.", buckets=TTFT_BUCKETS_S)
        self.inter_token_latency = metric(Histogram, "inter_token_latency_seconds",
                                          "Seconds between two outputs of a request.", buckets=ITL_BUCKETS_S)
        self.e2e_request_latency = metric(Histogram, "e2e_request_latency_seconds",
                                          "Seconds from arrival to finish.", buckets=REQUEST_LATENCY_BUCKETS_S)
        self.request_queue_time = metric(Histogram, "request_queue_time_seconds",
                                         "Seconds from arrival to first scheduled.",
                                         buckets=REQUEST_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = metric(Histogram, "request_prompt_tokens", "Prompt tokens per finished request.",
                                            buckets=token_buckets)
        self.request_generation_tokens = metric(Histogram, "request_generation_tokens",
                                                "Output tokens per finished request.", buckets=token_buckets)
        self.iteration_tokens = metric(Histogram, "iteration_tokens_total", "Tokens scheduled per engine step.",
                                       buckets=ITERATION_TOKEN_BUCKETS)
        success = Counter(PREFIX + "request_success_total", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        # Every reason from the start, so that rate() sees the first one of each.
        self.request_success = {reason: success.labels(model_name, reason.value) for reason in FinishReason}
        self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens, self.spec_decode_num_accepted_tokens = (
            _Aliased([family.labels(model_name) for family in spec_counters(name, documentation)])
            for name, documentation in (
                ("spec_decode_num_drafts_total", "Request steps that verified draft tokens (speculative decoding)."),
                ("spec_decode_num_draft_tokens_total", "Draft tokens verified."),
                ("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")))
        self._accepted_per_pos_families = spec_counters(
            "spec_decode_num_accepted_tokens_per_pos_total", "Draft tokens accepted, by position in their step.",
            "position")
        # position -> its counter; made at the first record of a speculating engine (every position, 0 included).
        self.spec_decode_num_accepted_tokens_per_pos: list[_Aliased] = []
        self._model_name = model_name

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.num_requests_running.set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(scheduler_stats.kv_cache_usage)
        if self._lora_info is not None:
            self._record_loras(scheduler_stats)
        stats = iteration_stats
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        for ttft in stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies_s:
            self.inter_token_latency.observe(itl)
        for finished in stats.finished_requests:
            self.request_success[finished.finish_reason].inc()
            self.e2e_request_latency.observe(finished.e2e_latency_s)
            if finished.queue_time_s is not None:
                self.request_queue_time.observe(finished.queue_time_s)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
        if stats.spec_decoding is not None:
            self._record_spec_decoding(stats.spec_decoding)

    def _record_loras(self, stats: SchedulerStats) -> None:
        labels = (self._model_name, str(self._max_loras), ",".join(stats.waiting_lora_adapters),
                  ",".join(stats.running_lora_adapters))
        now = time.time()
        for family in self._lora_info:
            if self._lora_labels is not None and self._lora_labels != labels:
                family.remove(*self._lora_labels)
            family.labels(*labels).set(now)
        self._lora_labels = labels

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        self.spec_decode_num_drafts.inc(spec.num_drafts)
        self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        for position in range(len(per_pos), len(spec.num_accepted_tokens_per_pos)):
            per_pos.append(_Aliased([family.labels(self._model_name, str(position))
                                     for family in self._accepted_per_pos_families]))
        for counter, count in zip(per_pos, spec.num_accepted_tokens_per_pos, strict=False):
            counter.inc(count)
