"""``MultiprocExecutor``: one worker process per tensor-parallel rank (vLLM V1's ``MultiprocExecutor``).

The scheduler stays in the engine core's process. Each call is pickled once
and the same bytes are written to every rank's pipe (``encode_call``); the
scheduler sends diffs (``CachedRequestData``), so a request's prompt crosses
the pipes once and a decode step carries ids, positions and new block ids
only (``benchmarks/step_bytes.py`` measures it).

Every rank computes the same logits and samples the same tokens
(``engine/worker/worker.py``), so rank 0 answers a step with its output and
the others with a digest of theirs (``step_digest``: request ids, sampled
tokens, failed requests). A digest that differs means a rank went its own
way (say, a failure only it hit) and would meet the others with tensors of
another size in the next collective: the engine stops instead.

The executor waits on every rank's pipe *and* process sentinel at once: a
rank that raises (it sends its traceback, then exits) or dies ends the wait
with ``WorkerDiedError``, and the remaining ranks are killed (they would
otherwise block in their next collective), so the engine fails every request
in flight instead of hanging. Between calls a monitor thread waits on the
sentinels, and calls back the engine (``register_failure_callback``), which
stops at once: an idle server does not wait for its next request to find a
rank gone. A rank's configuration error at start-up
(``ValueError``, ``OSError``) is raised as such, as a single process raises it.

The ranks are forked from a fork server (``multiprocessing``'s
``forkserver``), which imports the worker once per engine process. As with
``spawn``, each rank imports the script that started the engine as
``__mp_main__``: a script that builds an engine with ``tensor_parallel_size >
1`` needs an ``if __name__ == "__main__":`` guard, and the ranks see the
environment of the fork server's start (the first tensor-parallel engine).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.executor.abstract import Executor
from pagedserve.engine.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

#: Calls every step makes; rank 0 answers with its output, the others with ``step_digest`` of theirs.
STEP_METHODS = frozenset({"execute_model", "sample_tokens"})
#: Seconds the ranks together get to leave their process group and exit before they are killed.
SHUTDOWN_TIMEOUT_S = 10.0
#: Seconds to wait, after one rank fails, for others to show they died too (the first report may be
#: a survivor's collective failing because a peer is gone).
FATE_GRACE_S = 0.5


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank exited, raised, or went out of step; the engine cannot go on without it."""


def encode_call(method: str, *args: Any) -> bytes:
    """The bytes one call puts on each rank's pipe: ``pickle((method, args))``."""
    return pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)


def step_digest(output: ModelRunnerOutput | None) -> bytes | None:
    """What must agree between the ranks after a step: its requests, their sampled tokens, its failures."""
    if output is None:
        return None
    state = (output.req_ids, output.sampled_token_ids, sorted(output.failed_req_ids))
    return hashlib.blake2b(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).digest()


class MultiprocExecutor(Executor):
    """Forks ``tensor_parallel_size`` worker processes and drives them over pipes.

    Args:
        config: the engine's resolved configuration; the constructor returns once every rank
            has joined the process group and loaded its slice of the model.

    Raises:
        ValueError, OSError: a rank's configuration error at start (no CUDA device, an attention
            backend the device does not run, unreadable weights), naming the rank.
        WorkerDiedError: a rank failed to start otherwise (its traceback is in the message).
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        size = config.args.tensor_parallel_size
        # Not fork: a child forked from the engine's process would inherit its thread pools (and CUDA
        # state) half-made. A fork server is a clean process that imports torch once and forks each
        # rank from there, so an engine started again in the same process does not import it again.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["pagedserve.engine.worker.worker"])
        # torch's FileStore deletes its file when the last rank leaves, even if this process was killed.
        rendezvous = os.path.join(tempfile.gettempdir(), f"pagedserve-tp-{uuid.uuid4().hex}")
        self._pipes: list[Connection] = []
        self._processes: list[BaseProcess] = []
        self._failed: BaseException | None = None
        self._failure_callbacks: list[Callable[[], None]] = []
        self._stopping = threading.Event()  # set before the ranks are told to stop: their exit is no failure
        # Workers must not outlive an executor that is dropped without shutdown() (tests, errors).
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._pipes, rendezvous, self._stopping)
        log_level = logging.getLogger().getEffectiveLevel()
        for rank in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_run_worker,
                                      args=(config, rank, f"file://{rendezvous}", theirs, log_level),
                                      name=f"pagedserve-tp{rank}", daemon=True)
            process.start()
            theirs.close()
            self._pipes.append(ours)
            self._processes.append(process)
        self._receive_all(starting=True)  # "ready" from each, or the error that stopped one
        # Not a method of self: the thread must not keep the executor alive (its finalizer stops the ranks).
        threading.Thread(target=_watch_ranks, args=([p.sentinel for p in self._processes], self._stopping,
                                                    self._failure_callbacks),
                         name="tp-rank-monitor", daemon=True).start()
        logger.info("%d tensor-parallel workers ready (pids %s)", size, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' pids, by rank."""
        return [process.pid for process in self._processes]

    def determine_available_memory(self) -> int:
        return min(self._call("determine_available_memory"))

    def kv_cache_bytes_per_block(self) -> int:
        return self._call("kv_cache_bytes_per_block")[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._step("execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self._step("sample_tokens", grammar_output)

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` from the monitor thread, once, when a rank's process ends before ``shutdown``;
        ``check_health`` (on the engine's thread, as every other call) then raises why. A rank already gone
        (it died before the engine registered) is reported at once, from this thread."""
        self._failure_callbacks.append(callback)
        if not self._stopping.is_set() and wait([process.sentinel for process in self._processes], timeout=0):
            callback()

    def check_health(self) -> None:
        """Raises: WorkerDiedError: naming the ranks that died, which ends this executor (the others are
        killed), as a call would."""
        if self._failed is not None:
            raise self._failed
        if wait([process.sentinel for process in self._processes], timeout=0):
            self._fail(self._fate_of_ranks())

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ calls

    def _step(self, method: str, *args: Any) -> ModelRunnerOutput | None:
        """Run a step call everywhere; rank 0's output, once every other rank's digest agrees with it."""
        output, *digests = self._call(method, *args)
        expected = step_digest(output)
        for rank, digest in enumerate(digests, start=1):
            if digest != expected:
                self._fail(WorkerDiedError(f"tensor-parallel rank {rank} went out of step with rank 0 in "
                                           f"{method} (different requests, tokens or failures)"))
        return output

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Run ``method`` on every rank; their answers, by rank.

        Anything that interrupts a call (a dead rank, Ctrl-C in a notebook) leaves the pipes
        mid-conversation, so it ends this executor: every later call raises the same error.
        """
        if self._failed is not None:
            raise self._failed
        payload = encode_call(method, *args)
        try:
            for pipe in self._pipes:
                pipe.send_bytes(payload)
            return self._receive_all()
        except WorkerDiedError:
            raise
        except OSError:  # a rank's end of the pipe is gone
            self._fail(self._fate_of_ranks())
        except BaseException as exc:
            self._stop_ranks(WorkerDiedError(f"a call to the tensor-parallel ranks was interrupted ({exc!r})"))
            raise

    def _receive_all(self, starting: bool = False) -> list[Any]:
        """One answer from every rank, by rank; fails as soon as any rank reports an error or dies.

        Args:
            starting: the ranks are starting: a configuration error (``ValueError``, ``OSError``) is
                raised as itself, as a single process would raise it.
        """
        answers: dict[int, Any] = {}
        by_pipe = {pipe: rank for rank, pipe in enumerate(self._pipes)}
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while len(answers) < len(self._pipes):
            pending = [pipe for pipe, rank in by_pipe.items() if rank not in answers]
            # Pipes first: a rank that raised has sent its traceback before its sentinel fires.
            for ready in sorted(wait([*pending, *sentinels]), key=lambda r: r in sentinels):
                if ready in sentinels:
                    self._fail(self._fate_of_ranks())
                rank = by_pipe[ready]
                try:
                    status, value = ready.recv()
                except (EOFError, OSError):  # a socket pair says ECONNRESET when the peer died mid-write
                    self._fail(self._fate_of_ranks())
                if status == "ok":
                    answers[rank] = value
                    continue
                exc, text = value
                if starting and isinstance(exc, ValueError | OSError):
                    self._fail((ValueError if isinstance(exc, ValueError) else OSError)(
                        f"tensor-parallel rank {rank}: {exc}"))
                self._fail(self._fate_of_ranks(rank, text))
        return [answers[rank] for rank in range(len(self._pipes))]

    def _fate_of_ranks(self, reporter: int | None = None, error: str | None = None) -> WorkerDiedError:
        """An error naming every rank that died, then ``reporter``'s traceback ``error``.

        Waits ``FATE_GRACE_S`` for deaths to show: when one rank is killed, a survivor's collective may
        fail first, and the error must blame the dead rank, not the survivor.
        """
        deadline = time.monotonic() + FATE_GRACE_S
        while not any(p.exitcode is not None for p in self._processes) and time.monotonic() < deadline:
            wait([p.sentinel for p in self._processes], timeout=deadline - time.monotonic())
        lines = [f"tensor-parallel rank {rank} (pid {process.pid}) {_exit_description(process.exitcode)}"
                 for rank, process in enumerate(self._processes)
                 if process.exitcode is not None and rank != reporter]
        if error is not None:
            lines.append(f"tensor-parallel rank {reporter} (pid {self._processes[reporter].pid}) raised:\n{error}")
        return WorkerDiedError("; ".join(lines) if lines else "a tensor-parallel rank closed its pipe")

    def _fail(self, error: BaseException) -> NoReturn:
        """Stop the ranks and raise ``error``, now and on every later call."""
        if isinstance(error, WorkerDiedError):
            logger.error("%s", error)
        self._stop_ranks(error)
        raise error from None

    def _stop_ranks(self, error: BaseException) -> None:
        """Kill every rank (they may be blocked in a collective: no polite shutdown); later calls raise
        ``error``."""
        self._failed = error
        for process in self._processes:
            if process.is_alive():
                process.kill()
        self.shutdown()


def _exit_description(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _watch_ranks(sentinels: list[int], stopping: threading.Event, callbacks: list[Callable[[], None]]) -> None:
    """The monitor thread: wait until a rank's process ends; then, unless the executor is stopping, call
    ``callbacks``. Reads nothing from the processes (their exit codes are read on the engine's thread)."""
    wait(sentinels)
    if not stopping.is_set():
        for callback in callbacks:
            callback()


def _stop(processes: list[BaseProcess], pipes: list[Connection], rendezvous: str, stopping: threading.Event) -> None:
    """Ask every rank to leave, kill those still running after ``SHUTDOWN_TIMEOUT_S``, close the pipes."""
    stopping.set()
    payload = encode_call("shutdown")
    for pipe in pipes:
        with contextlib.suppress(OSError):
            pipe.send_bytes(payload)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()
    with contextlib.suppress(FileNotFoundError):
        os.remove(rendezvous)


def _run_worker(config: EngineConfig, rank: int, init_method: str, pipe: Connection, log_level: int) -> None:
    """A rank's process: build the ``Worker``, answer "ready", then run calls until told to stop.

    Exits quietly when the engine's end of the pipe closes (the engine process is gone). A call that
    raises sends the exception and its traceback and exits with status 1 at once, without leaving
    the process group: the peers may be blocked in a collective, and leaving would wait for them.
    """
    # Signals sent to the server's process group (Ctrl-C, `timeout`, systemd's stop) must not kill
    # the ranks under a server that is draining: the engine decides when they stop.
    os.setpgrp()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    from pagedserve.engine.worker.worker import Worker  # torch loads in the child only

    worker = None
    ready = False
    try:
        worker = Worker(config, rank, init_method)
        worker.init_device()
        worker.load_model()
        pipe.send(("ok", "ready"))
        ready = True
        while True:
            method, args = pickle.loads(pipe.recv_bytes())
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            pipe.send(("ok", step_digest(result) if rank and method in STEP_METHODS else result))
    except (EOFError, ConnectionError):
        return
    except BaseException as exc:  # noqa: BLE001 - whatever stops this rank must reach the engine
        if ready or not isinstance(exc, ValueError | OSError):  # a start-up setting error: the engine says it
            logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(Exception):
            try:
                pipe.send(("error", (exc, traceback.format_exc())))
            except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
                pipe.send(("error", (None, traceback.format_exc())))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    worker.shutdown()
