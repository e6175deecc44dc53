"""pagedserve's engine: scheduler, paged KV cache, model runner and the offline ``LLM`` API."""

from typing import Any

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that the scheduler (which needs no torch) loads without torch.
    if name == "LLM":
        from pagedserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
