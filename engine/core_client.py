"""The engine core behind one seam, on a thread of this process or in a process of its own.

``AsyncLLM`` talks to the core through an ``EngineCoreClient``: it sends messages (``AddRequests``,
``AbortRequests``, ``SnapshotKVCache``, ``Stop``) and receives the core's results on an
``EngineCoreSink`` (each step's outputs, scheduler stats and step record; a request failed on arrival; a
KV cache snapshot; the engine's death). Every message is a picklable dataclass, so the same loop,
``run_engine_loop``, runs in both places:

- ``InprocClient``: the loop on a thread beside the event loop (tests, and where one process is wanted).
  Cheapest to reach, but the loop shares the GIL with everything the frontend does.
- ``ProcClient``: the loop in a child process (vLLM V1's ``EngineCoreProc``), the default of
  ``pagedserve serve``. The frontend's JSON, validation, detokenization and SSE framing no longer take
  the interpreter from ``schedule()``, input preparation and sampling, and a fault that kills the process
  (a segfault in a kernel, the OOM killer, ``kill -9``) ends every request in flight with an error
  instead of taking the HTTP server down with it.

The transport is a ``multiprocessing`` pipe carrying pickled messages: no extra dependency, and a
step's message (64 requests' outputs and the stats) pickles and crosses in tens of microseconds, against
steps of milliseconds. The child has a thread that reads the pipe into the loop's input queue, so the
loop drains inputs between steps exactly as on a thread; the parent has a thread that reads results and
hands them to the sink. Tensor-parallel ranks are the child's own children.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import logging.config
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from pagedserve.engine.config import EngineArgs, EngineConfig
from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.errors import EngineDeadError, RequestFailedError
from pagedserve.engine.outputs import EngineCoreOutput
from pagedserve.engine.request import EngineCoreRequest

logger = logging.getLogger(__name__)

#: How long the parent waits for the engine process to exit after asking it to stop, before killing it (s).
STOP_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- messages to the core


@dataclass
class AddRequests:
    """The engine-core requests of one caller's request (its ``n`` children), in one message: they share one
    prompt list, which pickles once."""

    requests: list[EngineCoreRequest]
    parent_request_id: str  # the caller's request, which a failure on arrival is reported for


@dataclass
class AbortRequests:
    request_ids: list[str]
    reason: str = "abort"  # for the step records: "stop" when a stop string ended them


@dataclass
class SnapshotKVCache:
    """Asks for ``EngineCore.kv_cache_snapshot()`` between two steps; the answer carries ``ticket``."""

    ticket: int


class CheckHealth:
    """A worker process died: the loop raises why (``EngineCore.check_health``) and stops."""


class Stop:
    pass


Message = AddRequests | AbortRequests | SnapshotKVCache | CheckHealth | Stop


class EngineCoreSink(Protocol):
    """Where the core's results go, called from the engine's side (not the caller's event loop)."""

    def on_step(self, outputs: list[EngineCoreOutput], stats: SchedulerStats, num_applied: int,
                step_record: dict[str, Any] | None) -> None:
        """One step's outputs, the scheduler's stats after it, the number of engine-core requests applied so
        far, and the step's record (None when records are off)."""

    def on_request_failed(self, parent_request_id: str, error: BaseException) -> None:
        """A request the core could not take (a bug or a race: the frontend checked it)."""

    def on_kv_cache_snapshot(self, ticket: int, snapshot: dict[str, Any] | None,
                             error: BaseException | None) -> None:
        """The answer to ``SnapshotKVCache(ticket)``: the snapshot, or why it failed."""

    def on_engine_dead(self, error: BaseException) -> None:
        """The core stopped for good (a fault no request can be blamed for, or its process died)."""


# --------------------------------------------------------------------------- the loop, in either place


def run_engine_loop(core: Any, inputs: queue.SimpleQueue, sink: EngineCoreSink) -> None:
    """Step ``core`` (an ``EngineCore``) while it has work, applying every queued message before each step
    and blocking on ``inputs`` while idle (no busy loop); returns at ``Stop``. A fault that escapes a step
    is reported to ``sink.on_engine_dead`` and ends the loop."""
    num_applied = 0
    try:
        while True:
            if not core.has_unfinished_requests():
                message = inputs.get()  # idle: block until work arrives
                if isinstance(message, Stop):
                    return
                num_applied += _apply(core, message, sink)
            while True:
                try:
                    message = inputs.get_nowait()
                except queue.Empty:
                    break
                if isinstance(message, Stop):
                    return
                num_applied += _apply(core, message, sink)
            outputs = core.step()
            record = core.take_step_record() if core.record_steps else None
            sink.on_step(outputs, core.make_stats(), num_applied, record)
    except BaseException as exc:  # noqa: BLE001 - whatever kills the engine must reach every client
        logger.exception("the engine loop died")
        sink.on_engine_dead(exc)


def _apply(core: Any, message: Message, sink: EngineCoreSink) -> int:
    """Apply one message between steps; returns the number of engine-core requests it added."""
    if isinstance(message, CheckHealth):
        core.check_health()  # raises why the worker died, which ends the loop
    elif isinstance(message, SnapshotKVCache):
        try:
            snapshot = core.kv_cache_snapshot()
        except Exception as exc:  # noqa: BLE001 - a view's fault must not stop the engine
            logger.exception("the KV cache snapshot failed")
            sink.on_kv_cache_snapshot(message.ticket, None, exc)
        else:
            sink.on_kv_cache_snapshot(message.ticket, snapshot, None)
    elif isinstance(message, AbortRequests):
        core.abort_requests(message.request_ids, message.reason)
    else:
        for request in message.requests:
            try:
                core.add_request(request)
            except Exception as exc:  # noqa: BLE001
                # The processor checked the request and the output processor its id, so this is a bug or a race;
                # it must fail that request only, not the engine every client shares.
                logger.exception("rejected request %s in the engine", request.request_id)
                parent = message.parent_request_id
                error = exc if isinstance(exc, ValueError) else RequestFailedError(parent, repr(exc))
                sink.on_request_failed(parent, error)
        return len(message.requests)
    return 0


# --------------------------------------------------------------------------- clients


class EngineCoreClient(abc.ABC):
    """The frontend's handle on an engine core.

    Attributes:
        config: the core's resolved configuration (``cache_config.num_blocks`` measured).
        stats: the scheduler's stats before the first step.
    """

    config: EngineConfig
    stats: SchedulerStats

    @abc.abstractmethod
    def start(self, sink: EngineCoreSink, record_steps: bool) -> None:
        """Start stepping; results go to ``sink``, with step records when ``record_steps``."""

    @abc.abstractmethod
    def send(self, message: Message) -> None:
        """Queue ``message`` for the core (any thread; never blocks on the core's work)."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Whether the loop (its thread or its process) still runs."""

    @abc.abstractmethod
    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the loop (after the step in progress) and release the workers (blocking)."""


class InprocClient(EngineCoreClient):
    """The core stepped on a thread of this process.

    Args:
        core: a loaded ``EngineCore``; the thread owns it once ``start`` is called.
    """

    def __init__(self, core: Any) -> None:
        self.core = core
        self.config = core.config
        self.stats = core.make_stats()
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, sink: EngineCoreSink, record_steps: bool) -> None:
        self.core.record_steps = record_steps
        # A tensor-parallel rank that dies while the engine is idle wakes the loop, which raises why.
        self.core.register_failure_callback(lambda: self._inputs.put(CheckHealth()))
        self._thread = threading.Thread(target=run_engine_loop, args=(self.core, self._inputs, sink),
                                        name="engine", daemon=True)
        self._thread.start()

    def send(self, message: Message) -> None:
        self._inputs.put(message)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._inputs.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout_s)
        if not self.is_alive():  # a thread still stepping must keep its workers
            self.core.shutdown()


class ProcClient(EngineCoreClient):
    """The core stepped in a child process (``spawn``: nothing of this process's threads or locks is
    inherited). The constructor blocks until the child has loaded the model and allocated the KV cache.

    Args:
        args: the engine's settings.
        log_config: a ``logging.config.dictConfig`` for the child, so that its lines look like the
            parent's; None leaves Python's defaults.

    Raises:
        ValueError, OSError: the engine could not start (as ``load_engine`` raises them, with their
            messages); EngineDeadError when the child died before saying why.
    """

    def __init__(self, args: EngineArgs, log_config: dict[str, Any] | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not daemonic: a daemonic process may not start the tensor-parallel ranks. The child stops when its
        # pipe closes, so it does not outlive this process.
        self.process = context.Process(target=_engine_process_main, args=(args, child_conn, log_config),
                                       name="pagedserve-engine-core")
        self.process.start()
        child_conn.close()  # the child's end lives in the child only: its death closes the pipe here
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stopping = False  # set once Stop is sent: the pipe closing after it is no death
        try:
            reply = self._conn.recv()
            if reply[0] == "failed":
                raise reply[1]
        except EOFError:
            self._kill()
            raise EngineDeadError(f"the engine process exited while starting ({_exit_status(self.process)})") from None
        except BaseException:  # its error, or an interrupt while it loads: nothing may outlive this call
            self._kill()
            raise
        _, self.config, self.stats = reply
        logger.info("engine core running in process %d", self.process.pid)

    def start(self, sink: EngineCoreSink, record_steps: bool) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # a child already dead: the reader says so
            self._conn.send(record_steps)
        self._reader = threading.Thread(target=self._read_results, args=(sink,), name="engine-results",
                                        daemon=True)
        self._reader.start()

    def _read_results(self, sink: EngineCoreSink) -> None:
        try:
            while True:
                try:
                    kind, *payload = self._conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "step":
                    sink.on_step(*payload)
                elif kind == "request_failed":
                    sink.on_request_failed(*payload)
                elif kind == "snapshot":
                    sink.on_kv_cache_snapshot(*payload)
                elif kind == "dead":
                    sink.on_engine_dead(payload[0])
                    return
                else:  # "stopped": the loop returned at Stop
                    return
        except BaseException as exc:  # noqa: BLE001 - a result that cannot be read: no later one can be trusted
            logger.exception("reading the engine process's results failed")
            self._kill()
            sink.on_engine_dead(exc)
            return
        if self._stopping:
            return
        # The pipe closed without a word: the process died (a segfault, the OOM killer, kill -9).
        self.process.join(5.0)  # reaps it (the pipe closes a moment before the exit status is there)
        sink.on_engine_dead(EngineDeadError(f"the engine process died ({_exit_status(self.process)})"))

    def send(self, message: Message) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # a dead child: its reader reports the death
            self._conn.send(message)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the loop to stop; with ``timeout_s`` 0 return at once (a second call with a timeout joins it),
        else wait that long for the process to exit, then kill it."""
        self._stopping = True
        self.send(Stop())
        if timeout_s <= 0:
            return
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s: killing it", timeout_s)
        self._kill()
        if self._reader is not None:
            self._reader.join(timeout_s)  # before the pipe closes under it

    def _kill(self) -> None:
        """Kill the process if it still runs, reap it and close the pipe."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self._conn.close()


def _exit_status(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


# --------------------------------------------------------------------------- the child's side


class _PipeSink:
    """``EngineCoreSink`` in the child: each result is one pickled message to the parent. A parent gone
    takes nothing: its pipe's reader thread has queued ``Stop`` by then."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def _send(self, message: tuple) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(message)

    def on_step(self, outputs: list[EngineCoreOutput], stats: SchedulerStats, num_applied: int,
                step_record: dict[str, Any] | None) -> None:
        self._send(("step", outputs, stats, num_applied, step_record))

    def on_request_failed(self, parent_request_id: str, error: BaseException) -> None:
        self._send(("request_failed", parent_request_id, picklable_error(error)))

    def on_kv_cache_snapshot(self, ticket: int, snapshot: dict[str, Any] | None,
                             error: BaseException | None) -> None:
        self._send(("snapshot", ticket, snapshot, None if error is None else picklable_error(error)))

    def on_engine_dead(self, error: BaseException) -> None:
        self._send(("dead", picklable_error(error)))


def picklable_error(error: BaseException) -> BaseException:
    """``error`` if it survives a pickle round trip (custom exceptions may not), else its nearest built-in
    class with its message (a ``ValueError`` stays a ``ValueError``: a 400, not a 500)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure means: send the built-in kind and the text instead
        builtin = next(cls for cls in type(error).__mro__ if cls.__module__ == "builtins")
        try:
            return builtin(f"{type(error).__name__}: {error}")
        except Exception:  # noqa: BLE001 - a built-in that takes other arguments
            return RuntimeError(repr(error))
    return error


def _engine_process_main(args: EngineArgs, conn: Connection, log_config: dict[str, Any] | None) -> None:
    """The child: load the core, say so (or why not), then run the loop until ``Stop`` or the pipe closes."""
    # Ctrl-C in a terminal, or a signal to the server's process group, is for the server, which drains its
    # requests and then stops this process (Stop, or its pipe closing): the engine must not die first.
    os.setpgrp()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _ignore_signal)
    if log_config is not None:
        logging.config.dictConfig(log_config)
    try:
        from pagedserve.engine.engine_factory import load_engine_core  # the model code loads in the child only

        core = load_engine_core(args)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", picklable_error(exc)))
        return
    try:
        conn.send(("ready", core.config, core.make_stats()))
        record_steps = conn.recv()
    except (EOFError, OSError):  # the parent went away before starting us
        core.shutdown()
        return
    inputs: queue.SimpleQueue = queue.SimpleQueue()
    core.record_steps = record_steps
    core.register_failure_callback(lambda: inputs.put(CheckHealth()))
    threading.Thread(target=_read_messages, args=(conn, inputs), name="engine-inputs", daemon=True).start()
    try:
        run_engine_loop(core, inputs, _PipeSink(conn))
    finally:
        core.shutdown()
    with contextlib.suppress(OSError):
        conn.send(("stopped",))


def _ignore_signal(signum: int, frame: Any) -> None:
    # A Python handler, not SIG_IGN, which the tensor-parallel ranks started from here would inherit.
    logger.info("the engine process ignores %s: the server stops it once its requests are drained",
                signal.Signals(signum).name)


def _read_messages(conn: Connection, inputs: queue.SimpleQueue) -> None:
    while True:
        try:
            inputs.put(conn.recv())
        except (EOFError, OSError):  # the parent is gone: stop after the step in progress
            inputs.put(Stop())
            return
