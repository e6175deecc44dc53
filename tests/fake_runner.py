"""A fake model runner for scheduler tests: worker-side bookkeeping without a model.

It keeps its own per-request state from ``SchedulerOutput`` frames exactly as
the real worker must (new data once, diffs after), simulates the paged KV
cache as one token id per slot, and checks on every step that each request's
blocks hold its tokens, which catches wrong prefix-cache hits, block lists and
positions. Its "model" is a deterministic function of the whole sequence; draft
tokens are verified greedily against it (the accepted ones plus one of its own).
``step_pipelined`` drives a scheduler the way async scheduling does: the next plan
runs before the previous step's tokens reach the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.outputs import EngineCoreOutput, ModelRunnerOutput


def next_token(token_ids: list[int], vocab_size: int) -> int:
    """The fake model: a rolling hash of the sequence, so any wrong input shows."""
    h = 0
    for t in token_ids:
        h = (h * 31 + t + 1) % 1_000_003
    return 3 + h % (vocab_size - 3)


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 50) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv = [-1] * (num_blocks * block_size)
        self.requests: dict[str, _State] = {}

    def _slot(self, state: _State, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests
            self.requests[new.req_id] = _State(list(new.prompt_token_ids), list(new.block_ids),
                                               new.num_computed_tokens, len(new.prompt_token_ids))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(cached.new_block_ids[i])
            elif cached.new_block_ids[i] is not None:
                state.block_ids.extend(cached.new_block_ids[i])
            if req_id in cached.all_token_ids:
                state.token_ids = list(cached.all_token_ids[req_id])
            assert len(state.token_ids) - state.num_prompt_tokens == cached.num_output_tokens[i], req_id
            state.num_computed_tokens = cached.num_computed_tokens[i]

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            state = self.requests[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            tokens = state.token_ids + drafts
            start, num = state.num_computed_tokens, so.num_scheduled_tokens[req_id]
            assert num > 0 and start + num <= len(tokens)
            assert len(state.block_ids) * self.block_size >= start + num
            for pos in range(start, start + num):
                self.kv[self._slot(state, pos)] = tokens[pos]
            state.num_computed_tokens = start + num
            # Every earlier position must be readable from the request's own blocks.
            for pos in range(start + num):
                assert self.kv[self._slot(state, pos)] == tokens[pos], (req_id, pos)
            sampled.append(self._verify(state, drafts) if state.num_computed_tokens == len(tokens) else [])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)


    def _verify(self, state: _State, drafts: list[int]) -> list[int]:
        """The accepted drafts and one token of the model's own, appended to the request's tokens."""
        out = []
        for draft in [*drafts, None]:
            out.append(next_token(state.token_ids, self.vocab_size))
            state.token_ids.append(out[-1])
            if out[-1] != draft:
                break
        return out


def step(scheduler: Scheduler, runner: FakeModelRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, runner.execute_model(so))


class Pipeline:
    """Async scheduling's order of calls: plan and run step N + 1, then update the scheduler with step N (but
    a step with drafts is updated before the next plan), as ``EngineCore`` does.

    The fake runner computes a step as soon as it is planned, which is the order the real worker thread keeps
    (step N's sampling, then step N + 1's forward pass), so a planned placeholder is always filled in."""

    def __init__(self, scheduler: Scheduler, runner: FakeModelRunner) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def busy(self) -> bool:
        return self.scheduler.has_requests() or self.in_flight is not None

    def step(self) -> tuple[SchedulerOutput | None, list[EngineCoreOutput]]:
        """One engine-core call: the new plan (None when there was nothing to plan) and the outputs of the
        step that was in flight."""
        outputs = []
        if self.in_flight is not None and self.in_flight[0].scheduled_spec_decode_tokens:
            outputs = self.scheduler.update_from_output(*self.in_flight)  # drafts: no plan behind it
            self.in_flight = None
        so = self.scheduler.schedule() if self.scheduler.has_requests() else None
        if so is not None and not (so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids):
            so = None
        launched = (so, self.runner.execute_model(so)) if so is not None else None
        if self.in_flight is not None:
            outputs = self.scheduler.update_from_output(*self.in_flight)
        self.in_flight = launched
        return so, outputs


def reference_tokens(prompt: list[int], max_tokens: int, vocab_size: int, eos_token_id: int | None = None,
                     max_model_len: int = 10**9) -> list[int]:
    """What a request outputs when run alone, one token at a time."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens and len(tokens) < max_model_len:
        t = next_token(tokens, vocab_size)
        tokens.append(t)
        out.append(t)
        if t == eos_token_id:
            break
    return out
