"""``AsyncLLM``: the engine on a background thread, driven from an asyncio server.

::

    event loop                                   engine thread
    InputProcessor.process() (tokenize, check)
    generate() -> input queue  ─────────────────►  drain inputs and aborts
    per-request asyncio.Queue  ◄── call_soon_threadsafe ◄── EngineCore.step()

Requests are checked once, by the ``InputProcessor`` on the event loop; the
engine thread applies them as they come. It blocks on its input queue when
idle (no busy loop) and drains every pending add / abort before each
``schedule()``. Detokenization and stop-string checks run on the event loop in
the ``OutputProcessor``; a stop string found there aborts the request in the
engine.

Every step also ships the scheduler's stats to the event loop, with the
number of requests the engine thread has applied so far: the frontend reads
nothing inside the engine, and counts waiting requests from them. There the
``RequestStatsTracker`` turns the stats and the outputs into ``IterationStats``
for the registered stat loggers (metrics, the periodic log line): the engine
thread does no metrics work beyond a counter and a timestamp in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.errors import RequestFailedError
from pagedserve.engine.input_processor import InputProcessor, ProcessedRequest
from pagedserve.engine.loading import LoadedEngine, load_engine
from pagedserve.engine.metrics.loggers import StatLogger
from pagedserve.engine.metrics.stats import IterationStats, RequestStatsTracker
from pagedserve.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedserve.engine.outputs import EngineCoreOutput, RequestOutput
from pagedserve.engine.request import EngineCoreRequest
from pagedserve.engine.step_records import StepRecordBuffer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); no request can run."""


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


@dataclass
class _AddRequest:
    request: EngineCoreRequest
    parent_request_id: str


@dataclass
class _AbortRequests:
    request_ids: list[str]
    reason: str = "abort"  # for the step records: "stop" when a stop string ended them


class _Stop:
    pass


class _CheckHealth:
    """Sent when a worker process died: the engine thread raises why (``EngineCore.check_health``) and stops."""


@dataclass
class _SnapshotKVCache:
    """Asks the engine thread for ``EngineCore.kv_cache_snapshot()`` between two steps."""

    future: asyncio.Future


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():  # its caller may have given up (a client gone)
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class AsyncLLM:
    """Asynchronous generation over one ``EngineCore`` running on its own thread.

    Create it with ``await AsyncLLM.create(args)`` inside a running event loop, or
    with ``AsyncLLM(*AsyncLLM.load(args), loop)``.

    Args:
        engine_core: the loaded core; its thread is started here and owns it from now on.
        processor: the input processor for ``engine_core.config``.
        loop: the event loop that calls ``generate`` and receives the outputs.

    Attributes:
        processor: turns prompts into the ``ProcessedRequest`` s ``generate`` takes.
        tokenizer, model_name, max_model_len: the served model's.
        default_sampling_params: ``SamplingParams`` field -> the model's default (``generation_config``).
        step_records: the dashboard's last step records (``StepRecordBuffer``); None when
            ``step_record_buffer_size`` is 0.
    """

    def __init__(self, engine_core: EngineCore, processor: InputProcessor, loop: asyncio.AbstractEventLoop) -> None:
        self.engine_core = engine_core
        self.processor = processor
        config = engine_core.config
        self.tokenizer = processor.tokenizer
        self.model_name = config.model_config.served_model_name
        self.max_model_len = config.model_config.max_model_len
        self.default_sampling_params = config.model_config.generation_defaults
        self._max_waiting_requests = config.args.max_waiting_requests
        self._max_stream_backlog_tokens = config.args.max_stream_backlog_tokens
        self.output_processor = OutputProcessor(self.tokenizer)
        self._loop = loop
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _OutputStream] = {}
        # Engine-core requests put on the input queue (event loop), and applied by the engine thread (its own
        # count, and the count it shipped with the latest stats): their difference is still queued.
        self._num_submitted = 0
        self._num_applied = 0
        self._num_applied_at_stats = 0
        self._stats = engine_core.make_stats()
        self._request_stats = RequestStatsTracker(self._stats)
        self._stat_loggers: list[StatLogger] = []
        buffer_size = config.args.step_record_buffer_size
        # The dashboard's step records (engine/step_records.py); None when they are off.
        self.step_records = StepRecordBuffer(buffer_size) if buffer_size > 0 else None
        engine_core.record_steps = self.step_records is not None
        self._kv_snapshot: asyncio.Future | None = None  # the one in flight, shared by its callers
        self._error: BaseException | None = None
        self._dead = asyncio.Event()  # set on the event loop once the engine has failed
        self._accepting = True
        # A tensor-parallel rank that dies while the engine is idle wakes it, so that /health turns 503 (and the
        # CLI exits) without waiting for a request.
        engine_core.register_failure_callback(lambda: self._inputs.put(_CheckHealth()))
        self._thread = threading.Thread(target=self._run_engine_loop, name="engine", daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, args: EngineArgs) -> AsyncLLM:
        """Load the model (in a worker thread, so the loop stays responsive) and start the engine thread."""
        loaded = await asyncio.to_thread(cls.load, args)
        return cls(*loaded, asyncio.get_running_loop())

    @staticmethod
    def load(args: EngineArgs) -> LoadedEngine:
        """Load the model, allocate the KV cache and load the tokenizer (blocking, seconds).

        Raises:
            ValueError: a setting the model or the machine cannot honour (model not found, no CUDA,
                a KV cache too small for ``max_model_len``), naming it.
            OSError: model or tokenizer files that cannot be read, a cache that cannot be written.
        """
        if args.cpu_reserved_cores is None:  # the frontend shares the machine: small steps leave it a core
            args = replace(args, cpu_reserved_cores=1)
        return load_engine(args)

    # ------------------------------------------------------------------ engine thread

    def _run_engine_loop(self) -> None:
        core = self.engine_core
        try:
            while True:
                if not core.has_unfinished_requests():
                    if self._apply(self._inputs.get()):  # idle: block until work arrives
                        return
                while True:
                    try:
                        item = self._inputs.get_nowait()
                    except queue.Empty:
                        break
                    if self._apply(item):
                        return
                outputs = core.step()
                record = core.take_step_record() if self.step_records is not None else None
                self._loop.call_soon_threadsafe(self._on_step, outputs, core.make_stats(), self._num_applied, record)
        except BaseException as exc:  # noqa: BLE001 - whatever kills the engine must reach every client
            logger.exception("engine thread died")
            self._error = exc
            with contextlib.suppress(RuntimeError):  # the event loop may already be closed
                self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _apply(self, item: _AddRequest | _AbortRequests | _SnapshotKVCache | _CheckHealth | _Stop) -> bool:
        """Apply one input on the engine thread; True means stop the loop."""
        if isinstance(item, _Stop):
            return True
        if isinstance(item, _CheckHealth):
            self.engine_core.check_health()  # raises why the worker died, which stops the engine
            return False
        if isinstance(item, _SnapshotKVCache):
            try:
                snapshot = self.engine_core.kv_cache_snapshot()
            except Exception as exc:  # noqa: BLE001 - a view's fault must not stop the engine
                logger.exception("the KV cache snapshot failed")
                self._loop.call_soon_threadsafe(_set_exception, item.future, exc)
            else:
                self._loop.call_soon_threadsafe(_set_result, item.future, snapshot)
            return False
        if isinstance(item, _AbortRequests):
            self.engine_core.abort_requests(item.request_ids, item.reason)
            return False
        self._num_applied += 1
        try:
            self.engine_core.add_request(item.request)
        except Exception as exc:  # noqa: BLE001
            # The processor checked the request and the output processor its id, so this is a bug or a
            # race; it must fail that request only, not the engine every client shares.
            logger.exception("rejected request %s on the engine thread", item.request.request_id)
            error = exc if isinstance(exc, ValueError) else RequestFailedError(item.parent_request_id, repr(exc))
            self._loop.call_soon_threadsafe(self._fail_request, item.parent_request_id, error)
        return False

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
            self._inputs.put(_Stop())
            self._fail_all(exc)

    def _process_step(self, outputs: list[EngineCoreOutput], scheduler_stats: SchedulerStats) -> None:
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            stopped = set(processed.stopped)
            failed_siblings = [r for r in processed.reqs_to_abort if r not in stopped]
            for request_ids, reason in ((processed.stopped, "stop"), (failed_siblings, "abort")):
                if request_ids:
                    self._inputs.put(_AbortRequests(request_ids, reason))
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
        for core_request in request.engine_core_requests(children, time.time()):
            self._inputs.put(_AddRequest(core_request, request_id))
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
            self._inputs.put(_AbortRequests(child_ids))
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
            self._inputs.put(_SnapshotKVCache(self._kv_snapshot))
        future = self._kv_snapshot
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait([future, dead], return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        self._raise_if_unavailable()
        return future.result()

    def check_health(self) -> bool:
        """True while the engine thread is alive and accepting requests."""
        return self._error is None and self._accepting and self._thread.is_alive()

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
        """Stop accepting, let in-flight requests finish within ``timeout_s``, abort the rest, join the thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._abort(request_id)
            self._streams[request_id].put_nowait(EngineDeadError("the server shut down"))
        self._inputs.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout_s)
        if not self._thread.is_alive():  # a thread still stepping must keep its workers
            self.engine_core.shutdown()
        if self.processor.grammars is not None:
            self.processor.grammars.shutdown()
