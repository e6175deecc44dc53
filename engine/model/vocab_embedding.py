"""The token embedding and the LM head, with the vocabulary split across tensor-parallel ranks.

As in vLLM (``vllm/model_executor/layers/vocab_parallel_embedding.py``): rank r
holds ``ceil(vocab / size)`` consecutive rows of the table, the last rank's
padded with zeros. The embedding looks up the ids in its range, zeroes the
other rows and sums over the group; the head computes the logits of its rows
and gathers them. A tied head shares the embedding's parameter.

With ``--quantization gguf`` the table keeps its GGUF blocks (``stage_blocks``,
then ``process_weights_after_loading``): lookups dequantize the rows they read
(``quant_kernels.embedding_rows``) and a tied head multiplies by the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.model.linear_methods import LinearMethodBase
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.quant_kernels import QuantizedWeight, embedding_rows
from pagedserve.engine.model.quantization import staged_shape, unstage_once
from pagedserve.engine.model.weights import ShardId, check_shape, set_weight_loader


@dataclass(frozen=True)
class VocabShard:
    """The rows of a vocabulary one rank holds.

    Attributes:
        num_embeddings: vocabulary size over all ranks.
        rows: rows every rank stores, ``ceil(num_embeddings / size)``.
        start, end: the vocabulary ids ``[start, end)`` this rank holds, in its first ``end - start`` rows.
    """

    num_embeddings: int
    rows: int
    start: int
    end: int

    @classmethod
    def of(cls, num_embeddings: int, tp: TensorParallel) -> VocabShard:
        """Rank ``tp.rank``'s share of ``num_embeddings`` ids."""
        rows = -(-num_embeddings // tp.size)
        start = min(num_embeddings, tp.rank * rows)
        return cls(num_embeddings, rows, start, min(num_embeddings, start + rows))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Rows ``[start, end)`` of ``loaded`` (``[num_embeddings, dim]``) into ``param``, padding rows zeroed.

        Raises:
            ValueError: when ``loaded`` is not ``[num_embeddings, dim]``.
        """
        check_shape(loaded, (self.num_embeddings, *param.shape[1:]))
        held = self.end - self.start
        param.data[:held].copy_(loaded[self.start:self.end])
        param.data[held:].zero_()


class VocabParallelEmbedding(nn.Module):
    """Token embedding table, this rank's rows ``[shard.rows, embedding_dim]``, uninitialised.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size.
        tp: the tensor-parallel group.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.shard = tp, VocabShard.of(num_embeddings, tp)
        weight = nn.Parameter(torch.empty(self.shard.rows, embedding_dim), requires_grad=False)
        self.weight = set_weight_loader(weight, self.shard.weight_loader)
        self.dtype = weight.dtype
        #: The table's blocks, after ``process_weights_after_loading`` of a staged table; else None.
        self.qweight: QuantizedWeight | None = None

    def stage_blocks(self, staging_dtype: torch.dtype) -> None:
        """Make the (not yet loaded) table take staged GGUF blocks, ``[rows, embedding_dim / 32, 34]``
        (``pagedserve.engine.model.quantization``). The parameter stays the same object, so a tied head follows.

        Raises:
            ValueError: when ``embedding_dim`` is not a multiple of 32.
        """
        self.weight.data = torch.empty(staged_shape(*self.weight.shape), dtype=staging_dtype,
                                       device=self.weight.device)

    def process_weights_after_loading(self) -> None:
        """A staged table -> ``qweight`` when its blocks are of one kind, else a float table (no-op unstaged)."""
        if self.weight is None or self.weight.dim() != 3:
            return
        unstaged = unstage_once(self.weight, self.dtype)
        if isinstance(unstaged, torch.Tensor):
            self.weight = nn.Parameter(unstaged, requires_grad=False)
        else:
            self.qweight, self.weight = unstaged.to(self.weight.device), None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 ids -> ``[T, embedding_dim]``."""
        if self.tp.size == 1:
            return self._rows(input_ids)
        # Ids of other ranks look up row 0 and are zeroed; the sum over ranks fills them in.
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.end - self.shard.start)
        embeddings = self._rows(local.masked_fill(outside, 0))
        return self.tp.all_reduce(embeddings.masked_fill_(outside[:, None], 0))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return embedding_rows(self.qweight, ids, self.dtype)
        return F.embedding(ids, self.weight)


class ParallelLMHead(nn.Module):
    """Output projection ``[T, hidden] -> [T, vocab]`` logits, with this rank's vocabulary rows.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size.
        linear_method: creates and multiplies the weight.
        tp: the tensor-parallel group.
        tied_to: the embedding whose weight the head shares (tied embeddings), or
            None for a weight of its own. ``linear_method`` still processes the
            shared weight after loading; a method that rewrites it (oneDNN
            packing) keeps its copy on the head and leaves the embedding's alone.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, linear_method: LinearMethodBase,
                 tp: TensorParallel, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp, self.shard, self.linear_method = tp, VocabShard.of(num_embeddings, tp), linear_method
        if tied_to is None:
            linear_method.create_weights(self, embedding_dim, [self.shard.rows], self.shard.weight_loader)
        else:
            self.weight = tied_to.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, embedding_dim]`` -> ``[N, num_embeddings]`` logits, in the weight's dtype."""
        logits = self.linear_method.apply(self, hidden_states, None)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[..., :self.shard.num_embeddings]
        return logits
