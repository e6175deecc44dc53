"""``benchmarks.step_profile`` and ``benchmarks.core_requests``: reading the engine's regions, driving its core.

The breakdown is checked on a stand-in step that marks the regions through
``pagedserve.engine.profiling.region`` as the engine does, then on a real engine step of a
tiny model, which pins the region names the benchmarks read to those the
engine marks.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.core_requests import CoreRequests
from benchmarks.step_profile import (
    ATTENTION_REGION,
    ATTENTION_ROW,
    FORWARD_REGION,
    PHASE_REGIONS,
    REST_ROW,
    STEP_REGION,
    profile_steps,
    step_breakdown,
)
from pagedserve.engine.profiling import region

NUM_LAYERS = 2
SLEEP_S = 0.002


def _step(phases: tuple[str, ...] = PHASE_REGIONS, attention: bool = True) -> int:
    """A stand-in engine step: each phase sleeps, the forward holds one attention region per layer."""
    with region(STEP_REGION):
        time.sleep(SLEEP_S)  # outside every phase
        for name in phases:
            with region(name):
                time.sleep(SLEEP_S)
                if name == FORWARD_REGION and attention:
                    for _ in range(NUM_LAYERS):
                        with region(ATTENTION_REGION):
                            time.sleep(SLEEP_S)
    return 3


def test_breakdown_has_every_phase_attention_under_the_forward_and_the_rest() -> None:
    profile = profile_steps(_step, 2)
    breakdown = profile.breakdown_ms
    assert profile.sampled == [3, 3] and "Name" in profile.top_ops
    assert list(breakdown) == [STEP_REGION, *PHASE_REGIONS[:4], ATTENTION_ROW, *PHASE_REGIONS[4:], REST_ROW]
    assert all(breakdown[name] >= SLEEP_S * 1e3 for name in PHASE_REGIONS)
    assert breakdown[ATTENTION_ROW] >= NUM_LAYERS * SLEEP_S * 1e3
    assert breakdown[FORWARD_REGION] > breakdown[ATTENTION_ROW]
    # The rest is the step outside the phases, attention not subtracted twice.
    assert breakdown[REST_ROW] == pytest.approx(breakdown[STEP_REGION] - sum(breakdown[n] for n in PHASE_REGIONS))
    assert breakdown[REST_ROW] >= SLEEP_S * 1e3


def test_no_attention_row_when_no_attention_region_ran() -> None:
    breakdown = profile_steps(lambda: _step(attention=False), 1).breakdown_ms
    assert ATTENTION_ROW not in breakdown and FORWARD_REGION in breakdown


def test_a_phase_missing_from_a_step_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="'model_runner.sample': 0"):
        profile_steps(lambda: _step(tuple(n for n in PHASE_REGIONS if n != "model_runner.sample")), 2)
    flaky = iter([PHASE_REGIONS, PHASE_REGIONS[:-1]])
    with pytest.raises(ValueError, match="'scheduler.update_from_output': 1"):
        profile_steps(lambda: _step(next(flaky)), 2)


def test_breakdown_reads_the_profilers_averages_per_step() -> None:
    def event(count: int, total_us: float) -> SimpleNamespace:
        return SimpleNamespace(count=count, cpu_time_total=total_us)

    events = {STEP_REGION: event(4, 40_000.0), **{name: event(4, 4_000.0) for name in PHASE_REGIONS}}
    breakdown = step_breakdown(events, 4)
    assert breakdown[STEP_REGION] == 10.0 and breakdown[FORWARD_REGION] == 1.0
    assert breakdown[REST_ROW] == pytest.approx(10.0 - len(PHASE_REGIONS))


class _FakeCore:
    """An engine core whose every request gets one token per step, after a first step of prefill."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}
        self.steps = 0

    def add_request(self, request: object) -> None:
        self.requests[request.request_id] = request

    def step(self) -> list[SimpleNamespace]:
        self.steps += 1
        tokens = [] if self.steps == 1 else [7]
        return [SimpleNamespace(request_id=r, new_token_ids=tokens) for r in self.requests]

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)


def test_core_requests_are_added_as_the_frontend_would_and_counted_per_step() -> None:
    core = _FakeCore()
    from pagedserve.engine.input_processor import ProcessedRequest

    processor = SimpleNamespace(process=lambda prompt, params: ProcessedRequest(None, prompt, params, 2))
    llm = SimpleNamespace(engine_core=core, processor=processor)
    params = object()
    requests = CoreRequests(llm, [[5, 6], (8,)], params, "p")
    assert list(core.requests) == ["p-0", "p-1"]
    added = core.requests["p-1"]
    assert (added.prompt_token_ids, added.sampling_params, added.eos_token_id) == ([8], params, 2)
    requests.step_until_decoding()
    assert core.steps == 2 and requests.generated == {"p-0": 1, "p-1": 1}
    assert requests.step() == 2
    requests.finish()
    assert not core.requests


def test_a_real_engine_step_marks_every_region_the_benchmarks_read(tmp_path: Path) -> None:
    from benchmarks.gpu.fixtures import build_tokenizer
    from benchmarks.tiny_models import tiny_hf_model
    from pagedserve.engine import LLM, SamplingParams

    tiny_hf_model("llama", tmp_path, tie_word_embeddings=True)
    build_tokenizer(256).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory_bytes="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = CoreRequests(llm, [[5, 6, 7], [8, 9]], params, "contract")
    requests.step_until_decoding()
    profile = profile_steps(requests.step, 2)
    assert profile.sampled == [2, 2]
    assert list(profile.breakdown_ms) == [STEP_REGION, *PHASE_REGIONS[:4], ATTENTION_ROW, *PHASE_REGIONS[4:],
                                          REST_ROW]
    requests.finish()
    assert not llm.engine_core.has_unfinished_requests()
