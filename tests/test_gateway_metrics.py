"""/metrics under the names an inference gateway's endpoint picker reads (docs/kubernetes.md).

The Gateway API Inference Extension's picker (and llm-d's, built on it) scrapes
each model server's /metrics and, unless told otherwise, reads vLLM's names:
queue depth, running requests, KV cache usage and the cache configuration
(``--total-queued-requests-metric``, ``--total-running-requests-metric``,
``--kv-cache-usage-percentage-metric``, ``--cache-info-metric``; the first
three are the model-server protocol's, docs/proposals/003-model-server-protocol
in GIE's repository). pagedserve exports each of those gauges under vLLM's names
too, with the value and labels of its ``pagedserve:`` gauge, so that such a
picker routes to pagedserve without configuration.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.metrics.prometheus import GATEWAY_ALIASES, PrometheusStatLogger
from pagedserve.engine.metrics.stats import IterationStats
from tests.conftest import Served
from tests.test_metrics import scheduler_stats
from tests.test_server import wait_until_idle

#: The names GIE's picker reads by default, from its sources: vllm:gpu_cache_usage_perc up to v1.2, then
#: vllm:kv_cache_usage_perc (after vLLM's rename); --total-running-requests-metric since v1.3 and
#: --cache-info-metric (whose block_size and num_gpu_blocks labels size the prefix-cache scorer's blocks)
#: since v1.1; llm-d's router keeps the v1.3+ names for pods without an engine-type label.
PICKER_DEFAULTS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                   "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"}
#: The LoRA metric (--lora-info-metric): exported with --enable-lora only, as vLLM does.
LORA_INFO = "vllm:lora_requests_info"


def gauges(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Gauge families of a Prometheus text page: name -> [(labels, value)], as a picker parses them (a
    picker reads a gauge's value only from a family typed gauge)."""
    return {family.name: [(sample.labels, sample.value) for sample in family.samples]
            for family in text_string_to_metric_families(text) if family.type == "gauge"}


def assert_aliases_equal_their_gauges(page: dict[str, list[tuple[dict[str, str], float]]]) -> None:
    for ours, aliases in GATEWAY_ALIASES.items():
        for alias in aliases if f"pagedserve:{ours}" in page else ():
            assert page[alias] == page[f"pagedserve:{ours}"], (alias, page[alias], page[f"pagedserve:{ours}"])


def test_aliases_are_the_picker_defaults_and_lora_is_left_out_without_adapters() -> None:
    assert {alias for aliases in GATEWAY_ALIASES.values() for alias in aliases} == PICKER_DEFAULTS | {LORA_INFO}
    page = gauges(generate_latest(PrometheusStatLogger("m", 2048, 16, 100).registry).decode())
    assert PICKER_DEFAULTS <= set(page) and LORA_INFO not in page


def test_the_lora_info_gauge_names_the_adapters_of_the_latest_step_in_one_series() -> None:
    logger = PrometheusStatLogger("m", 2048, 16, 100, max_loras=4)
    for running, waiting in [({"sql": 2, "chat": 1}, {"law": 1}), ({"law": 1}, {})]:
        logger.record(scheduler_stats(running_lora_adapters=running, waiting_lora_adapters=waiting), IterationStats())
        page = gauges(generate_latest(logger.registry).decode())
        assert_aliases_equal_their_gauges(page)
        [(labels, value)] = page[LORA_INFO]
        assert labels == {"model_name": "m", "max_lora": "4", "running_lora_adapters": ",".join(running),
                          "waiting_lora_adapters": ",".join(waiting)} and value > 1.7e9  # a Unix time


def test_each_record_sets_the_aliases_to_the_same_values_and_labels() -> None:
    logger = PrometheusStatLogger("my-model", 2048, block_size=16, num_gpu_blocks=1234)
    registry_page: dict[str, Any] = {}
    for stats in (scheduler_stats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25),
                  scheduler_stats(num_running_reqs=1, kv_cache_usage=0.0625)):
        logger.record(stats, IterationStats())
        registry_page = gauges(generate_latest(logger.registry).decode())
        assert_aliases_equal_their_gauges(registry_page)
        model = {"model_name": "my-model"}
        assert registry_page["vllm:num_requests_running"] == [(model, stats.num_running_reqs)]
        assert registry_page["vllm:num_requests_waiting"] == [(model, stats.num_waiting_reqs)]
        assert registry_page["vllm:kv_cache_usage_perc"] == [(model, stats.kv_cache_usage)]
    # vLLM's info gauge: 1, the configuration in the labels (the picker parses them as integers).
    assert registry_page["vllm:cache_config_info"] == [
        ({"model_name": "my-model", "block_size": "16", "num_gpu_blocks": "1234"}, 1.0)]


def test_served_metrics_carry_the_gateway_names_with_our_values(served: Served) -> None:
    """The real server, during a request and after it: each vLLM name equals its pagedserve: gauge, the
    model_name label included, and cache_config_info describes the engine's KV cache."""
    wait_until_idle(served.engine)
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the request is running now
        during = gauges(httpx.get(f"{served.url}/metrics", timeout=30).text)
        assert [line for line in lines if line == "data: [DONE]"] == ["data: [DONE]"]
    assert_aliases_equal_their_gauges(during)
    [(labels, running)] = during["vllm:num_requests_running"]
    assert labels == {"model_name": served.engine.model_name} and running >= 1
    [(_, usage)] = during["vllm:kv_cache_usage_perc"]
    assert 0 < usage <= 1

    wait_until_idle(served.engine)
    after = gauges(httpx.get(f"{served.url}/metrics", timeout=30).text)
    assert_aliases_equal_their_gauges(after)
    assert after["vllm:num_requests_running"][0][1] == after["vllm:num_requests_waiting"][0][1] == 0
    cache = served.engine.client.core.config.cache_config
    assert after["vllm:cache_config_info"] == [({"model_name": served.engine.model_name,
                                                 "block_size": str(cache.block_size),
                                                 "num_gpu_blocks": str(cache.num_blocks)}, 1.0)]
    assert LORA_INFO not in after
