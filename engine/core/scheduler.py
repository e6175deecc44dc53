"""The scheduler: which requests run how many tokens each step (docs/architecture.md, "The scheduler side").

There is no prefill or decode phase. Every request has ``num_tokens`` and
``num_computed_tokens``; each step gives it up to the difference, within the
token budget, the running-request limit and the free KV blocks. Running
requests go first, then waiting ones in arrival order. When a running
request cannot get blocks, the latest-arrived running request is preempted
by recompute (its blocks are freed and it is recomputed later from its
tokens), as in vLLM V1 and Kwon et al. 2023 (PagedAttention, arXiv:2309.06180).

LoRA adapters: the running requests use at most ``SchedulerConfig.max_loras`` distinct adapters (the worker's
slots); a waiting request of another adapter is skipped, keeping its place, until one of them is done. Behind it
only base-model requests are admitted, so that the running adapters drain and it gets a slot (it would wait for
ever behind a steady stream of their requests).

Structured output: a constrained request waits in the queue, skipped but keeping its place, until
its grammar has compiled (off the engine thread); after each step its manager advances the grammar by
the new tokens, and a grammar that allows nothing more finishes the request.

Speculative decoding: a request's draft tokens (``Request.spec_token_ids``,
from the drafter after each step) are scheduled after its last token like any
other tokens; ``update_from_output`` keeps the accepted ones and rolls
``num_computed_tokens`` back past the rejected ones. A ``DraftGate`` decides which
requests the drafter is asked for (``pagedserve.engine.core.spec_decode``: no drafts in a busy
batch or for a request whose drafts keep failing); ``SpecDecodingStats`` counts
drafts and accepted tokens for the metrics.

Async scheduling (``SchedulerConfig.async_scheduling``, vLLM's ``--async-scheduling``): the engine core
plans step N + 1 before step N's tokens come back. A step that samples a request's next token adds one
to its ``num_output_placeholders``, so that the next plan runs that token (the worker fills it in from
its own sample) though its id is not known here yet; ``update_from_output`` swaps the placeholder for
the token. A request that step N finishes has run one more token in step N + 1, which nobody sees.
A request whose placeholders already reach ``max_tokens`` or ``max_model_len`` is not planned again.
With speculative decoding, a request whose last token is in flight gets the drafter's guesses for the
tokens after it: the drafter's first token guesses the one in flight and is dropped, and the rest run
after the placeholder (wrong guesses are rejected like any draft). A step with drafts is not planned
behind: how many of them are accepted decides where its requests stand, so the engine core takes its
tokens before it plans the next step.

This package imports no torch.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.engine.config import CacheConfig, SchedulerConfig
from pagedserve.engine.core.draft_proposer import DraftProposer
from pagedserve.engine.core.grammar_protocol import StructuredOutputManager
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.scheduler_output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from pagedserve.engine.core.spec_decode import DraftGate, SpecDecodingStats
from pagedserve.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from pagedserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    """A snapshot for metrics and logs. Counters are totals since start."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float          # 0..1
    prefix_cache_queries: int      # tokens
    prefix_cache_hits: int         # tokens
    num_preemptions: int
    num_scheduled_tokens: int      # tokens, summed over every schedule()
    spec_decoding: SpecDecodingStats | None = None  # None when the engine has no drafter
    running_lora_adapters: dict[str, int] = field(default_factory=dict)  # adapter name -> requests
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


@dataclass
class _StepPlan:
    """What one ``schedule()`` call decided, before it is packed into a ``SchedulerOutput``."""

    token_budget: int
    num_scheduled_tokens: dict[str, int]
    new_block_ids: dict[str, list[int]]
    spec_decode_tokens: dict[str, list[int]]
    new_reqs: list[Request]
    resumed_reqs: list[Request]
    running_reqs: list[Request]
    preempted_reqs: list[Request]


class Scheduler:
    """Owns requests, queues, the token budget and KV block allocation.

    Args:
        scheduler_config: budgets and limits.
        cache_config: KV cache size and prefix caching.
        structured_output_manager: fills the allowed-token masks of constrained requests; None = no
            request is constrained.
        drafter: proposes draft tokens for decoding requests after each step; None = no speculation.
        draft_gate: which requests the drafter is asked for; None = ``DraftGate()`` (the per-request
            back-off, no batch-size limit).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 structured_output_manager: StructuredOutputManager | None = None,
                 drafter: DraftProposer | None = None, draft_gate: DraftGate | None = None) -> None:
        self.config = scheduler_config
        self.structured_output_manager = structured_output_manager
        self.drafter = drafter
        self.draft_gate = draft_gate or DraftGate()
        self.spec_decoding_stats = SpecDecodingStats.new(drafter.num_speculative_tokens) if drafter else None
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching, cache_config.sliding_window)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(); handed to the worker, then replaced.
        self.finished_req_ids: set[str] = set()
        self._prev_step_scheduled: set[str] = set()
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # summed over steps, for the iteration-tokens metric
        # Requests failed while waiting (a grammar that did not compile), reported by the next update.
        self._failed_waiting: list[EngineCoreOutput] = []

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request.

        The frontend's ``InputProcessor`` has checked that it fits ``max_model_len`` and the KV cache.

        Raises:
            ValueError: when its id is taken, or it is constrained and there is no structured output manager.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("this engine has no structured output manager")
            self.structured_output_manager.add_request(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Finish requests from outside the step (aborts); their blocks are freed now.

        Unknown or already finished ids are ignored.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished_running = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                finished_running.add(request_id)
            else:
                self.waiting.remove(request)
            self._free_request(request, status)
        if finished_running:
            self.running = [r for r in self.running if r.request_id not in finished_running]

    def has_requests(self) -> bool:
        """True while anything is queued, running, or waiting for cleanup on the worker."""
        return bool(self.waiting or self.running or self.finished_req_ids or self._failed_waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
                              prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=self.num_preemptions,
                              num_scheduled_tokens=self.num_scheduled_tokens,
                              spec_decoding=self.spec_decoding_stats.copy() if self.spec_decoding_stats else None,
                              running_lora_adapters=_adapters(self.running),
                              waiting_lora_adapters=_adapters(self.waiting))

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step. See the module docstring for the policy."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens, num_scheduled_tokens={},
                         new_block_ids={}, spec_decode_tokens={}, new_reqs=[], resumed_reqs=[], running_reqs=[],
                         preempted_reqs=[])
        self._schedule_running(plan)
        # A step that had to preempt is short of blocks: admitting new work would thrash.
        if not plan.preempted_reqs:
            self._schedule_waiting(plan)
        output = self._make_output(plan)
        self._update_after_schedule(output)
        return output

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        num_new_tokens = (request.num_tokens + len(request.spec_token_ids) + request.num_output_placeholders
                          - num_computed_tokens)
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return min(num_new_tokens, token_budget)

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            if request.num_output_placeholders and self._placeholders_end(request):
                index += 1  # its last token is in flight: nothing after it would be seen
                continue
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if request.spec_token_ids and not self.kv_cache_manager.can_allocate(request, num_new_tokens):
                # Short of blocks: drop this request's drafts before preempting anyone for them.
                request.spec_token_ids = []
                num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new_tokens)) is None:
                # Requests ahead of `index` are already scheduled; the victim is
                # always the latest arrival, possibly this request itself.
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted_reqs.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            plan.running_reqs.append(request)
            if request.spec_token_ids:
                # The budget may cut the drafts short; those left out are dropped.
                num_drafts = (request.num_computed_tokens + num_new_tokens - request.num_tokens
                              - request.num_output_placeholders)
                if num_drafts > 0:
                    plan.spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
                request.spec_token_ids = []
            plan.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens
            index += 1

    def _placeholders_end(self, request: Request) -> bool:
        """Whether the tokens in flight take ``request`` to ``max_tokens`` or ``max_model_len`` (async scheduling)."""
        num_in_flight = request.num_output_placeholders
        max_model_len = self.config.max_model_len
        max_tokens = request.sampling_params.max_tokens or max_model_len
        return (request.num_output_tokens + num_in_flight >= max_tokens
                or request.num_tokens + num_in_flight >= max_model_len)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        skipped: list[Request] = []  # waiting for their grammar or an adapter slot; they keep their place
        max_loras = self.config.max_loras
        lora_ids = {r.lora_request.lora_int_id for r in self.running if r.lora_request} if max_loras else set()
        waits_for_slot = False  # a request before this one waits for an adapter slot
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            lora = request.lora_request
            if lora is not None and max_loras and (waits_for_slot or (lora.lora_int_id not in lora_ids
                                                                      and len(lora_ids) >= max_loras)):
                waits_for_slot = True
                skipped.append(self.waiting.popleft())
                continue
            if request.sampling_params.structured_outputs is not None:
                grammars = self.structured_output_manager
                error = grammars.grammar_error(request.request_id)
                if error is not None:  # the frontend compiles grammars first, so only a fault gets here
                    self.waiting.popleft()
                    self._failed_waiting.append(self._fail_request(request, error))
                    continue
                if not grammars.grammar_ready(request.request_id):
                    skipped.append(self.waiting.popleft())
                    continue
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            num_new_tokens = self._num_new_tokens(request, num_computed_tokens, plan.token_budget)
            if kv.allocate_slots(request, num_new_tokens, num_computed_tokens, computed_blocks) is None:
                break
            kv.record_prefix_cache_lookup(request.num_tokens, num_computed_tokens)
            self.waiting.popleft()
            self.running.append(request)
            if lora is not None:
                lora_ids.add(lora.lora_int_id)
            (plan.new_reqs if request.status == RequestStatus.WAITING else plan.resumed_reqs).append(request)
            request.status = RequestStatus.RUNNING
            # Starts at the prefix-cache hit; advanced by this step's tokens in _update_after_schedule.
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:  # first time scheduled
                request.num_cached_tokens = num_computed_tokens
                request.first_scheduled_time = time.monotonic()
            plan.new_block_ids[request.request_id] = kv.get_block_ids(request.request_id)
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        cached = CachedRequestData()
        resumed_ids = {r.request_id for r in plan.resumed_reqs}
        for request in plan.running_reqs + plan.resumed_reqs:
            req_id = request.request_id
            resumed = req_id in resumed_ids
            cached.req_ids.append(req_id)
            if resumed:
                cached.resumed_req_ids.add(req_id)
            cached.new_block_ids.append(plan.new_block_ids[req_id] or None)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            # The worker's own count includes the tokens it sampled that this side has not seen yet.
            cached.num_output_tokens.append(request.num_output_tokens + request.num_output_placeholders)
            if resumed or req_id not in self._prev_step_scheduled:
                cached.all_token_ids[req_id] = list(request.all_token_ids)
        new_reqs = [NewRequestData.from_request(r, plan.new_block_ids[r.request_id]) for r in plan.new_reqs]
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            # The set object now belongs to this output; _update_after_schedule
            # starts a new one instead of clearing it.
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted_reqs},
            scheduled_spec_decode_tokens=plan.spec_decode_tokens,
        )

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # Advance optimistically: the worker computes these tokens during this
        # step, so the next schedule() must start after them even though the
        # step's output has not come back yet.
        for req_id, num_scheduled in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_scheduled
            if (self.config.async_scheduling
                    and request.num_computed_tokens == request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1  # this step samples its next token
        self.finished_req_ids = set()
        self._prev_step_scheduled = set(output.num_scheduled_tokens)
        self.num_scheduled_tokens += output.total_num_scheduled_tokens

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until a compiling grammar is ready, or ``timeout_s`` seconds (for a step that could
        schedule nothing because every waiting request waits for its grammar)."""
        if self.structured_output_manager is not None:
            self.structured_output_manager.wait_for_grammars(timeout_s)

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The allowed-token masks of the step's constrained requests; None when none is constrained."""
        if self.structured_output_manager is None:
            return None
        return self.structured_output_manager.grammar_bitmask(self.requests, scheduler_output)

    # ------------------------------------------------------------------ results

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        A request the worker failed (``failed_req_ids``), or whose own accounting or drafts raise
        here, finishes with ``FINISHED_ERROR``: its blocks are freed and its output carries the
        error; the other requests go on.

        Returns:
            One ``EngineCoreOutput`` per request that produced tokens, prompt
            logprobs, or finished this step.
        """
        outputs, self._failed_waiting = self._failed_waiting, []
        finished: set[str] = set()
        # With async scheduling, a request preempted while this step ran gets the step's tokens in the waiting
        # queue, and may finish there.
        finished_waiting: set[str] = set()
        failed = model_runner_output.failed_req_ids
        for req_id, message in failed.items():
            request = self.requests.get(req_id)
            if request is not None:  # else aborted while the step ran
                if request.status == RequestStatus.PREEMPTED:
                    finished_waiting.add(req_id)
                outputs.append(self._fail_request(request, message))
                finished.add(req_id)
        index_of = model_runner_output.req_id_to_index
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or req_id not in index_of or req_id in failed:
                continue  # aborted while the step ran, or failed above
            waiting = request.status == RequestStatus.PREEMPTED
            try:
                output = self._update_request(request, scheduler_output, model_runner_output, index_of[req_id])
            except Exception as exc:  # noqa: BLE001 - one request's fault must not stop the others
                logger.exception("updating request %s failed", req_id)
                output = self._fail_request(request, repr(exc))
            if request.is_finished:
                finished.add(req_id)
                if waiting:
                    finished_waiting.add(req_id)
            if output is not None:
                outputs.append(output)
        if self.drafter is not None:
            outputs += self._propose_drafts(finished)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        if finished_waiting:
            self.waiting = deque(r for r in self.waiting if r.request_id not in finished_waiting)
        return outputs

    def _update_request(self, request: Request, scheduler_output: SchedulerOutput,
                        model_runner_output: ModelRunnerOutput, index: int) -> EngineCoreOutput | None:
        """Apply one request's step result; its output, or None when it has no news."""
        req_id = request.request_id
        pooled = model_runner_output.pooler_output.get(req_id)
        if pooled is not None:  # a pooling request whose prompt has run: done, its blocks freed
            self._free_request(request, RequestStatus.FINISHED_STOPPED)
            return EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason=request.finish_reason,
                                    num_cached_tokens=request.num_cached_tokens,
                                    first_scheduled_time=request.first_scheduled_time, pooling_output=pooled)
        generated = model_runner_output.sampled_token_ids[index]
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        if drafts and generated:
            # The runner keeps the accepted drafts and one more token; the K/V of the
            # rejected positions are recomputed from the next step on.
            request.num_computed_tokens -= len(drafts) + 1 - len(generated)
            self.spec_decoding_stats.observe(len(drafts), len(generated) - 1)
            self.draft_gate.record(req_id, len(drafts), len(generated) - 1)
        if request.num_output_placeholders:
            request.num_output_placeholders -= len(generated)
        new_token_ids = []
        grammars = self.structured_output_manager if request.sampling_params.structured_outputs else None
        for token_id in generated:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            if grammars is not None:
                error = grammars.accept_tokens(req_id, [token_id])
                if error is not None:  # the request's own grammar is at fault: the client's error
                    return self._fail_request(request, error, "structured_outputs")
                if grammars.is_terminated(req_id):  # complete: a stop, even on the max_tokens-th token
                    request.status = RequestStatus.FINISHED_STOPPED
                    break
            if self._check_stop(request, token_id):
                break
        logprobs = model_runner_output.logprobs[index] if model_runner_output.logprobs else None
        prompt_logprobs = model_runner_output.prompt_logprobs.get(req_id)
        if request.is_finished:
            self._free_request(request, request.status)
        if not (new_token_ids or prompt_logprobs or request.is_finished):
            return None
        return EngineCoreOutput(
            request_id=req_id, new_token_ids=new_token_ids, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens,
            new_logprobs=logprobs[:len(new_token_ids)] if logprobs else None,
            new_prompt_logprobs=prompt_logprobs, first_scheduled_time=request.first_scheduled_time)

    def _fail_request(self, request: Request, message: str, param: str | None = None) -> EngineCoreOutput:
        """Finish ``request`` with ``FINISHED_ERROR`` and free its blocks (unless already freed);
        the caller drops it from ``running``. Returns its last output, carrying ``message`` (and
        ``param``, the request field at fault when its own input failed it)."""
        if self.requests.get(request.request_id) is request:
            self._free_request(request, RequestStatus.FINISHED_ERROR)
        request.status = RequestStatus.FINISHED_ERROR
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason=request.finish_reason,
                                num_cached_tokens=request.num_cached_tokens,
                                first_scheduled_time=request.first_scheduled_time, error=message, error_param=param)

    def _propose_drafts(self, finished: set[str]) -> list[EngineCoreOutput]:
        """Ask the drafter for the next tokens of every decoding request, within its limits.

        A request may run ``k`` drafts when the ``k + 1`` tokens a step can then emit
        fit both ``max_tokens`` and ``max_model_len``, and the draft gate allows it. A request
        the drafter raises for is failed and added to ``finished``.

        Returns:
            The outputs of the requests failed here.
        """
        outputs: list[EngineCoreOutput] = []
        if not self.draft_gate.allows_batch(len(self.running) - len(finished)):
            return outputs
        max_model_len = self.config.max_model_len
        for request in self.running:
            request.spec_token_ids = []  # unused guesses of an earlier call (async scheduling) are stale now
            num_in_flight = request.num_output_placeholders
            if request.is_finished or request.num_computed_tokens != request.num_tokens + num_in_flight - 1:
                continue  # finished this step, still prefilling, or running drafts in the step in flight
            if request.sampling_params.structured_outputs is not None:
                continue  # grammars advance one sampled token per step: no drafts
            max_tokens = request.sampling_params.max_tokens or max_model_len
            num_drafts = min(self.drafter.num_speculative_tokens - num_in_flight,
                             max_tokens - request.num_output_tokens - num_in_flight - 1,
                             max_model_len - request.num_tokens - num_in_flight - 1)
            if num_drafts <= 0 or not self.draft_gate.allows(request.request_id):
                continue
            try:
                # With a token in flight (async scheduling), the first guess is for that token: skip it.
                guesses = self.drafter.propose(request.all_token_ids)[num_in_flight:]
                request.spec_token_ids = list(guesses[:num_drafts])
            except Exception as exc:  # noqa: BLE001 - one request's fault must not stop the others
                logger.exception("proposing drafts for request %s failed", request.request_id)
                outputs.append(self._fail_request(request, repr(exc)))
                finished.add(request.request_id)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set a finished status on ``request`` if ``token_id`` ends it."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:  # a frozenset, shared by the n siblings
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.max_model_len
        if request.num_output_tokens >= max_tokens or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.draft_gate.remove(request.request_id)
        if request.sampling_params.structured_outputs is not None:
            self.structured_output_manager.remove_request(request.request_id)


def _adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Adapter name -> how many of ``requests`` run with it (``SchedulerStats``' LoRA counts)."""
    return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request is not None))
