"""CUDA graphs for decode steps: capture the forward once per batch size, replay it with padding.

A decode-only step (every request runs one token) launches the same kernels
for every step of a given batch size, so the model's forward is recorded once
per size in a ``torch.cuda.CUDAGraph`` and replayed, which removes the
per-kernel launch overhead that dominates small decode batches. A graph reads
and writes fixed ("static") buffers: a step copies its inputs into the first
rows, pads the rest up to the next captured size, replays, and keeps the first
rows of the output. This is vLLM's decode CUDA-graph scheme, capture-size grid
included (``[1, 2, 4] + range(8, max, 8)``).

Padded rows hold one token each with input id 0, position 0, slot -1 (the
cache write skips it), ``seq_len`` 0 (attention reads no key and returns
zeros) and a block-table row of zeros (the null block); their outputs are
discarded. A graph cannot see host values, so only an attention backend that
reads no host array values inside ``forward`` (the Triton backend) can be
captured.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.engine.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# forward(input_ids [B] int64, positions [B] int64, metadata) -> [B, ...] outputs (hidden states).
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, capped at ``max_num_seqs``.

    ``max_num_seqs`` itself is always the last size, appended when it is off the
    grid (100 -> ``[1, 2, 4, 8, 16, ..., 96, 100]``), so every decode batch the
    scheduler can form has a graph.

    Raises:
        ValueError: when ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size ``>= num_reqs``, or None (run eagerly) when ``num_reqs`` exceeds them all.

    Args:
        num_reqs: requests in the decode step.
        sizes: captured sizes in ascending order, as ``capture_sizes`` returns them.

    Raises:
        ValueError: when ``num_reqs < 1``.
    """
    if num_reqs < 1:
        raise ValueError(f"num_reqs must be >= 1, got {num_reqs}")
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The static inputs every captured graph reads; row i is request i of the decode batch.

    Attributes:
        input_ids: ``[max_batch_size]`` int64.
        positions: ``[max_batch_size]`` int64.
        slot_mapping: ``[max_batch_size]`` int64, -1 on padded rows.
        seq_lens: ``[max_batch_size]`` int32, 0 on padded rows.
        block_table: ``[max_batch_size, max_blocks_per_req]`` int32, zeros on padded rows.
        query_start_loc: ``[max_batch_size + 1]`` int32, ``arange``: one query token per row,
            so any prefix of it is the right ``query_start_loc`` for a smaller size.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor

    @classmethod
    def allocate(cls, max_batch_size: int, max_blocks_per_req: int, device: torch.device) -> DecodeBuffers:
        """Buffers for decode batches of up to ``max_batch_size`` requests, all rows padding."""
        buffers = cls(
            input_ids=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            positions=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            slot_mapping=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(max_batch_size, dtype=torch.int32, device=device),
            block_table=torch.zeros(max_batch_size, max_blocks_per_req, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
        )
        buffers.pad(0, max_batch_size)
        return buffers

    @property
    def max_batch_size(self) -> int:
        return self.input_ids.shape[0]

    def pad(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` padding: no cache write, no key read, output discarded."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.seq_lens[start:end] = 0
        self.block_table[start:end] = 0

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        batch_size: int,
    ) -> None:
        """Copy a decode step of ``n`` requests into rows ``[0, n)`` and pad rows ``[n, batch_size)``.

        Args:
            input_ids, positions, slot_mapping: ``[n]`` int64.
            seq_lens: ``[n]`` int32.
            block_table: ``[n, num_cols]`` int32 with ``num_cols <= max_blocks_per_req``;
                columns past ``num_cols`` keep stale ids, which attention never reads
                (it reads only the blocks covering ``seq_len``).
            batch_size: the captured size to pad to.

        Raises:
            ValueError: when ``n`` exceeds ``batch_size``, ``batch_size`` exceeds the
                buffers, or the block table is wider than the buffers.
        """
        n = input_ids.shape[0]
        if not n <= batch_size <= self.max_batch_size:
            raise ValueError(f"need num_reqs ({n}) <= batch_size ({batch_size}) <= {self.max_batch_size}")
        num_cols = block_table.shape[1]
        if num_cols > self.block_table.shape[1]:
            raise ValueError(f"block_table has {num_cols} columns, buffers hold {self.block_table.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_table[:n, :num_cols].copy_(block_table, non_blocking=True)
        self.pad(n, batch_size)

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """Attention metadata over the first ``batch_size`` rows, as views of the buffers.

        The host arrays are fixed when a graph is captured, so they carry only
        shapes: ``seq_lens_cpu`` is filled with ``max_seq_len``, an upper bound.

        Args:
            batch_size: rows the graph covers (one token each).
            max_seq_len: the longest sequence a replay may see (``max_model_len``), in tokens.
        """
        return AttentionMetadata(
            num_actual_tokens=batch_size,
            query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_table=self.block_table[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=np.arange(batch_size + 1, dtype=np.int32),
            seq_lens_cpu=np.full(batch_size, max_seq_len, dtype=np.int32),
        )


class CudaGraphRunner:
    """Captures a decode forward for each batch size and replays the smallest graph that fits. CUDA only.

    Usage: ``runner.capture()`` once after the KV cache is allocated; then per
    decode-only step ``runner.run(...)``, and run eagerly when it returns None.
    """

    def __init__(
        self,
        forward: DecodeForward,
        sizes: list[int],
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        """
        Args:
            forward: the model's forward with its KV caches bound; must be capturable
                (no host syncs, no allocation outside the graph's pool).
            sizes: batch sizes to capture, ascending (``capture_sizes``).
            max_blocks_per_req: block-table columns.
            max_model_len: longest sequence, in tokens.
            device: a CUDA device.

        Raises:
            ValueError: when ``device`` is not CUDA or ``sizes`` is empty.
        """
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not sizes:
            raise ValueError("sizes must not be empty")
        self.sizes = sizes
        self._forward = forward
        self._max_model_len = max_model_len
        self._buffers = DecodeBuffers.allocate(sizes[-1], max_blocks_per_req, device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, on all-padding inputs (nothing is written to the cache)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then fit in the memory the largest one left in the pool.
        for size in reversed(self.sizes):
            self._buffers.pad(0, size)
            input_ids, positions = self._buffers.input_ids[:size], self._buffers.positions[:size]
            metadata = self._buffers.metadata(size, self._max_model_len)
            # Warm-up outside the graph: Triton compiles and cuBLAS picks its kernels here.
            self._forward(input_ids, positions, metadata)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(input_ids, positions, metadata)
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.sizes), self.sizes, time.perf_counter() - start)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
    ) -> torch.Tensor | None:
        """Replay the graph for a decode step of ``n`` requests (arguments as in ``DecodeBuffers.fill``).

        Returns:
            The first ``n`` rows of the graph's output, a view that the next
            replay overwrites; None when no captured size fits or ``capture`` has
            not run (run eagerly).
        """
        num_reqs = input_ids.shape[0]
        size = padded_batch_size(num_reqs, self.sizes)
        if size is None or size not in self._graphs:
            return None
        self._buffers.fill(input_ids, positions, slot_mapping, seq_lens, block_table, size)
        self._graphs[size].replay()
        return self._outputs[size][:num_reqs]
