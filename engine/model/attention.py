"""Paged attention: the metadata a step carries, and the backend interface.

The KV cache of one layer is a tensor of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = keys,
1 = values). Token ``t`` of a request lives in slot
``block_table[req, t // block_size] * block_size + t % block_size``.
Backends register themselves by name (``register_backend``) so a CUDA kernel
can replace the torch reference without touching the models.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit, built once per step by the model runner.

    All tensors live on the model's device.

    Attributes:
        num_actual_tokens: tokens in the flattened batch (T).
        query_start_loc: ``[num_reqs + 1]`` int32, cumulative query lengths
            (``cu_seqlens_q``); request i owns tokens
            ``query_start_loc[i]:query_start_loc[i + 1]``.
        seq_lens: ``[num_reqs]`` int32, ``num_computed_tokens + num_scheduled_tokens``
            (the context each request attends to, this step's tokens included).
        block_table: ``[num_reqs, max_blocks_per_req]`` int32 block ids.
        slot_mapping: ``[T]`` int64 cache slot of each token of this step.
        max_query_len: longest query of the step, in tokens.
        max_seq_len: longest ``seq_lens`` entry, in tokens.
        query_start_loc_cpu: the same as ``query_start_loc``, as a host array,
            so backends can plan without a device sync.
        seq_lens_cpu: the same as ``seq_lens``, as a host array.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache and attends over it.

    The model runner calls ``build_metadata`` once per step and hands its result
    to every layer's ``forward``.
    """

    #: Whether a CUDA graph can capture ``forward`` (it must read no host values).
    supports_cuda_graphs: bool = False

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """The metadata ``forward`` reads for one step, from the runner's common layout (default: as is)."""
        return common

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal paged attention for a mixed batch of prefill chunks and decodes.

        Every key and value of the step must be in the cache before any query
        reads it: the prefix cache lets one request read blocks that another
        request of the same step is writing.

        Args:
            query: ``[T, num_heads, head_dim]``.
            key, value: ``[T, num_kv_heads, head_dim]``, written at ``metadata.slot_mapping``.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            metadata: the step's layout.
            scale: softmax scale, usually ``head_dim ** -0.5``.

        Returns:
            ``[T, num_heads, head_dim]``: each query token attends to its
            request's tokens at positions ``<=`` its own.
        """


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}
# Built-in backends, imported on first use so that a CPU server never imports triton.
_BUILTIN_MODULES = {"torch": "engine.model.torch_attention", "cpu": "engine.model.cpu_attention",
                    "triton": "engine.model.triton_attention"}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator that makes a backend available by ``name``."""

    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate the backend registered as ``name``.

    Raises:
        ValueError: when no backend has that name (or its dependencies, e.g. triton, are missing).
    """
    if name not in _BACKENDS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
