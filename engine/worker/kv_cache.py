"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import logging

import torch

from pagedserve.engine.worker.host_resources import available_memory_bytes

logger = logging.getLogger(__name__)

#: KV cache size on CPU when ``kv_cache_memory_bytes`` is not given and memory allows.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
#: Share of the memory still available (after the weights) the CPU KV cache may take by default; the
#: rest is for activations, the tokenizer, HTTP buffers and the allocator's slack.
CPU_KV_CACHE_MEMORY_FRACTION = 0.5


def default_cpu_kv_cache_bytes(available: int | None = None) -> int:
    """The CPU KV cache size when none is configured: ``DEFAULT_CPU_KV_CACHE_BYTES``, or
    ``CPU_KV_CACHE_MEMORY_FRACTION`` of ``available`` bytes when that is less.

    Args:
        available: bytes the process can still allocate; None = measured now (the host's
            available memory, capped by the cgroup limit: see ``host_resources``).
    """
    available = available_memory_bytes() if available is None else available
    if available is None:
        return DEFAULT_CPU_KV_CACHE_BYTES
    budget = min(DEFAULT_CPU_KV_CACHE_BYTES, int(available * CPU_KV_CACHE_MEMORY_FRACTION))
    if budget < DEFAULT_CPU_KV_CACHE_BYTES:
        logger.info("%.2f GiB of memory available (cgroup limit included): KV cache sized to %.2f GiB",
                    available / 2**30, budget / 2**30)
    return budget


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_cuda_kv_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache on a CUDA device after weights and activations.

    Call after the weights are loaded and a profiling forward at the largest
    step has run, so the allocator's peak includes activations.
    """
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    current = torch.cuda.memory_allocated(device)
    # Memory used outside torch's allocator (other processes, the CUDA context) counts against the budget.
    non_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * gpu_memory_utilization) - non_torch - peak
    logger.info("CUDA memory: total %.2f GiB, free %.2f GiB, weights %.2f GiB, activation peak %.2f GiB, "
                "KV cache budget %.2f GiB", total / 2**30, free / 2**30, current / 2**30,
                (peak - current) / 2**30, budget / 2**30)
    return budget


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer (zeros)."""
    return [torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)]
