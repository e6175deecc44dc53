"""A mixture-of-experts feed-forward block (Shazeer et al., 2017, arXiv:1701.06538; Mixtral's top-2 of 8,
Jiang et al., 2024, arXiv:2401.04088).

A router scores every expert for each token (``softmax`` over the experts, in
float32), the ``top_k`` best run the token, and their outputs are summed
weighted by those scores, renormalised over the chosen experts where the model
says so (``renormalize``: Mixtral, Qwen3-MoE; not Qwen2-MoE). The (token,
expert) pairs are grouped by expert with one sort, so each expert that has
tokens runs them as one batch (a ``GatedMLP``: its projections go through the
model's linear method, so oneDNN packing and the quantized kernels serve the
experts as they serve a dense MLP). Qwen2-MoE adds a shared expert that every
token runs, scaled by ``sigmoid`` of its own one-output gate.

Under tensor parallelism every expert is split like a dense MLP (its
intermediate features over the ranks); the experts' partial outputs are
summed locally and reduced over the ranks once per block. Every rank routes
the same tokens the same way: the router's weight is whole on each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.model.layers import GatedMLP
from pagedserve.engine.model.linear_methods import LinearMethodBase
from pagedserve.engine.model.parallel import TensorParallel


class ReplicatedWeight(nn.Module):
    """A small ``[out_features, in_features]`` weight held whole on every rank (a router), in the model's dtype."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in_features]`` -> ``[T, out_features]``."""
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Top-k routed experts, and optionally a gated shared expert, in place of a dense MLP.

    Checkpoint names (as transformers saves them): ``gate.weight`` (``[num_experts, hidden]``),
    ``experts.{e}.<gate>``, ``<up>`` and ``<down>`` (the model's stacked-params mapping fuses gate and up),
    ``shared_expert.*`` and ``shared_expert_gate.weight`` (``[1, hidden]``).

    Args:
        hidden_size: input and output features.
        intermediate_size: features of each expert, over all ranks.
        num_experts: experts to route between.
        top_k: experts per token.
        renormalize: divide the chosen experts' scores by their sum.
        linear_method, tp: as for ``GatedMLP``.
        shared_intermediate_size: the shared expert's features, or None for none.

    Raises:
        ValueError: when ``top_k`` is not in ``[1, num_experts]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool, *,
                 linear_method: LinearMethodBase, tp: TensorParallel,
                 shared_intermediate_size: int | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                             f"({num_experts})")
        self.top_k, self.renormalize, self.tp = top_k, renormalize, tp
        self.gate = ReplicatedWeight(num_experts, hidden_size)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, intermediate_size, False, linear_method=linear_method, tp=tp, reduce_results=False)
            for _ in range(num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, False, linear_method=linear_method,
                                          tp=tp, reduce_results=False)
            self.shared_expert_gate = ReplicatedWeight(1, hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts: ``([T, top_k]`` weights in ``x``'s dtype, ``[T, top_k]`` int64 ids)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``, summed over the ranks."""
        weights, ids = self.route(x)
        # The (token, choice) pairs sorted by expert: each expert's tokens are one run of ``order``.
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        tokens, pair_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = tokens[start:start + count]
                out.index_add_(0, rows, expert(x[rows]) * pair_weights[start:start + count, None])
                start += count
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
