"""``UniProcExecutor``: one worker, in the engine core's own process and thread."""

from __future__ import annotations

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.executor.abstract import Executor
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.engine.worker.worker import Worker


class UniProcExecutor(Executor):
    """Drives a single ``Worker`` by direct calls."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_available_memory(self) -> int:
        return self.worker.determine_available_memory()

    def kv_cache_bytes_per_block(self) -> int:
        return self.worker.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.worker.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        self.worker = None
