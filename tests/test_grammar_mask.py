"""The sampler's allowed-token mask, driven through the engine by a test-only grammar.

The grammar allows a fixed set of tokens to the requests it constrains; the
scheduler side hands its packed bitmask (``GrammarOutput``) to
``sample_tokens`` between the forward pass and sampling, as a real
structured-output manager will. Constrained rows, greedy and sampled, must
only produce allowed tokens; free rows in the same batch must be unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.engine_factory import resolve_engine_config
from pagedserve.engine.request import EngineCoreRequest, Request
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 256
ALLOWED = [3, 40, 77, 255]


class FixedTokensGrammar:
    """Constrains the requests whose id starts with ``c`` (which carry a placeholder constraint) to
    ``ALLOWED``; its grammars are always ready and accept whatever they allowed."""

    def __init__(self) -> None:
        words = np.zeros(-(-VOCAB // 32), dtype=np.uint32)
        for token in ALLOWED:
            words[token // 32] |= np.uint32(1) << np.uint32(token % 32)
        self.row = words.view(np.int32)
        self.calls = 0

    def add_request(self, request: Request) -> None:
        pass

    def grammar_error(self, request_id: str) -> str | None:
        return None

    def grammar_ready(self, request_id: str) -> bool:
        return True

    def wait_for_grammars(self, timeout_s: float) -> None:
        pass

    def grammar_bitmask(self, requests: dict[str, Request], scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        self.calls += 1
        ids = [r for r in scheduler_output.num_scheduled_tokens if r.startswith("c")]
        if not ids:
            return None
        return GrammarOutput(ids, np.stack([self.row] * len(ids)))

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> str | None:
        return None if set(token_ids) <= set(ALLOWED) else "not allowed"

    def is_terminated(self, request_id: str) -> bool:
        return False

    def remove_request(self, request_id: str) -> None:
        pass


class RepeatLastTokenProposer:
    """Drafts the last token twice: right often enough with a tiny random model to exercise both outcomes."""

    num_speculative_tokens = 2

    def propose(self, token_ids: list[int]) -> list[int]:
        return [token_ids[-1]] * 2


PLACEHOLDER = StructuredOutputsParams(regex="x")


def run(folder: str, params: dict[str, SamplingParams], grammar=None, drafter=None) -> dict[str, list[int]]:
    core = EngineCore(resolve_engine_config(EngineArgs(model=folder, max_model_len=128,
                                                         kv_cache_memory_bytes="4MiB")),
                      structured_output_manager=grammar, drafter=drafter)
    for i, (request_id, request_params) in enumerate(params.items()):
        if grammar is not None and request_id.startswith("c"):
            request_params = dataclasses.replace(request_params, structured_outputs=PLACEHOLDER)
        prompt = [(11 * i + k) % 250 + 3 for k in range(4 + 3 * i)]
        core.add_request(EngineCoreRequest(request_id, prompt, request_params, eos_token_id=None, arrival_time=0.0))
    outputs = {request_id: [] for request_id in params}
    while core.has_unfinished_requests():
        for output in core.step():
            assert output.error is None, output
            outputs[output.request_id] += output.new_token_ids
    return outputs


def test_constrained_rows_only_sample_allowed_tokens_and_free_rows_are_unchanged(tiny_llama_folder):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    params = {"free-greedy": greedy, "c-greedy": greedy,
              "free-sampled": SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1),
              "c-sampled": SamplingParams(temperature=1.5, max_tokens=200, ignore_eos=True, seed=2),
              "c-top-k": SamplingParams(temperature=1.0, top_k=5, max_tokens=16, ignore_eos=True, seed=3)}
    grammar = FixedTokensGrammar()
    constrained = run(tiny_llama_folder, params, grammar)
    free = run(tiny_llama_folder, params)
    assert grammar.calls > 0
    for request_id in ("free-greedy", "free-sampled"):
        assert constrained[request_id] == free[request_id]
    for request_id in ("c-greedy", "c-sampled", "c-top-k"):
        assert set(constrained[request_id]) <= set(ALLOWED)
        assert not set(free[request_id]) <= set(ALLOWED)  # the mask, not the model, made them so
    # Sampled at a high temperature over 200 tokens, the constrained row reaches every allowed token.
    assert set(constrained["c-sampled"]) == set(ALLOWED)


def test_constrained_rows_share_steps_with_drafting_rows(tiny_llama_folder):
    """Free requests run drafts while constrained ones (which get none) sample under their masks, in
    the same steps: the free greedy outputs equal their outputs without drafts or grammars."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    params = {"free-a": greedy, "c-greedy": greedy, "free-b": greedy,
              "c-sampled": SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=2)}
    plain = run(tiny_llama_folder, params)
    mixed = run(tiny_llama_folder, params, FixedTokensGrammar(), RepeatLastTokenProposer())
    assert mixed["free-a"] == plain["free-a"] and mixed["free-b"] == plain["free-b"]
    for request_id in ("c-greedy", "c-sampled"):
        assert len(mixed[request_id]) == 16 and set(mixed[request_id]) <= set(ALLOWED)
