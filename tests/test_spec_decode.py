"""Several tokens per request per step: draft tokens verified by the model (speculative decoding).

Test-only proposers stand in for a real drafter: one proposes the oracle's
next tokens (every draft is accepted), one proposes wrong tokens (every draft is
rejected). Either way the output must equal a run without speculation, token
for token, under batching, chunked prefill and preemption; the right drafts
must take fewer steps. The oracle is the engine's own greedy output without
speculation, itself checked against transformers elsewhere (test_model.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.config import EngineArgs, EngineConfig
from engine.engine_core import EngineCore
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams

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
    core = EngineCore(EngineConfig.from_args(EngineArgs(**args)), drafter=drafter)
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


def test_wrong_drafts_are_all_rejected_and_change_nothing(tiny_llama_folder, reference):
    expected, steps = reference
    outputs, spec_steps, _ = run(tiny_llama_folder, PROMPTS, GREEDY, OracleProposer(sequences(expected), 3, wrong=True))
    assert outputs == expected and spec_steps == steps


@pytest.mark.parametrize("wrong", [False, True])
def test_drafts_under_chunked_prefill_and_preemption(tiny_llama_folder, reference, wrong):
    expected, _ = reference
    drafter = OracleProposer(sequences(expected), 3, wrong=wrong)
    # 22 blocks of 4 tokens cannot hold six requests of up to 80 tokens: requests are preempted.
    outputs, _, core = run(tiny_llama_folder, PROMPTS, GREEDY, drafter, block_size=4, num_gpu_blocks_override=23,
                           long_prefill_token_threshold=8, max_num_batched_tokens=64, max_num_seqs=6)
    assert core.make_stats().num_preemptions > 0
    assert outputs == expected


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there(tiny_llama_folder, reference):
    expected, _ = reference
    stop_token = expected["2"][6]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token])
    plain, _, _ = run(tiny_llama_folder, PROMPTS, params)
    outputs, _, _ = run(tiny_llama_folder, PROMPTS, params, OracleProposer(sequences(expected), 4))
    assert outputs == plain
    assert plain["2"] == expected["2"][:expected["2"].index(stop_token) + 1]


def test_drafts_stop_at_max_tokens_and_max_model_len(tiny_llama_folder, reference):
    expected, _ = reference
    drafter = OracleProposer(sequences(expected), 4)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    outputs, _, _ = run(tiny_llama_folder, PROMPTS, params, drafter)
    assert outputs == {i: tokens[:7] for i, tokens in expected.items()}
    # The longest prompt (50 tokens) may grow to max_model_len 60 only.
    outputs, _, _ = run(tiny_llama_folder, PROMPTS, GREEDY, drafter, max_model_len=60)
    assert outputs["5"] == expected["5"][:10]


def test_logprobs_of_accepted_drafts_equal_those_without_speculation(tiny_llama_folder, reference):
    expected, _ = reference
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def logprobs(drafter):
        args = dict(model=tiny_llama_folder, max_model_len=256, kv_cache_memory_bytes="4MiB")
        core = EngineCore(EngineConfig.from_args(EngineArgs(**args)), drafter=drafter)
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
