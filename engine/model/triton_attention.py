"""Paged attention in Triton: one launch for a mixed batch of prefill chunks and decodes.

The kernels are in ``triton_kernels`` (a cache-write kernel, then one
attention kernel for the whole batch, after vLLM's unified Triton attention).
This module does not import Triton: the kernels are imported when a backend is
instantiated, so that listing the backends never initialises Triton (whose
``TRITON_INTERPRET`` setting is read at that first import).
"""

from __future__ import annotations

import importlib
import os

import torch

from pagedserve.engine.model.attention import AttentionBackend, AttentionMetadata, register_backend
from pagedserve.engine.profiling import region


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (tests).

    No device-to-host sync: the launch grids and tile sizes depend only on host
    values (shapes, ``num_actual_tokens``, ``num_reqs``, ``max_query_len``), so a
    decode step can be captured in a CUDA graph. ``build_metadata`` is the
    identity: the kernels read the common layout.

    Args:
        block_size: tokens per block of the KV caches (the kernels read it from the cache's shape).
        logit_softcap: see ``AttentionBackend``.

    Raises:
        ImportError: when Triton is not installed.
    """

    supported_devices = ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)
    supports_cuda_graphs = True

    def __init__(self, block_size: int, logit_softcap: float | None = None) -> None:
        super().__init__(block_size, logit_softcap)
        self._kernels = importlib.import_module("pagedserve.engine.model.triton_kernels")

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
        """Write this step's K/V into ``kv_cache``, then attend causally over each request's blocks.

        Args:
            query: ``[T, num_heads, head_dim]``, fp32, bf16 or fp16; only the first
                ``metadata.num_actual_tokens`` rows are attended.
            key, value: ``[T, num_kv_heads, head_dim]``, same dtype; row t < num_actual_tokens
                is written at ``metadata.slot_mapping[t]``, skipped when that slot is negative.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
            metadata: the step's layout.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            sliding_window: keys each query sees, its own included (``AttentionBackend.forward``); None: all.

        Returns:
            ``[T, num_heads, head_dim]`` in the query's dtype. Rows past
            ``num_actual_tokens`` and those of a request with ``seq_len`` 0 (a
            padded row) are zeros.

        Raises:
            ValueError: when ``num_heads`` is not a multiple of ``num_kv_heads``, or the
                cache's trailing dims do not match ``key``.
        """
        num_heads = query.shape[1]
        num_kv_heads = key.shape[1]
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if kv_cache.shape[3:] != key.shape[1:]:
            raise ValueError(f"kv_cache dims {tuple(kv_cache.shape)} do not match key {tuple(key.shape)}")
        with region("attention"):
            num_tokens = metadata.num_actual_tokens
            out = torch.empty_like(query)
            out[num_tokens:] = 0
            if num_tokens == 0:
                return out
            self._kernels.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, num_tokens)
            self._kernels.paged_attention(out, query, kv_cache, metadata, scale, sliding_window, self.logit_softcap)
            return out
