"""pagedserve: an OpenAI-compatible LLM server with continuous batching over a paged KV cache.

Offline, in this process::

    from pagedserve import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

As a server: ``pagedserve serve`` or ``python -m pagedserve serve``. The engine is ``pagedserve.engine``,
the HTTP server ``pagedserve.server``.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.sampling_params import SamplingParams

try:
    __version__ = version("pagedserve")
except PackageNotFoundError:  # a source checkout that was never pip-installed
    __version__ = "0.0.0+source"

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazily, as in pagedserve.engine: importing the package (for its version, say) loads no model code.
    if name == "LLM":
        from pagedserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
