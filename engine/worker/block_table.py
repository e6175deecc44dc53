"""The worker's block table: KV block ids of each persistent-batch row."""

from __future__ import annotations

import numpy as np
import torch


def slot_mapping(block_table: np.ndarray, block_size: int, req_indices: np.ndarray,
                 positions: np.ndarray) -> np.ndarray:
    """Cache slot of each token: ``block_table[req, pos // block_size] * block_size + pos % block_size``.

    Args:
        block_table: ``[num_reqs, max_blocks]`` int block ids.
        block_size: tokens per block.
        req_indices: ``[T]`` batch row of each token.
        positions: ``[T]`` position of each token in its sequence.

    Returns:
        ``[T]`` int64 slots.
    """
    block_numbers = block_table[req_indices, positions // block_size].astype(np.int64)
    return block_numbers * block_size + positions % block_size


class BlockTable:
    """``[max_num_reqs, max_num_blocks_per_req]`` int32 block ids, one row per batch row.

    The host copy is the source of truth; ``commit`` copies the first rows to
    the device once per step.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int,
                 device: torch.device, pin_memory: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.block_table_cpu = torch.zeros((max_num_reqs, max_num_blocks_per_req), dtype=torch.int32,
                                           pin_memory=pin_memory)
        self.block_table_np = self.block_table_cpu.numpy()
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = (self.block_table_cpu if device.type == "cpu"
                            else torch.zeros_like(self.block_table_cpu, device=device))

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        start = self.num_blocks_per_row[row]
        self.block_table_np[row, start:start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row] = start + len(block_ids)

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks_per_row[src]
        self.block_table_np[dst, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[dst] = n

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``slot_mapping`` over this table's host rows."""
        return slot_mapping(self.block_table_np, self.block_size, req_indices, positions)

    def commit(self, num_reqs: int) -> torch.Tensor:
        """The first ``num_reqs`` rows on the device: ``[num_reqs, max_num_blocks_per_req]`` int32."""
        if self.device.type != "cpu":
            # Blocking on purpose: the host rows are rewritten by the next step's
            # bookkeeping, which may run before an asynchronous copy has (a step
            # of partial prefills never syncs with the device).
            self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs])
        return self.block_table[:num_reqs]
