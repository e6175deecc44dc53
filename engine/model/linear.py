"""Tensor-parallel linear layers: each holds its rank's slice of a weight and loads it from the full tensor.

As in vLLM (``vllm/model_executor/layers/linear.py``), after Megatron-LM
(arXiv:1909.08053):

* ``ColumnParallelLinear`` splits the output features (weight rows): rank r
  computes output columns ``[r * n, (r + 1) * n)``, no communication.
* ``MergedColumnParallelLinear`` is several column-parallel projections of
  the same input stored as one weight (gate and up), each split on its own.
* ``QKVParallelLinear`` is the query, key and value projections, split by
  heads; with fewer KV heads than ranks each KV head is replicated on
  ``size // num_kv_heads`` ranks.
* ``RowParallelLinear`` splits the input features (weight columns) and sums
  the partial outputs over the group; the bias is added once, on rank 0.

A column-parallel layer's output stays split: the row-parallel layer after it
takes it as its input. The weight's storage and kernel belong to the layer's
``LinearMethodBase``; parameters are uninitialised until loaded. A layer served with LoRA
adapters holds a ``LoRALayer`` (``pagedserve.engine.model.lora``), which adds the adapters'
products to its output, before the row-parallel sum.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagedserve.engine.model.linear_methods import LinearMethodBase
from pagedserve.engine.model.lora import LoRALayer
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.weights import ShardId, copy_shard, set_weight_loader


class LinearBase(nn.Module, ABC):
    """``y = x @ weight.T + bias`` on this rank's slice, through ``linear_method``.

    Attributes:
        input_size, output_size: the full layer's features, over all ranks.
        linear_method: creates and multiplies the weight.
        tp: the tensor-parallel group.
        lora: the adapters' slots, set by the worker's ``LoRAManager`` when it serves adapters; else None.
    """

    def __init__(self, input_size: int, output_size: int, *, linear_method: LinearMethodBase,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.linear_method, self.tp = linear_method, tp
        self.lora: LoRALayer | None = None

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The weight's product with ``x``, plus the adapters' where they are served."""
        out = self.linear_method.apply(self, x, bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def _create_weights(self, input_size_per_partition: int, output_partition_sizes: list[int],
                        bias_size: int | None) -> None:
        """The weight (by ``linear_method``) and, when ``bias_size`` is given, a bias of that many features."""
        self.linear_method.create_weights(self, input_size_per_partition, output_partition_sizes,
                                          self.weight_loader)
        self.bias = None
        if bias_size is not None:
            bias = nn.Parameter(torch.empty(bias_size), requires_grad=False)
            self.bias = set_weight_loader(bias, self.weight_loader)

    @abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy this rank's slice of the full checkpoint tensor ``loaded`` into ``param``.

        Raises:
            ValueError: when ``loaded`` does not have the full tensor's shape.
        """


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: the weight holds rows ``[rank * n, (rank + 1) * n)``, ``n = out / size``.

    Args:
        input_size: input features.
        output_size: output features over all ranks.
        bias: whether a bias (split like the rows) is added.
        linear_method: creates and multiplies the weight.
        tp: the tensor-parallel group.

    Raises:
        ValueError: when ``output_size`` does not split evenly over the ranks.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, linear_method: LinearMethodBase,
                 tp: TensorParallel) -> None:
        super().__init__(input_size, output_size, linear_method=linear_method, tp=tp)
        self.output_partition_sizes = self._partition_sizes()
        rows = sum(self.output_partition_sizes)
        self._create_weights(input_size, self.output_partition_sizes, rows if bias else None)

    def _partition_sizes(self) -> list[int]:
        """This rank's output features, one entry per fused checkpoint tensor."""
        return [self.tp.divide(self.output_size, "output_size")]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """See ``LinearBase.weight_loader``: rows ``[rank * n, (rank + 1) * n)`` of ``loaded``."""
        copy_shard(param.data, loaded, 0, self.tp.rank, self.tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., input_size]`` -> ``[..., output_size / tp.size]``, this rank's output columns."""
        return self._product(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel projections of one input, stacked: shard ``i`` (an int) is ``output_sizes[i]`` rows.

    Each shard is split across ranks on its own, so rank r holds its slice of
    every shard, in shard order (gate then up for a SwiGLU MLP).

    Args:
        input_size: input features.
        output_sizes: each shard's output features over all ranks.
        bias, linear_method, tp: as for ``ColumnParallelLinear``.

    Raises:
        ValueError: when a shard does not split evenly over the ranks.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *,
                 linear_method: LinearMethodBase, tp: TensorParallel) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, linear_method=linear_method, tp=tp)

    def _partition_sizes(self) -> list[int]:
        return [self.tp.divide(size, f"output_sizes[{i}]") for i, size in enumerate(self.output_sizes)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """See ``LinearBase.weight_loader``: this rank's rows of shard ``shard_id`` into that shard's place; with
        no ``shard_id``, every shard of a checkpoint that stores them stacked too (Phi-3's ``gate_up_proj``)."""
        if shard_id is None:
            for index, part in enumerate(loaded.split(self.output_sizes)):
                self.weight_loader(param, part, index)
            return
        offset = sum(self.output_partition_sizes[:shard_id])
        target = param.data.narrow(0, offset, self.output_partition_sizes[shard_id])
        copy_shard(target, loaded, 0, self.tp.rank, self.tp.size)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections as one weight, split by heads; shard ids ``"q"``, ``"k"``, ``"v"``.

    Rank r holds query heads ``[r * h, (r + 1) * h)`` (``h = num_heads / size``)
    and, when ``num_kv_heads >= size``, KV heads split the same way; with fewer
    KV heads than ranks each rank holds one KV head, KV head ``r // (size / num_kv_heads)``.

    Attributes:
        num_heads, num_kv_heads: query and KV heads on this rank.

    Args:
        hidden_size: input features.
        head_dim: channels per head.
        total_num_heads, total_num_kv_heads: heads over all ranks.
        bias, linear_method, tp: as for ``ColumnParallelLinear``.

    Raises:
        ValueError: when the heads do not split evenly over the ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, *, linear_method: LinearMethodBase, tp: TensorParallel) -> None:
        self.head_dim = head_dim
        self.total_sizes = [total_num_heads * head_dim, total_num_kv_heads * head_dim, total_num_kv_heads * head_dim]
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = split_heads(
            total_num_heads, total_num_kv_heads, tp)
        super().__init__(hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_dim, bias,
                         linear_method=linear_method, tp=tp)

    def _partition_sizes(self) -> list[int]:
        kv_rows = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv_rows, kv_rows]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """See ``LinearBase.weight_loader``: this rank's heads of the q, k or v tensor into their place; with no
        ``shard_id``, of all three from a checkpoint that stores them stacked too (Phi-3's ``qkv_proj``)."""
        if shard_id is None:
            for part_id, part in zip(("q", "k", "v"), loaded.split(self.total_sizes), strict=True):
                self.weight_loader(param, part, part_id)
            return
        index = ("q", "k", "v").index(shard_id)
        offset = sum(self.output_partition_sizes[:index])
        target = param.data.narrow(0, offset, self.output_partition_sizes[index])
        if shard_id == "q":
            copy_shard(target, loaded, 0, self.tp.rank, self.tp.size)
        else:
            replicas = self.num_kv_head_replicas
            copy_shard(target, loaded, 0, self.tp.rank // replicas, self.tp.size // replicas)


def split_heads(total_num_heads: int, total_num_kv_heads: int, tp: TensorParallel) -> tuple[int, int, int]:
    """``(query heads, KV heads, ranks holding each KV head)`` on each rank (see ``QKVParallelLinear``).

    Raises:
        ValueError: query heads that do not split over the ranks, or KV heads that neither split over
            them nor divide their number.
    """
    num_heads = tp.divide(total_num_heads, "num_attention_heads")
    if tp.size < total_num_kv_heads:
        return num_heads, tp.divide(total_num_kv_heads, "num_key_value_heads"), 1
    if tp.size % total_num_kv_heads:
        raise ValueError(f"the tensor-parallel size ({tp.size}) is not a multiple of num_key_value_heads "
                         f"({total_num_kv_heads})")
    return num_heads, 1, tp.size // total_num_kv_heads


class RowParallelLinear(LinearBase):
    """Input features split across ranks: the weight holds columns ``[rank * n, (rank + 1) * n)``, ``n = in / size``.

    Each rank multiplies its slice of the input (the split output of a
    column-parallel layer) and the partial outputs are summed over the group.

    Args:
        input_size: input features over all ranks.
        output_size: output features.
        bias: whether a bias is added (whole on every rank, added on rank 0 only).
        linear_method, tp: as for ``ColumnParallelLinear``.
        reduce_results: sum the partial outputs over the group; False leaves each rank its partial sum, for a
            caller that adds several such outputs before one sum (the experts of a mixture).

    Raises:
        ValueError: when ``input_size`` does not split evenly over the ranks.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, linear_method: LinearMethodBase,
                 tp: TensorParallel, reduce_results: bool = True) -> None:
        super().__init__(input_size, output_size, linear_method=linear_method, tp=tp)
        self.reduce_results = reduce_results
        self.input_size_per_partition = tp.divide(input_size, "input_size")
        self._create_weights(self.input_size_per_partition, [output_size], output_size if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """See ``LinearBase.weight_loader``: the weight's columns of this rank; the bias whole."""
        if param.dim() == 1:
            copy_shard(param.data, loaded, 0, 0, 1)
        else:
            copy_shard(param.data, loaded, 1, self.tp.rank, self.tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., input_size / tp.size]`` (this rank's input columns) -> ``[..., output_size]``, summed over ranks."""
        # The bias is part of the sum: added by one rank only.
        bias = self.bias if self.tp.rank == 0 else None
        out = self._product(x, bias)
        return self.tp.all_reduce(out) if self.reduce_results else out
