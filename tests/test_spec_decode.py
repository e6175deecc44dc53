"""Several tokens per request per step: draft tokens verified by the model (speculative decoding).

Test-only proposers stand in for a real drafter: one proposes the oracle's
next tokens (every draft is accepted), one proposes wrong tokens (every draft is
rejected). Either way the output must equal a run without speculation, token
for token, under batching, chunked prefill and preemption; the right drafts
must take fewer steps. The oracle is the engine's own greedy output without
speculation, itself checked against transformers elsewhere (test_model.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import pytest

from pagedserve.engine import LLM
from pagedserve.engine.config import CacheConfig, EngineArgs, SchedulerConfig
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.spec_decode import BACKOFF_FIRST_PAUSE, BACKOFF_WINDOW, DraftGate
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.engine_factory import resolve_engine_config
from pagedserve.engine.request import EngineCoreRequest, Request
from pagedserve.engine.sampling_params import SamplingParams
from tests.fake_runner import FakeModelRunner, Pipeline, next_token, reference_tokens
from tests.fake_runner import step as fake_step

VOCAB = 256


class OracleProposer:
    """Proposes the reference continuation of whichever reference sequence ``token_ids`` is a prefix of."""

    def __init__(self, sequences: Sequence[Sequence[int]], num_speculative_tokens: int, wrong: bool = False):
        self.sequences = [list(s) for s in sequences]
        self.num_speculative_tokens = num_speculative_tokens
        self.wrong = wrong

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        n = len(token_ids)
        for sequence in self.sequences:
            if sequence[:n] == list(token_ids):
                drafts = sequence[n:n + self.num_speculative_tokens]
                # A wrong draft differs from the right one at every position.
                return [(t + 1) % VOCAB for t in drafts] if self.wrong else drafts
        return []


def run(folder: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        drafter=None, **engine_args) -> tuple[dict[str, list[int]], int, EngineCore]:
    """Outputs by request id, the number of steps, and the core."""
    args = dict(model=folder, max_model_len=256, kv_cache_memory_bytes="4MiB") | engine_args
    core = EngineCore(resolve_engine_config(EngineArgs(**args)), drafter=drafter)
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, request_params) in enumerate(zip(prompts, params_list, strict=True)):
        core.add_request(EngineCoreRequest(str(i), prompt, request_params, eos_token_id=None, arrival_time=0.0))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps = 0
    while core.has_unfinished_requests():
        for output in core.step():
            outputs[output.request_id] += output.new_token_ids
        steps += 1
    return outputs, steps, core


PROMPTS = [[(7 * i + 3 * k) % 250 + 3 for k in range(5 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_folder):
    outputs, steps, _ = run(tiny_llama_folder, PROMPTS, GREEDY)
    return outputs, steps


def sequences(outputs: dict[str, list[int]]) -> list[list[int]]:
    return [PROMPTS[int(i)] + tokens for i, tokens in outputs.items()]


@pytest.mark.parametrize("num_speculative_tokens", [1, 4])
def test_right_drafts_are_all_accepted_in_fewer_steps(tiny_llama_folder, reference, num_speculative_tokens):
    expected, steps = reference
    drafter = OracleProposer(sequences(expected), num_speculative_tokens)
    outputs, spec_steps, core = run(tiny_llama_folder, PROMPTS, GREEDY, drafter)
    assert outputs == expected
    # Prefill, then (30 - 1) tokens at k + 1 per step.
    assert spec_steps < steps and spec_steps <= 2 + -(-29 // (num_speculative_tokens + 1)) + 1
    assert core.make_stats().kv_cache_usage == 0.0


#: With async scheduling a request whose last token is in flight runs the drafter's guesses after it, and a
#: step with drafts is finished before the next is planned: the tokens must not change.
ASYNC_SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@ASYNC_SCHEDULING
def test_wrong_drafts_are_all_rejected_and_change_nothing(tiny_llama_folder, reference, async_scheduling):
    expected, steps = reference
    outputs, spec_steps, _ = run(tiny_llama_folder, PROMPTS, GREEDY, OracleProposer(sequences(expected), 3, wrong=True),
                                 async_scheduling=async_scheduling)
    assert outputs == expected and (async_scheduling or spec_steps == steps)


def test_async_scheduling_runs_right_drafts_after_the_token_in_flight(tiny_llama_folder, reference):
    """The drafter's first guess is for the token in flight and is dropped; the others are all accepted."""
    expected, _ = reference
    outputs, _, core = run(tiny_llama_folder, PROMPTS, GREEDY, OracleProposer(sequences(expected), 4),
                           async_scheduling=True)
    assert outputs == expected
    spec = core.make_stats().spec_decoding
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert core.make_stats().kv_cache_usage == 0.0


@ASYNC_SCHEDULING
@pytest.mark.parametrize("wrong", [False, True])
def test_drafts_under_chunked_prefill_and_preemption(tiny_llama_folder, reference, wrong, async_scheduling):
    expected, _ = reference
    drafter = OracleProposer(sequences(expected), 3, wrong=wrong)
    # 22 blocks of 4 tokens cannot hold six requests of up to 80 tokens: requests are preempted.
    outputs, _, core = run(tiny_llama_folder, PROMPTS, GREEDY, drafter, block_size=4, num_gpu_blocks_override=23,
                           long_prefill_token_threshold=8, max_num_batched_tokens=64, max_num_seqs=6,
                           async_scheduling=async_scheduling)
    assert core.make_stats().num_preemptions > 0
    assert outputs == expected


@ASYNC_SCHEDULING
def test_a_stop_inside_the_accepted_drafts_ends_the_request_there(tiny_llama_folder, reference, async_scheduling):
    expected, _ = reference
    stop_token = expected["2"][6]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token])
    plain, _, _ = run(tiny_llama_folder, PROMPTS, params)
    outputs, _, _ = run(tiny_llama_folder, PROMPTS, params, OracleProposer(sequences(expected), 4),
                        async_scheduling=async_scheduling)
    assert outputs == plain
    assert plain["2"] == expected["2"][:expected["2"].index(stop_token) + 1]


@ASYNC_SCHEDULING
def test_drafts_stop_at_max_tokens_and_max_model_len(tiny_llama_folder, reference, async_scheduling):
    expected, _ = reference
    drafter = OracleProposer(sequences(expected), 4)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    outputs, _, _ = run(tiny_llama_folder, PROMPTS, params, drafter, async_scheduling=async_scheduling)
    assert outputs == {i: tokens[:7] for i, tokens in expected.items()}
    # The longest prompt (50 tokens) may grow to max_model_len 60 only.
    outputs, _, _ = run(tiny_llama_folder, PROMPTS, GREEDY, drafter, max_model_len=60,
                        async_scheduling=async_scheduling)
    assert outputs["5"] == expected["5"][:10]


def test_logprobs_of_accepted_drafts_equal_those_without_speculation(tiny_llama_folder, reference):
    expected, _ = reference
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def logprobs(drafter):
        args = dict(model=tiny_llama_folder, max_model_len=256, kv_cache_memory_bytes="4MiB")
        core = EngineCore(resolve_engine_config(EngineArgs(**args)), drafter=drafter)
        core.add_request(EngineCoreRequest("0", PROMPTS[1], params, eos_token_id=None, arrival_time=0.0))
        entries = []
        while core.has_unfinished_requests():
            for output in core.step():
                entries += output.new_logprobs or []
        return entries

    plain, spec = logprobs(None), logprobs(OracleProposer(sequences(expected), 4))
    assert len(spec) == len(plain) == 12
    for got, want in zip(spec, plain, strict=True):
        assert got.token_ids == want.token_ids and got.rank == want.rank
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_seeded_random_requests_are_reproducible_with_drafts(tiny_llama_folder, reference):
    expected, _ = reference
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=100 + i)
              for i in range(len(PROMPTS))]
    drafter = OracleProposer(sequences(expected), 3)
    first, _, _ = run(tiny_llama_folder, PROMPTS, params, drafter)
    second, _, _ = run(tiny_llama_folder, PROMPTS, params, OracleProposer(sequences(expected), 3))
    assert first == second and all(len(tokens) == 20 for tokens in first.values())


def test_drafts_with_prefix_cache_hits(tiny_llama_folder, reference):
    expected, _ = reference
    # The second copy of each prompt waits for a free row, then finds the first copy's blocks cached.
    outputs, _, core = run(tiny_llama_folder, PROMPTS + PROMPTS, GREEDY, OracleProposer(sequences(expected), 3),
                           block_size=4, max_num_seqs=6)
    assert core.make_stats().prefix_cache_hits > 0
    assert outputs == {str(i): expected[str(i % len(PROMPTS))] for i in range(2 * len(PROMPTS))}


# --------------------------------------------------------------------------- stepping aside (scheduler level)


class FakeModelDrafter:
    """Drafts the fake model's own next tokens (``tests.fake_runner``): all right, or all wrong."""

    def __init__(self, num_speculative_tokens: int, right: bool = True):
        self.num_speculative_tokens = num_speculative_tokens
        self.right = right

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        tokens, drafts = list(token_ids), []
        for _ in range(self.num_speculative_tokens):
            tokens.append(next_token(tokens, FAKE_VOCAB))
            drafts.append(tokens[-1] if self.right else tokens[-1] + FAKE_VOCAB)
        return drafts


FAKE_VOCAB = 50


def fake_scheduler(drafter, gate: DraftGate | None = None, max_num_seqs: int = 8,
                   async_scheduling: bool = False) -> tuple[Scheduler, FakeModelRunner]:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, 256, 1024, async_scheduling=async_scheduling),
                          CacheConfig(128, 16), drafter=drafter, draft_gate=gate)
    return scheduler, FakeModelRunner(128, 16, FAKE_VOCAB)


def fake_request(request_id: str, max_tokens: int) -> Request:
    prompt = [3 + (int(request_id) * 7 + k) % 40 for k in range(10)]
    return Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   None, 16)


def run_fake(scheduler: Scheduler, runner: FakeModelRunner) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Outputs by request id, and per step: (requests running when its drafts were proposed, requests with drafts)."""
    outputs: dict[str, list[int]] = {}
    steps, num_running = [], 0
    while scheduler.has_requests():
        so, outs = fake_step(scheduler, runner)
        if so.total_num_scheduled_tokens:  # not the last step, which only frees the finished
            steps.append((num_running, len(so.scheduled_spec_decode_tokens)))
        num_running = len(scheduler.running)
        for output in outs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    return outputs, steps


def expected_fake_outputs(requests: list[Request]) -> dict[str, list[int]]:
    return {r.request_id: reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens, FAKE_VOCAB)
            for r in requests}


def test_no_drafts_in_a_step_with_disable_by_batch_size_running_requests():
    scheduler, runner = fake_scheduler(FakeModelDrafter(2), DraftGate(disable_by_batch_size=3))
    requests = [fake_request(str(i), max_tokens=6 + 8 * i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    outputs, steps = run_fake(scheduler, runner)
    assert outputs == expected_fake_outputs(requests)
    # Proposed while 3 or 4 requests ran: no drafts; while 1 or 2 ran: drafts for each (but for the last
    # step, whose one token left leaves no room for drafts).
    assert steps[0] == (0, 0) and all(with_drafts == 0 for running, with_drafts in steps if running >= 3)
    assert [with_drafts == running for running, with_drafts in steps[1:-1] if running < 3] == [True] * 5


def test_a_request_whose_drafts_keep_failing_backs_off_then_retries():
    scheduler, runner = fake_scheduler(FakeModelDrafter(3, right=False))
    requests = [fake_request("0", max_tokens=60)]
    scheduler.add_request(requests[0])
    outputs, steps = run_fake(scheduler, runner)
    assert outputs == expected_fake_outputs(requests)
    drafted = [with_drafts for _, with_drafts in steps[1:]]  # after the prefill step
    window, pause = [1] * BACKOFF_WINDOW, BACKOFF_FIRST_PAUSE
    expected = window + [0] * pause + window + [0] * 2 * pause + window + [0] * 4 * pause
    assert drafted == expected[:len(drafted)] and len(drafted) == 59
    assert scheduler.make_stats().spec_decoding.num_accepted_tokens == 0


def test_right_drafts_never_back_off_and_are_counted_per_position():
    scheduler, runner = fake_scheduler(FakeModelDrafter(3))
    requests = [fake_request(str(i), max_tokens=25) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    outputs, steps = run_fake(scheduler, runner)
    assert outputs == expected_fake_outputs(requests)
    # Prefill, then 24 tokens at 4 a step (the last step's drafts are cut to fit max_tokens).
    assert len(steps) == 1 + 6
    spec = scheduler.make_stats().spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (18, 3 * 18, 3 * 18)
    assert spec.num_accepted_tokens_per_pos == [18, 18, 18]
    assert scheduler.draft_gate._requests == {}  # forgotten once finished


# --------------------------------------------------------------------------- prompt lookup on real weights

#: Text the embedded SmolLM2 goes on copying: each prompt holds the passage twice and then breaks off in its third
#: copy, so the continuation repeats the passage and prompt lookup drafts are mostly right.
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden screw press into a practical system. Within decades, "
    "print shops spread across Europe, books became cheaper, and literacy rose. ")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
REAL_GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def grounded_prompts() -> list[str]:
    return [PASSAGE * 2 + PASSAGE[:60 + 40 * i].rstrip() for i in range(3)] + ["Write a short poem about the sea."]


@pytest.fixture(scope="module")
def real_reference(grounded_prompts) -> list[list[int]]:
    """The embedded model's greedy output without speculation (itself equal to transformers', test_llm.py)."""
    llm = LLM(max_model_len=512, kv_cache_memory_bytes="64MiB")
    return [o.outputs[0].token_ids for o in llm.generate(grounded_prompts, REAL_GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def ngram_llm() -> LLM:
    """Prompt lookup through --speculative-config, with prefill chunks of 32 tokens in steps of 64 and a KV
    cache of 13 blocks (208 tokens) that cannot hold the four requests (18 blocks even with their shared
    prefix cached): some are preempted."""
    return LLM(max_model_len=512, speculative_config=json.dumps(NGRAM), max_num_batched_tokens=64,
               long_prefill_token_threshold=32, num_gpu_blocks_override=14)


@pytest.mark.slow
def test_prompt_lookup_greedy_output_equals_plain_decoding_on_real_weights(ngram_llm, grounded_prompts,
                                                                         real_reference):
    outputs = [o.outputs[0].token_ids for o in ngram_llm.generate(grounded_prompts, REAL_GREEDY, use_tqdm=False)]
    assert outputs == real_reference
    stats = ngram_llm.engine_core.make_stats()
    assert stats.num_preemptions > 0
    spec = stats.spec_decoding
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > spec.num_draft_tokens / 2  # copying pays


@pytest.mark.slow
def test_seeded_random_sampling_with_prompt_lookup_is_reproducible(ngram_llm, grounded_prompts):
    """The same request gives the same tokens, though the second time its prompt is a prefix-cache hit.

    Only as long as it gets the same drafts: how many random draws a step takes depends on its drafts,
    so a request whose drafts a full batch cuts short (token budget, KV blocks) may sample other tokens.
    """
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7)

    def sample() -> list[int]:
        return ngram_llm.generate(grounded_prompts[1], params, use_tqdm=False)[0].outputs[0].token_ids

    drafts_before = ngram_llm.engine_core.make_stats().spec_decoding.num_drafts
    assert sample() == sample()
    assert ngram_llm.engine_core.make_stats().spec_decoding.num_drafts > drafts_before


def test_the_engine_says_at_start_that_speculation_is_on(tiny_llama_folder, caplog):
    config = {"method": "ngram", "num_speculative_tokens": 3}
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.engine_core"):
        run(tiny_llama_folder, PROMPTS[:1], GREEDY, speculative_config=config)
        run(tiny_llama_folder, PROMPTS[:1], GREEDY)
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedserve.engine.engine_core"
             and r.getMessage().startswith("speculative decoding")]
    assert lines == ["speculative decoding: method=ngram, num_speculative_tokens=3, prompt_lookup_min=5, "
                     "prompt_lookup_max=5, disable_by_batch_size=None"]



@pytest.mark.parametrize("right", [True, False])
def test_async_scheduling_with_drafts_gives_the_same_tokens_in_pipeline_order(right):
    """Against the fake runner driven as the engine core drives it: steps without drafts are planned behind the
    step in flight, a step with drafts is finished first."""
    scheduler, runner = fake_scheduler(FakeModelDrafter(3, right=right), async_scheduling=True)
    requests = [fake_request(str(i), max_tokens=5 + 7 * i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    pipeline = Pipeline(scheduler, runner)
    outputs: dict[str, list[int]] = {}
    pipelined = 0
    while pipeline.busy():
        in_flight = pipeline.in_flight
        so, outs = pipeline.step()
        pipelined += in_flight is not None and so is not None and not in_flight[0].scheduled_spec_decode_tokens
        for output in outs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert outputs == expected_fake_outputs(requests)
    spec = scheduler.make_stats().spec_decoding
    assert spec.num_draft_tokens > 0 and pipelined > 0
    assert (spec.num_accepted_tokens == spec.num_draft_tokens) if right else spec.num_accepted_tokens == 0
    assert scheduler.kv_cache_manager.usage == 0
