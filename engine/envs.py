"""The ``PAGEDSERVE_*`` environment variables: the one place they are read, each with its default (vLLM's
``envs.py``).

Read at each access, not at import (``envs.PAGEDSERVE_CACHE_DIR`` calls its reader through the module's
``__getattr__``), so that a variable set after import, by a test's ``monkeypatch.setenv`` say, counts.
Import the module and read its attributes (``from pagedserve.engine import envs``; ``envs.X``):
``from pagedserve.engine.envs import X`` would keep the value X had at that import.
docs/configuration.md lists them. Variables of other tools (``HF_HUB_OFFLINE``, ``OMP_NUM_THREADS``,
``TRITON_INTERPRET``, ``CC``) are read where they are used.

This module imports no torch: the scheduler side may import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _switch(name: str) -> bool:
    """On unless the variable is ``0``."""
    return os.environ.get(name, "1") != "0"


#: Each variable's reader, given its name.
_READERS: dict[str, Callable[[str], Any]] = {
    # Where the engine keeps what it builds once: GGUF models converted to HF folders (gguf/), their staged
    # blocks (gguf-blocks/), the compiled CPU kernels (kernels/). A path; default ~/.cache/pagedserve.
    "PAGEDSERVE_CACHE_DIR": lambda name: os.path.expanduser(os.environ.get(name, "~/.cache/pagedserve")),
    # The server's API key when neither a flag nor the --config file sets api_key; unset or empty = none.
    "PAGEDSERVE_API_KEY": lambda name: os.environ.get(name) or None,
    # 0: `pagedserve serve` runs the engine core on a thread of the server's process (InprocClient) instead
    # of a child process (ProcClient); vLLM's VLLM_ENABLE_V1_MULTIPROCESSING. For comparing the two.
    "PAGEDSERVE_ENABLE_MULTIPROCESSING": _switch,
    # 0: CPU decode steps run the decoder layers one by one instead of the fused C decode step
    # (pagedserve.engine.model.fused_decode); read when the model loads.
    "PAGEDSERVE_FUSED_DECODE": _switch,
    # 0: the torch reference of the fused CPU elementwise ops (pagedserve.engine.model.cpu_ops) everywhere;
    # read once per process, at the first such op. For comparisons and benchmarks.
    "PAGEDSERVE_FUSED_CPU_OPS": _switch,
    # 1 or true: with --enable-lora, POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters
    # served (pagedserve.server.models); vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING counts the same. Default off.
    "PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": lambda name: any(
        os.environ.get(variable, "").lower() in ("1", "true")
        for variable in (name, "VLLM_ALLOW_RUNTIME_LORA_UPDATING")),
}


def __getattr__(name: str) -> Any:
    if name in _READERS:
        return _READERS[name](name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(_READERS)
