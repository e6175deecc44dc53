"""``EngineCore``: the step loop that joins the scheduler and the executor (vLLM's ``EngineCore``).

The package beside it, ``pagedserve.engine.core``, is the scheduler side, with no torch (vLLM's
``v1/core``); this module drives it. docs/architecture.md, "One engine step", walks through the step.

``step()`` is, as in vLLM V1: ``schedule()`` -> ``execute_model()`` (forward,
logits kept) -> the step's grammar bitmask -> ``sample_tokens()`` ->
``update_from_output()``. With async scheduling (``EngineArgs.async_scheduling``) the executor's calls
run on a worker thread, and ``step()`` plans step N + 1 and starts its forward pass before it takes step
N's tokens: the scheduler, the grammars and the output path then work while the model runs. The caller
(``LLM``, or the engine loop of ``pagedserve.engine.core_client``) applies new requests and aborts between
steps. The core makes no tensor itself: it reaches the model through its executor, which it builds. Its
process still runs the model with one rank (``UniProcExecutor`` calls the worker directly, on the
engine's thread or its worker thread); with tensor parallelism the workers are processes of their own.
This module imports torch only through ``pagedserve.engine.profiling``'s regions, which time the step's
phases; the executor's modules import it when the executor is built.

A fault in one request's own data (its worker state, its row's inputs, its sampling, the
scheduler's accounting of its tokens) fails that request alone: it ends with ``FinishReason.ERROR``
and ``EngineCoreOutput.error``, its blocks are freed, and the step goes on for the others. What
``step()`` raises (the forward pass, a device error, a scheduler bug) cannot be blamed on a
request: the engine is then unusable.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.engine.config import EngineConfig, SpeculativeConfig
from pagedserve.engine.core.draft_proposer import DraftProposer
from pagedserve.engine.core.grammar_protocol import StructuredOutputManager
from pagedserve.engine.core.ngram_proposer import NgramProposer
from pagedserve.engine.core.scheduler import Scheduler, SchedulerStats
from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.core.spec_decode import DraftGate
from pagedserve.engine.executor.abstract import Executor
from pagedserve.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from pagedserve.engine.profiling import region
from pagedserve.engine.request import EngineCoreRequest, Request, RequestStatus
from pagedserve.engine.step_records import kv_cache_snapshot, make_step_record, scheduled_requests

logger = logging.getLogger(__name__)

#: Longest a step that could schedule nothing (every waiting request's grammar still compiling) waits
#: for a grammar; new requests and aborts wait as long.
GRAMMAR_WAIT_S = 0.01


@dataclasses.dataclass
class _InFlightStep:
    """A step the worker thread is running (async scheduling).

    Attributes:
        scheduler_output: its plan.
        result: its output, with the seconds its forward pass and its sampling took on the worker.
        scheduled: its requests' step-record entries (``scheduled_requests``); empty when records are off.
        schedule_s: seconds ``schedule()`` took.
    """

    scheduler_output: SchedulerOutput
    result: Future[tuple[ModelRunnerOutput, float, float]]
    scheduled: list[Any]
    schedule_s: float


class EngineCore:
    """Owns the scheduler and the executor; sizes the KV cache between them.

    Args:
        config: the engine's resolved configuration (``engine_factory.resolve_engine_config``);
            ``self.config`` is the same with ``cache_config.num_blocks`` filled in.
        executor_class: how to run the workers; None = ``Executor.get_class(config)``.
        drafter: proposes draft tokens for speculative decoding; None = the one
            ``config.speculative_config`` describes (none when that is None).
        structured_output_manager: owns the grammars of constrained requests; None = requests with
            ``structured_outputs`` are refused.

    Raises:
        ValueError: a setting the device cannot honour, or a KV cache that cannot hold one request of
            ``max_model_len`` tokens.
    """

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None,
                 drafter: DraftProposer | None = None,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.executor = (executor_class or Executor.get_class(config))(config)
        try:
            num_blocks = self._num_kv_blocks(config)
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # worker processes must not outlive a failed start
            raise
        self.config = dataclasses.replace(
            config, cache_config=dataclasses.replace(config.cache_config, num_blocks=num_blocks))
        speculative = config.speculative_config
        if drafter is None and speculative is not None:
            drafter = make_drafter(speculative)
        if speculative is not None:
            logger.info("speculative decoding: %s", ", ".join(f"{k}={v}" for k, v in vars(speculative).items()))
        gate = DraftGate(speculative.disable_by_batch_size if speculative else None)
        self.scheduler = Scheduler(self.config.scheduler_config, self.config.cache_config,
                                   structured_output_manager=structured_output_manager, drafter=drafter,
                                   draft_gate=gate)
        self.num_steps = 0
        # Async scheduling: one thread runs the executor's calls in the order they are submitted, so a step's
        # forward pass always follows the sampling of the step before (its input is that step's token).
        self._worker_thread = (ThreadPoolExecutor(1, thread_name_prefix="pagedserve-worker")
                               if config.scheduler_config.async_scheduling else None)
        self._in_flight: _InFlightStep | None = None
        # What a call on the worker thread raised: the steps queued behind it must not run on a broken worker.
        self._worker_error: BaseException | None = None
        if self._worker_thread is not None:
            logger.info("async scheduling: each step is planned while the worker runs the one before")
        # Step records for the dashboard (engine/step_records.py), taken by take_step_record(); off
        # unless a reader switches them on (AsyncLLM does, with step_record_buffer_size > 0).
        self.record_steps = False
        self._step_record: dict[str, Any] | None = None
        self._finished_since_record: list[tuple[str, str, int]] = []

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        args, block_size = config.args, config.cache_config.block_size
        bytes_per_block = self.executor.kv_cache_bytes_per_block()
        if args.num_gpu_blocks_override is not None:
            num_blocks = args.num_gpu_blocks_override
        else:
            memory = self.executor.determine_available_memory()
            num_blocks = memory // bytes_per_block
            if num_blocks < 2:
                raise ValueError(f"KV cache memory of {memory} bytes holds {num_blocks} blocks of "
                                 f"{bytes_per_block} bytes; at least 2 are needed")
            _check_kv_cache_holds_one_request(num_blocks, bytes_per_block, block_size,
                                              config.model_config.max_model_len)
        max_model_len = config.model_config.max_model_len
        logger.info("allocating the KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB), "
                    "max %.1f requests of max_model_len", num_blocks - 1, block_size, (num_blocks - 1) * block_size,
                    num_blocks * bytes_per_block / 2**20, (num_blocks - 1) * block_size / max_model_len)
        return num_blocks

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the frontend has validated (``params.n`` is 1: the frontend fans out ``n``).

        Raises:
            ValueError: a request id already in use.
        """
        self.scheduler.add_request(Request.from_engine_core_request(request, self.config.cache_config.block_size))

    def abort_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        """Finish requests now and free their blocks; unknown ids are ignored.

        Args:
            reason: what the step records say ended them: ``abort``, or ``stop`` for a stop string
                the frontend found (it ended the request; the engine only stops computing it).
        """
        if self.record_steps:
            requests = self.scheduler.requests
            self._finished_since_record += [(r, reason, requests[r].num_output_tokens)
                                            for r in request_ids if r in requests]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run, sample and account one step. Returns the requests' new tokens, and the
        requests failed this step (``error`` set).

        Raises:
            Exception: a fault no request can be blamed for (the forward pass, the device); the
                engine cannot step again.
        """
        if self._worker_thread is not None:
            with region("engine_core.step"):
                return self._step_async()
        if not self.scheduler.has_requests():
            return []
        with region("engine_core.step"):
            start = time.perf_counter()
            with region("scheduler.schedule"):
                scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens == 0 and not scheduler_output.finished_req_ids:
                # Only requests whose grammars are compiling: wait for one instead of spinning.
                self.scheduler.wait_for_grammars(GRAMMAR_WAIT_S)
            scheduled = scheduled_requests(self.scheduler, scheduler_output) if self.record_steps else []
            scheduled_at = time.perf_counter()
            model_runner_output = self.executor.execute_model(scheduler_output)
            forward_done = time.perf_counter()
            if model_runner_output is None:
                grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
                model_runner_output = self.executor.sample_tokens(grammar_output)
            sampled_at = time.perf_counter()
            with region("scheduler.update_from_output"):
                outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        if self.record_steps:
            self._record_step(scheduler_output, scheduled, outputs, {
                "schedule": scheduled_at - start, "forward": forward_done - scheduled_at,
                "sample": sampled_at - forward_done, "update": time.perf_counter() - sampled_at})
        self.num_steps += 1
        return outputs

    def _step_async(self) -> list[EngineCoreOutput]:
        """One call of async scheduling: plan the next step and start its forward pass, then take the tokens
        of the step in flight, then start the next step's sampling.

        The sampling starts only after the update because the grammars must have taken the previous step's
        tokens before they give the next step's masks. A step with drafts is finished before the next plan. On
        the worker thread the order is forward N, sample N, forward N + 1, ...: step N + 1's forward pass runs
        while this thread updates step N.

        Returns:
            The outputs of the step that was in flight; none on the first call.
        """
        outputs = []
        if self._in_flight is not None and self._in_flight.scheduler_output.scheduled_spec_decode_tokens:
            # How many of its drafts are accepted decides where its requests stand: plan after its tokens.
            outputs = self._finish_in_flight()
        launched = None
        if self.scheduler.has_requests():
            start = time.perf_counter()
            with region("scheduler.schedule"):
                scheduler_output = self.scheduler.schedule()
            if (scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids
                    or scheduler_output.preempted_req_ids):
                scheduled = scheduled_requests(self.scheduler, scheduler_output) if self.record_steps else []
                forward = self._worker_thread.submit(self._run_forward, scheduler_output)
                launched = (scheduler_output, forward, scheduled, time.perf_counter() - start)
            elif self._in_flight is None:
                # Only requests whose grammars are compiling: wait for one instead of spinning.
                self.scheduler.wait_for_grammars(GRAMMAR_WAIT_S)
        if self._in_flight is not None:
            outputs = self._finish_in_flight()
        if launched is not None:
            scheduler_output, forward, scheduled, schedule_s = launched
            grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
            result = self._worker_thread.submit(self._run_sample, forward, grammar_output)
            self._in_flight = _InFlightStep(scheduler_output, result, scheduled, schedule_s)
        return outputs

    def _run_forward(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput | None, float]:
        """On the worker thread: ``execute_model`` and the seconds it took."""
        start = time.perf_counter()
        output = self._on_worker(self.executor.execute_model, scheduler_output)
        return output, time.perf_counter() - start

    def _on_worker(self, call: Callable[..., Any], *args: Any) -> Any:
        """Run an executor call on the worker thread, unless an earlier one raised (then raise that again)."""
        if self._worker_error is not None:
            raise self._worker_error
        try:
            return call(*args)
        except BaseException as exc:
            self._worker_error = exc
            raise

    def _run_sample(self, forward: Future[tuple[ModelRunnerOutput | None, float]],
                    grammar_output: GrammarOutput | None) -> tuple[ModelRunnerOutput, float, float]:
        """On the worker thread, after ``forward`` (submitted before it): the step's output, and the seconds
        its forward pass and its sampling took."""
        output, forward_s = forward.result()
        start = time.perf_counter()
        if output is None:
            output = self._on_worker(self.executor.sample_tokens, grammar_output)
        return output, forward_s, time.perf_counter() - start

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight and apply its output to the scheduler."""
        step = self._in_flight
        with region("engine_core.wait_for_worker"):
            model_runner_output, forward_s, sample_s = step.result.result()
        self._in_flight = None  # only now: an interrupt while waiting leaves the step to the next call
        start = time.perf_counter()
        with region("scheduler.update_from_output"):
            outputs = self.scheduler.update_from_output(step.scheduler_output, model_runner_output)
        if self.record_steps:
            # The phases overlap: schedule and update ran on this thread while other steps ran on the worker's.
            self._record_step(step.scheduler_output, step.scheduled, outputs, {
                "schedule": step.schedule_s, "forward": forward_s, "sample": sample_s,
                "update": time.perf_counter() - start})
        self.num_steps += 1
        return outputs

    def _record_step(self, scheduler_output: SchedulerOutput, scheduled: list[Any], outputs: list[EngineCoreOutput],
                     durations: dict[str, float]) -> None:
        durations["total"] = sum(durations.values())
        self._step_record = make_step_record(self.num_steps, durations, self.scheduler, scheduler_output,
                                             scheduled, outputs, self._finished_since_record)
        self._finished_since_record = []

    def take_step_record(self) -> dict[str, Any] | None:
        """The last step's record (``engine/step_records.py``), once; None when there is none new or
        records are off (``step_record_buffer_size`` 0)."""
        record, self._step_record = self._step_record, None
        return record

    def kv_cache_snapshot(self) -> dict[str, Any]:
        """Every KV block's state and owners (``step_records.kv_cache_snapshot``); between steps only."""
        return kv_cache_snapshot(self.scheduler, self.num_steps - 1)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called, from another thread, when a worker dies between two calls
        (``Executor.register_failure_callback``); ``check_health`` then raises why."""
        self.executor.register_failure_callback(callback)

    def check_health(self) -> None:
        """Raise when a worker has died (``Executor.check_health``)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        if self._worker_thread is not None:
            self._worker_thread.shutdown(wait=True, cancel_futures=True)
        self.executor.shutdown()


def make_drafter(config: SpeculativeConfig) -> DraftProposer:
    """The drafter of ``config.method`` (``SPECULATIVE_METHODS``: ngram only)."""
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


def _check_kv_cache_holds_one_request(num_blocks: int, bytes_per_block: int, block_size: int,
                                      max_model_len: int) -> None:
    """Refuse a KV cache that cannot hold one request of ``max_model_len`` tokens, naming the
    largest ``max_model_len`` it can hold (block 0 is the null block)."""
    needed = -(-max_model_len // block_size)
    if num_blocks - 1 < needed:
        raise ValueError(
            f"the KV cache ({(num_blocks - 1) * bytes_per_block / 2**20:.0f} MiB, {num_blocks - 1} blocks) "
            f"cannot hold one request of max_model_len {max_model_len} tokens, which needs "
            f"{needed * bytes_per_block / 2**20:.0f} MiB; give it more memory (kv_cache_memory_bytes, "
            f"gpu_memory_utilization, the container's memory limit) or set max_model_len to at most "
            f"{(num_blocks - 1) * block_size}")
