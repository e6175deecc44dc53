"""Paged attention: the metadata a step carries, and the backend interface.

The KV cache of one layer is a tensor of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = keys,
1 = values). Token ``t`` of a request lives in slot
``block_table[req, t // block_size] * block_size + t % block_size``.
Backends register themselves by name (``register_backend``) so a CUDA kernel
can replace the torch reference without touching the models. Each declares
its contract: the devices it runs on, whether a CUDA graph can capture it,
and the per-step metadata it reads (``build_metadata``, vLLM V1's split of
common metadata and a backend's metadata builder).
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
    to every layer's ``forward``. One instance serves every layer of a model.

    Args:
        block_size: tokens per block of the KV caches ``forward`` will be given.
        logit_softcap: soft-capping of the attention scores (Gemma 2): each scaled score ``s`` becomes
            ``cap * tanh(s / cap)`` before the mask and softmax; None for none.
    """

    #: The name it is registered as (``register_backend``).
    name: str = ""
    #: Device types (``torch.device.type``) the backend runs on.
    supported_devices: tuple[str, ...] = ()
    #: Whether a CUDA graph can capture ``forward``: it reads no host values, and the metadata
    #: ``build_metadata`` returns at capture time stays valid for every replay (views of the
    #: runner's static buffers, nothing computed from their contents on the host).
    supports_cuda_graphs: bool = False

    def __init__(self, block_size: int, logit_softcap: float | None = None) -> None:
        self.block_size = block_size
        self.logit_softcap = logit_softcap

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """The metadata ``forward`` reads for one step, from the runner's common layout (default: as is).

        A backend that plans the step (splits decodes from prefill chunks,
        precomputes masks) does it here, once, instead of in every layer.
        """
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
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal paged attention for a mixed batch of prefill chunks and decodes.

        Every key and value of the step must be in the cache before any query
        reads it: the prefix cache lets one request read blocks that another
        request of the same step is writing.

        Args:
            query: ``[T, num_heads, head_dim]``.
            key, value: ``[T, num_kv_heads, head_dim]``, written at ``metadata.slot_mapping``.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            metadata: the step's layout, as ``build_metadata`` returned it.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            sliding_window: the layer's window W in tokens, or None for full attention: a query at
                position p then sees only keys at positions ``p - W + 1 .. p`` (Beltagy et al. 2020,
                arXiv:2004.05150; transformers' ``sliding_window`` means the same).

        Returns:
            ``[T, num_heads, head_dim]``: each query token attends to its
            request's tokens at positions ``<=`` its own (within the window).
        """


_BACKENDS: dict[str, type[AttentionBackend]] = {}
# Built-in backends, imported on first use; none imports triton until it is instantiated, so that
# listing the backends never initialises triton (its TRITON_INTERPRET setting is read at import).
_BUILTIN_MODULES = {"torch": "pagedserve.engine.model.torch_attention", "cpu": "pagedserve.engine.model.cpu_attention",
                    "triton": "pagedserve.engine.model.triton_attention"}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator that makes a backend available by ``name``."""

    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        cls.name = name
        return cls

    return wrap


def _backend_classes() -> dict[str, type[AttentionBackend]]:
    """Every registered backend by name, the built-in ones imported."""
    for name, module in _BUILTIN_MODULES.items():
        if name not in _BACKENDS:
            importlib.import_module(module)
    return _BACKENDS


def attention_backends_for(device: torch.device | str) -> list[str]:
    """Names of the backends that run on ``device``'s type, sorted."""
    device_type = torch.device(device).type
    return sorted(name for name, cls in _backend_classes().items() if device_type in cls.supported_devices)


def check_attention_backend(name: str, device: torch.device | str) -> None:
    """Check the ``attention_backend`` setting against the device the model runs on.

    Raises:
        ValueError: when no backend is registered as ``name`` or it does not run
            on ``device``; the message names the setting and lists the backends
            that do.
    """
    valid = attention_backends_for(device)
    if name not in valid:
        device_type = torch.device(device).type
        reason = "is unknown" if name not in _BACKENDS else f"does not run on {device_type}"
        raise ValueError(f"attention_backend {name!r} {reason}; backends for {device_type}: {valid}")


def get_attention_backend(name: str, block_size: int, logit_softcap: float | None = None) -> AttentionBackend:
    """Instantiate the backend registered as ``name`` for KV caches of ``block_size``-token blocks (and scores
    soft-capped at ``logit_softcap``, see ``AttentionBackend``).

    Raises:
        ValueError: when no backend has that name, or its dependencies (e.g. triton) are missing.
    """
    cls = _backend_classes().get(name)
    if cls is None:
        raise ValueError(f"attention backend {name!r} is not available; registered: {sorted(_BACKENDS)}")
    try:
        return cls(block_size, logit_softcap)
    except ImportError as err:
        raise ValueError(f"attention backend {name!r} is not available: {err}") from err
