"""``AsyncLLM``: the engine driven from an asyncio server, through an ``EngineCoreClient``.

::

    event loop                                   engine core (a thread, or its own process)
    InputProcessor.process() (tokenize, check)
    generate() -> client.send(AddRequests) ─────►  drain inputs and aborts
    per-request asyncio.Queue  ◄── call_soon_threadsafe ◄── EngineCore.step() -> EngineCoreSink

Requests are checked once, by the ``InputProcessor`` on the event loop; the
engine core applies them as they come. It blocks on its input queue when
idle (no busy loop) and drains every pending add / abort before each
``schedule()`` (``engine/core_client.py``). Detokenization and stop-string checks run on the event loop in
the ``OutputProcessor``; a stop string found there aborts the request in the
engine.

Every step also ships the scheduler's stats to the event loop, with the
number of requests the engine has applied so far: the frontend reads
nothing inside the engine, and counts waiting requests from them. There the
``RequestStatsTracker`` turns the stats and the outputs into ``IterationStats``
for the registered stat loggers (metrics, the periodic log line): the engine
does no metrics work beyond a counter and a timestamp in the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, NamedTuple

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.core_client import (
    AbortRequests,
    AddRequests,
    EngineCoreClient,
    InprocClient,
    ProcClient,
    SnapshotKVCache,
    Stop,
)
from pagedserve.engine.engine_factory import load_engine, load_processor
from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.input_processor import InputProcessor, ProcessedRequest
from pagedserve.engine.lora.registry import LoRARegistry
from pagedserve.engine.metrics.loggers import StatLogger
from pagedserve.engine.metrics.stats import IterationStats, RequestStatsTracker
from pagedserve.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedserve.engine.outputs import EngineCoreOutput, RequestOutput
from pagedserve.engine.step_records import StepRecordBuffer

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting_requests`` allows."""


class StreamBacklogError(RuntimeError):
    """A request's consumer fell more than ``max_stream_backlog_tokens`` output tokens behind (a client that
    stopped reading its stream); the request was aborted."""


class _OutputStream:
    """One request's outputs (or the error that ends it) on their way from the engine to its consumer.

    Args:
        max_backlog_tokens: most output tokens (all choices together) held for a consumer that has not taken
            them; an output the consumer would take at once is always accepted (a final output may be large),
            and so is the last one (``finished``): the request holds nothing more in the engine.
    """

    def __init__(self, max_backlog_tokens: int) -> None:
        self.max_backlog_tokens = max_backlog_tokens
        self.backlog_tokens = 0  # in the queue
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, output: RequestOutput) -> bool:
        """Queue ``output``; False, queueing nothing, when that would hold more than ``max_backlog_tokens``."""
        num_tokens = _num_tokens(output)
        if (not output.finished and not self._queue.empty()
                and self.backlog_tokens + num_tokens > self.max_backlog_tokens):
            return False
        self.backlog_tokens += num_tokens
        self._queue.put_nowait(output)
        return True

    def put_nowait(self, error: BaseException) -> None:
        """Queue ``error``, which the consumer raises once it has taken the outputs before it."""
        self._queue.put_nowait(error)

    def fail_now(self, error: BaseException) -> None:
        """Drop the outputs not taken (their memory is freed now) and queue ``error``."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self.backlog_tokens = 0
        self._queue.put_nowait(error)

    async def get(self) -> RequestOutput | BaseException:
        item = await self._queue.get()
        if isinstance(item, RequestOutput):
            self.backlog_tokens -= _num_tokens(item)
        return item


def _num_tokens(output: RequestOutput) -> int:
    return sum(len(completion.token_ids) for completion in output.outputs)


class LoadedClient(NamedTuple):
    """An engine core behind its client, the input processor for its configuration, and its adapters (None
    without ``enable_lora``)."""

    client: EngineCoreClient
    processor: InputProcessor
    loras: LoRARegistry | None


class AsyncLLM:
    """Asynchronous generation over one engine core, on a thread of this process or in its own process.

    Create it with ``await AsyncLLM.create(args)`` inside a running event loop, or
    with ``AsyncLLM(*AsyncLLM.load(args), loop)``.

    Args:
        client: the loaded core's client; it is started here.
        processor: the input processor for ``client.config``.
        loop: the event loop that calls ``generate`` and receives the outputs.

    Attributes:
        client: the engine core's client (``InprocClient.core`` is the core itself).
        config: the engine's resolved configuration.
        processor: turns prompts into the ``ProcessedRequest`` s ``generate`` takes.
        tokenizer, model_name, max_model_len: the served model's.
        default_sampling_params: ``SamplingParams`` field -> the model's default (``generation_config``).
        loras: the adapters served by name (``--enable-lora``); None without.
        step_records: the dashboard's last step records (``StepRecordBuffer``); None when
            ``step_record_buffer_size`` is 0.
    """

    def __init__(self, client: EngineCoreClient, processor: InputProcessor, loras: LoRARegistry | None,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.processor = processor
        self.config = config = client.config
        self.tokenizer = processor.tokenizer
        self.model_name = config.model_config.served_model_name
        self.max_model_len = config.model_config.max_model_len
        self.default_sampling_params = config.model_config.generation_defaults
        self.loras = loras
        self._max_waiting_requests = config.args.max_waiting_requests
        self._max_stream_backlog_tokens = config.args.max_stream_backlog_tokens
        self.output_processor = OutputProcessor(self.tokenizer)
        self._loop = loop
        self._streams: dict[str, _OutputStream] = {}
        # Engine-core requests sent (event loop), and applied by the engine (the count it shipped with the
        # latest stats): their difference is still queued.
        self._num_submitted = 0
        self._num_applied_at_stats = 0
        self._stats = client.stats
        self._request_stats = RequestStatsTracker(self._stats)
        self._stat_loggers: list[StatLogger] = []
        buffer_size = config.args.step_record_buffer_size
        # The dashboard's step records (engine/step_records.py); None when they are off.
        self.step_records = StepRecordBuffer(buffer_size) if buffer_size > 0 else None
        self._kv_snapshot: asyncio.Future | None = None  # the one in flight, shared by its callers
        self._snapshot_tickets = itertools.count()
        self._snapshot_ticket = -1
        self._error: BaseException | None = None
        self._dead = asyncio.Event()  # set on the event loop once the engine has failed
        self._accepting = True
        client.start(self, record_steps=self.step_records is not None)

    @classmethod
    async def create(cls, args: EngineArgs) -> AsyncLLM:
        """Load the model (in a worker thread, so the loop stays responsive) and start the engine core on a
        thread of this process (``load``)."""
        loaded = await asyncio.to_thread(cls.load, args)
        return cls(*loaded, asyncio.get_running_loop())

    @staticmethod
    def load(args: EngineArgs, engine_process: bool = False,
             log_config: dict[str, Any] | None = None) -> LoadedClient:
        """Load the model, allocate the KV cache and load the tokenizer (blocking, seconds).

        Args:
            args: the engine's settings.
            engine_process: run the engine core in a child process (``ProcClient``) rather than on a thread
                of this one (``InprocClient``).
            log_config: with ``engine_process``, the child's ``logging.config.dictConfig``.

        Raises:
            ValueError: a setting the model or the machine cannot honour (model not found, no CUDA,
                a KV cache too small for ``max_model_len``), naming it.
            OSError: model or tokenizer files that cannot be read, a cache that cannot be written.
        """
        if args.cpu_reserved_cores is None:  # the frontend shares the machine: small steps leave it a core
            args = replace(args, cpu_reserved_cores=1)
        processor = None
        if engine_process:
            client: EngineCoreClient = ProcClient(args, log_config)
        else:
            engine_core, processor = load_engine(args)
            client = InprocClient(engine_core)
        try:
            loras = LoRARegistry.for_engine(client.config)  # an adapter that does not fit stops the start here
            return LoadedClient(client, processor or load_processor(client.config), loras)
        except BaseException:
            client.shutdown()
            raise

    # ------------------------------------------------------------------ the core's results (EngineCoreSink)
    # Called from the engine's thread, or the thread reading the engine process's results: each hands its
    # work to the event loop.

    def on_step(self, outputs: list[EngineCoreOutput], stats: SchedulerStats, num_applied: int,
                step_record: dict[str, Any] | None) -> None:
        self._call_soon(self._on_step, outputs, stats, num_applied, step_record)

    def on_request_failed(self, parent_request_id: str, error: BaseException) -> None:
        self._call_soon(self._fail_request, parent_request_id, error)

    def on_kv_cache_snapshot(self, ticket: int, snapshot: dict[str, Any] | None,
                             error: BaseException | None) -> None:
        self._call_soon(self._on_snapshot, ticket, snapshot, error)

    def on_engine_dead(self, error: BaseException) -> None:
        self._error = error
        self._call_soon(self._fail_all, error)

    def _call_soon(self, callback: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    # ------------------------------------------------------------------ event loop

    def _on_step(self, outputs: list[EngineCoreOutput], scheduler_stats: SchedulerStats, num_applied: int,
                 step_record: dict[str, Any] | None = None) -> None:
        if step_record is not None and self.step_records is not None:
            self.step_records.append(step_record)
        self._stats = scheduler_stats
        self._num_applied_at_stats = num_applied
        try:
            self._process_step(outputs, scheduler_stats)
        except Exception as exc:
            # An exception here would only be logged by asyncio and leave every stream waiting forever.
            logger.exception("processing engine outputs failed")
            self._error = exc
            self.client.send(Stop())
            self._fail_all(exc)

    def _process_step(self, outputs: list[EngineCoreOutput], scheduler_stats: SchedulerStats) -> None:
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            stopped = set(processed.stopped)
            failed_siblings = [r for r in processed.reqs_to_abort if r not in stopped]
            for request_ids, reason in ((processed.stopped, "stop"), (failed_siblings, "abort")):
                if request_ids:
                    self.client.send(AbortRequests(request_ids, reason))
        for request_output in processed.request_outputs:
            stream = self._streams.get(request_output.request_id)
            if stream is not None and not stream.put(request_output):
                self._abort_behind(request_output.request_id, stream)
        for request_id, error in processed.failed.items():
            self._fail_request(request_id, error)
        self._record(scheduler_stats, self._request_stats.make_iteration_stats(
            outputs, processed.reqs_to_abort, scheduler_stats, time.monotonic()))

    def _record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        for stat_logger in self._stat_loggers:
            stat_logger.record(scheduler_stats, iteration_stats)

    def _abort_behind(self, request_id: str, stream: _OutputStream) -> None:
        """Abort a request whose consumer has fallen ``max_stream_backlog_tokens`` behind, freeing its KV blocks
        and the outputs it was not reading: a client that stops reading must not hold memory without bound."""
        logger.warning("aborting request %s: its client is more than %d output tokens behind", request_id,
                       self._max_stream_backlog_tokens)
        self._abort(request_id)
        stream.fail_now(StreamBacklogError(
            f"request {request_id} was aborted: its client fell more than {self._max_stream_backlog_tokens} "
            "output tokens behind (max_stream_backlog_tokens)"))

    def _on_snapshot(self, ticket: int, snapshot: dict[str, Any] | None, error: BaseException | None) -> None:
        future = self._kv_snapshot
        if future is None or future.done() or ticket != self._snapshot_ticket:
            return  # its callers gave up (clients gone)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(snapshot)

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine stopped: {exc!r}")
        for stream in self._streams.values():
            stream.put_nowait(error)
        self._dead.set()

    def num_waiting_requests(self) -> int:
        """Requests waiting for the engine: those the scheduler held at the latest stats, plus those
        submitted and not applied as of those stats (``n`` completions count as ``n``). On the event loop."""
        return self._stats.num_waiting_reqs + self._num_submitted - self._num_applied_at_stats

    async def generate(self, request: ProcessedRequest, request_id: str,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> AsyncIterator[RequestOutput]:
        """Run one request and yield its outputs as tokens arrive.

        ``n > 1`` runs as sibling requests that share the prompt's cached KV
        blocks (only the first computes prompt logprobs: ``OutputProcessor.add_request``);
        ``CompletionOutput.index`` tells them apart. Closing the
        iterator early (e.g. the client disconnected) aborts the request; so does
        a consumer that falls more than ``max_stream_backlog_tokens`` output tokens behind.

        Args:
            request: made by ``self.processor``, which checked it.
            request_id: unique among the requests in progress.
            output_kind: what each output carries.

        Raises:
            ValueError: a request id in use.
            QueueFullError: too many requests waiting.
            EngineDeadError: the engine is not running.
            RequestFailedError: the engine failed this request alone (it goes on with the others).
            StreamBacklogError: the consumer fell too far behind; the request was aborted.
            InvalidRequestError: (``structured_outputs``) its grammar outgrew llguidance's limits while
                generating.
        """
        self._raise_if_unavailable()
        # All n completions must fit: one request could otherwise overshoot the limit by n - 1.
        if self.num_waiting_requests() + request.sampling_params.n > self._max_waiting_requests:
            raise QueueFullError(f"more than {self._max_waiting_requests} requests are waiting; retry later")
        children = self.output_processor.add_request(request_id, request.prompt, request.prompt_token_ids,
                                                     request.sampling_params, output_kind)
        stream = _OutputStream(self._max_stream_backlog_tokens)
        self._streams[request_id] = stream
        self._request_stats.add_request([child_id for child_id, _ in children], len(request.prompt_token_ids),
                                        time.monotonic())
        self.client.send(AddRequests(request.engine_core_requests(children, time.time()), request_id))
        self._num_submitted += len(children)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._streams[request_id]
            if not finished:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request (and its siblings) and free its KV blocks within one engine step."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids:
            self.client.send(AbortRequests(child_ids))
            self._record(self._stats, self._request_stats.abort_requests(child_ids, time.monotonic()))

    def _raise_if_unavailable(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")

    # ------------------------------------------------------------------ health and lifecycle

    @property
    def errored(self) -> bool:
        return self._error is not None

    async def wait_until_dead(self) -> BaseException:
        """Return the error once the engine has failed (every in-flight request has been sent it)."""
        await self._dead.wait()
        assert self._error is not None
        return self._error

    async def kv_cache_snapshot(self) -> dict[str, Any]:
        """The KV cache block by block (``EngineCore.kv_cache_snapshot``), taken on the engine thread
        between two steps.

        Raises:
            EngineDeadError: the engine is not running.
        """
        self._raise_if_unavailable()
        if self._kv_snapshot is None or self._kv_snapshot.done():
            # One snapshot in flight at a time, whatever the number of viewers: each scans every block.
            self._kv_snapshot = self._loop.create_future()
            self._snapshot_ticket = next(self._snapshot_tickets)
            self.client.send(SnapshotKVCache(self._snapshot_ticket))
        future = self._kv_snapshot
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait([future, dead], return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        self._raise_if_unavailable()
        return future.result()

    def check_health(self) -> bool:
        """True while the engine core (its thread or process) is alive and accepting requests."""
        return self._error is None and self._accepting and self.client.is_alive()

    def get_stats(self) -> SchedulerStats:
        """The scheduler's state after the latest engine step."""
        return self._stats

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Report every later engine step (and frontend abort) to ``stat_logger``, on the event loop."""
        self._stat_loggers.append(stat_logger)

    def remove_stat_logger(self, stat_logger: StatLogger) -> None:
        """Stop reporting to ``stat_logger``.

        Raises:
            ValueError: when it was not added.
        """
        self._stat_loggers.remove(stat_logger)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish within ``timeout_s``, abort the rest, stop the core."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._abort(request_id)
            self._streams[request_id].put_nowait(EngineDeadError("the server shut down"))
        await asyncio.to_thread(self.client.shutdown, timeout_s)
        if self.processor.grammars is not None:
            self.processor.grammars.shutdown()
