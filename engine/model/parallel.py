"""Tensor parallelism as the layers see it: this process's rank, the group's size, and the two collectives.

Megatron-LM's scheme (Shoeybi et al., 2019, arXiv:1909.08053), as vLLM lays it
out: a column-parallel layer holds a slice of the output features and needs no
communication; a row-parallel layer holds a slice of the input features and
sums its partial output over the group (all-reduce). Every layer is built with
a ``TensorParallel`` and takes its own slice of each checkpoint tensor when
loading. At size 1 both collectives return their input; larger sizes run one
process per rank (``engine/executor/multiproc.py``), each in the
``torch.distributed`` group the worker joins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: this process's rank, ``0 <= rank < size``.
        size: processes the weights are split over.

    Raises:
        ValueError: when ``size < 1`` or ``rank`` is outside ``[0, size)``.
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, size {self.size})")

    def divide(self, total: int, what: str) -> int:
        """``total // size``, the share of ``total`` on each rank.

        Raises:
            ValueError: when ``total`` does not split evenly; the message names ``what``.
        """
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({self.size})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the group (in place when ``size > 1``)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (``[..., n]``) concatenated in rank order along the last dim: ``[..., size * n]``."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
