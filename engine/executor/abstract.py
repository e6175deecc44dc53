"""The interface between the engine core and its workers (vLLM V1's ``Executor``).

The engine core calls no device itself: it asks the executor how much memory
the KV cache may take, tells it how many blocks to allocate, and hands it each
step's ``SchedulerOutput``. A tensor-parallel executor implements the same
calls by broadcasting them to one worker per rank and returning rank 0's result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.outputs import ModelRunnerOutput


class Executor(ABC):
    """Runs the engine's workers.

    Args:
        config: the engine's resolved configuration; the constructor loads the model.

    Raises:
        ValueError: a setting the device cannot honour (see ``Worker.init_device``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor ``config`` needs: one in-process worker, or one process per tensor-parallel rank."""
        if config.args.tensor_parallel_size > 1:
            from pagedserve.engine.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        from pagedserve.engine.executor.uniproc import UniProcExecutor
        return UniProcExecutor

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes each worker can give its KV cache (the smallest over the workers)."""

    @abstractmethod
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes on a worker, all layers, keys and values."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks on every worker (block 0 is the null block)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's plan and run the forward pass.

        Returns:
            None when the step has tokens to sample (``sample_tokens`` follows), else the
            step's whole output (no tokens; prompt logprobs of partial prefills).
        """

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample from the logits the last ``execute_model`` kept, within the step's grammar masks."""

    def register_failure_callback(self, callback: Callable[[], None]) -> None:  # noqa: B027 - optional
        """Call ``callback`` (from another thread, once) when a worker dies while no call is running, so that
        an idle engine finds out without waiting for its next request. Workers in this process cannot die on
        their own: nothing to watch here."""

    def check_health(self) -> None:  # noqa: B027 - optional
        """Raise when a worker has died (for an executor with worker processes: ``WorkerDiedError``)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers."""
