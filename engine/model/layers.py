"""Building blocks of decoder-only transformers: norms, rotary embedding, MLP.

Linear layers are in ``pagedserve.engine.model.linear``, the embedding and LM head in
``pagedserve.engine.model.vocab_embedding``. Parameters are created with ``torch.empty``
(no random init): the loader fills every one from a checkpoint, and skipping
init keeps construction of a large model cheap. Modules follow the current
default device and dtype, so the loader builds them inside
``torch.device(...)`` and a default-dtype context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.engine.model import cpu_ops
from pagedserve.engine.model.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedserve.engine.model.linear_methods import LinearMethodBase
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.weights import (
    ShardId,
    check_shape,
    copy_shard,
    default_weight_loader,
    set_weight_loader,
)

# Rope types whose inverse frequencies depend on the current sequence length;
# a fixed cos/sin table cannot express them.
_SEQ_LEN_DEPENDENT_ROPE = ("dynamic",)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019, arXiv:1910.07467).

    Normalises over the last dimension. ``weight_shape`` may have more than one
    dimension so that several per-head norms with different weights run as one
    op (Qwen3's q/k norms share a single ``[num_heads + num_kv_heads, head_dim]``
    weight).

    The arithmetic mirrors transformers' ``LlamaRMSNorm`` operation for
    operation (statistics in float32, then cast back before the weight), so
    outputs match it bit for bit in float32. On the CPU, ``[T, width]`` inputs
    go to the fused kernel (``cpu_ops.rms_norm``): the same arithmetic in one
    call, its sum of squares accumulated in float64 (so float32 outputs may
    differ from torch's in the last bit).

    With ``unit_offset`` (Gemma) the checkpoint's weight ``w`` scales by
    ``1 + w``: the loader stores ``1 + w`` in float32, and the product is taken
    in float32 before the cast back, as transformers' ``GemmaRMSNorm`` does.
    """

    def __init__(self, weight_shape: int | tuple[int, ...], eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        dtype = torch.float32 if unit_offset else None
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        set_weight_loader(self.weight, self.weight_loader)

    def stored(self, loaded: torch.Tensor) -> torch.Tensor:
        """A checkpoint weight as the parameter holds it: ``1 + w`` in float32 with ``unit_offset``."""
        return loaded.float() + 1.0 if self.unit_offset else loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """``default_weight_loader`` of the checkpoint weight as the parameter holds it (``stored``)."""
        default_weight_loader(param, self.stored(loaded))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x``, or ``x + residual`` when a residual is given.

        Args:
            x: ``[..., *weight_shape]``.
            residual: same shape as ``x``, or None.

        Returns:
            The normalised tensor; with a residual, also the sum ``x + residual``
            (the next residual), as a tuple.
        """
        if x.dim() == 2 and self.weight.dim() == 1 and (fused := cpu_ops.rms_norm(x, self.weight, self.eps,
                                                                                    residual)) is not None:
            return fused
        if residual is not None:
            x = residual + x
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (x32 * self.weight).to(x.dtype) if self.unit_offset else self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


class QKNorm(RMSNorm):
    """The RMSNorm of each query and key head over ``head_dim`` (Qwen3, Gemma 3), as one op over this rank's
    heads.

    The weight is ``[num_heads + num_kv_heads, head_dim]``: the checkpoint's
    ``q_norm`` (one ``[head_dim]`` vector for all query heads) fills every
    query row, ``k_norm`` every key row (shard ids ``"q"`` and ``"k"``). Every
    head of a kind has the same weight, so any rank's rows are the same.

    Args:
        num_heads, num_kv_heads: query and key heads on this rank.
        head_dim: channels per head.
        eps: added to the mean square.
        unit_offset: scale by ``1 + w`` (Gemma; see ``RMSNorm``).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 unit_offset: bool = False) -> None:
        super().__init__((num_heads + num_kv_heads, head_dim), eps, unit_offset)
        self.num_heads = num_heads

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy a ``[head_dim]`` norm weight into every row of the query (``"q"``) or key (``"k"``) heads.

        Raises:
            ValueError: when ``loaded`` is not ``[head_dim]``.
        """
        rows = param.data[:self.num_heads] if shard_id == "q" else param.data[self.num_heads:]
        check_shape(loaded, rows.shape[1:])
        rows.copy_(self.stored(loaded))


class ProjectionQKNorm(nn.Module):
    """OLMoE's RMSNorm of the whole query and the whole key projection (over all heads, not each head), on this
    rank's heads: the mean square sums every rank's share (one all-reduce each), and a KV head held by several
    ranks counts once. The arithmetic is ``LlamaRMSNorm``'s (float32 statistics, cast back before the weight).

    The weight is this rank's slice of the checkpoint's ``q_norm`` (``[num_heads * head_dim]`` over all ranks)
    then of its ``k_norm`` (shard ids ``"q"``, ``"k"``).

    Args:
        num_heads, num_kv_heads: query and key heads on this rank.
        head_dim: channels per head.
        total_num_heads, total_num_kv_heads: heads over all ranks.
        kv_head_replicas: ranks holding each KV head (``QKVParallelLinear``).
        eps: added to the mean square.
        tp: the tensor-parallel group.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, kv_head_replicas: int, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.eps, self.tp, self.kv_head_replicas = num_heads, eps, tp, kv_head_replicas
        self.widths = (total_num_heads * head_dim, total_num_kv_heads * head_dim)
        self.weight = nn.Parameter(torch.empty(num_heads + num_kv_heads, head_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """This rank's heads of the ``q_norm`` (``"q"``) or ``k_norm`` (``"k"``) weight into their rows."""
        if shard_id == "q":
            copy_shard(param.data[:self.num_heads].view(-1), loaded, 0, self.tp.rank, self.tp.size)
        else:
            replicas = self.kv_head_replicas
            copy_shard(param.data[self.num_heads:].view(-1), loaded, 0, self.tp.rank // replicas,
                       self.tp.size // replicas)

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        """``[T, num_heads + num_kv_heads, head_dim]`` -> the same, queries and keys each normalised whole."""
        parts = []
        for part, weight, width, replicas in ((qk[:, :self.num_heads], self.weight[:self.num_heads], self.widths[0], 1),
                                              (qk[:, self.num_heads:], self.weight[self.num_heads:], self.widths[1],
                                               self.kv_head_replicas)):
            x32 = part.float()
            sum_sq = self.tp.all_reduce(x32.pow(2).sum(dim=(-2, -1), keepdim=True)) / replicas
            parts.append(weight * (x32 * torch.rsqrt(sum_sq / width + self.eps)).to(qk.dtype))
        return torch.cat(parts, dim=1)


def rope_inv_freq(config: PretrainedConfig, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse rotary frequencies and cos/sin scale of a model, as transformers computes them.

    Uses ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for scaled
    variants (linear, llama3, yarn, ...) so scaling rules live in one place.
    ``layer_type`` picks the rope of one kind of layer where the config's
    ``rope_parameters`` has one per kind (Gemma 3: ``"sliding_attention"``,
    ``"full_attention"``).

    Partial rotary embeddings (``partial_rotary_factor``, Phi-4-mini) rotate the
    first ``head_dim * factor`` channels of each head. ``longrope`` gives the
    frequencies of its short factors, transformers' within
    ``original_max_position_embeddings`` (``config.max_model_len_for`` serves no longer).

    Returns:
        ``inv_freq`` ``[rotary_dim // 2]`` float32, and the attention scaling factor
        applied to cos and sin.
    Raises:
        ValueError: for rope types whose frequencies change with the sequence
            length (``dynamic``).
    """
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type in _SEQ_LEN_DEPENDENT_ROPE:
        raise ValueError(f"rope_type {rope_type!r} is not supported (frequencies depend on sequence length)")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        # Su et al., 2021 (RoFormer, arXiv:2104.09864): theta_i = base^(-2i/d).
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known: {['default', *ROPE_INIT_FUNCTIONS]}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer, arXiv:2104.09864), "rotate half" layout.

    cos and sin are tabulated once for every position up to
    ``max_position_embeddings``; a step looks its positions up once and every
    layer reuses the result (``apply_rotary``). The table is computed exactly as
    transformers computes cos/sin on the fly (float32 product of position and
    inverse frequency, scaled, then cast), so rotations match it.
    ``layer_type``: as in ``rope_inv_freq``.
    """

    def __init__(self, config: PretrainedConfig, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, layer_type)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
        self.register_buffer("cos_sin", table.to(torch.get_default_device(), torch.get_default_dtype()),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` (``[T]`` int64), each ``[T, 1, head_dim // 2]``."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, num_heads, head_dim]``) by ``RotaryEmbedding`` cos/sin; with a partial rotary
    embedding (cos narrower than ``head_dim // 2``) its first ``2 * cos.shape[-1]`` channels, the rest as is.

    Queries and keys may be stacked on the head axis to rotate both in one op.
    On the CPU ``x`` is rotated in place and returned (``cpu_ops.rotary_``);
    elsewhere the result is a new tensor, so callers must not reuse ``x``.
    """
    if (rotated := cpu_ops.rotary_(x, cos, sin)) is not None:
        return rotated
    if (rotary_dim := 2 * cos.shape[-1]) != x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class GatedMLP(nn.Module):
    """Gated feed-forward block (Shazeer, 2020, arXiv:2002.05202): ``down(act(gate(x)) * up(x))``, SwiGLU with
    ``act`` SiLU (Llama), GeGLU with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``).

    ``gate_proj`` and ``up_proj`` are stored as one ``gate_up_proj`` weight
    (shards 0 and 1) so both run as a single matmul. Under tensor parallelism
    each rank holds a slice of the intermediate features: gate/up split by
    rows, down by columns, one all-reduce at the end.

    Args:
        hidden_size: input and output features.
        intermediate_size: features of gate and up, over all ranks.
        bias: whether the three projections have biases.
        linear_method: creates and multiplies the weights.
        tp: the tensor-parallel group.
        activation: ``"silu"`` or ``"gelu_pytorch_tanh"`` (transformers' names).
        reduce_results: as ``RowParallelLinear``'s, for ``down_proj``.

    Raises:
        ValueError: for another activation.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, *, linear_method: LinearMethodBase,
                 tp: TensorParallel, activation: str = "silu", reduce_results: bool = True) -> None:
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden activation {activation!r}; supported: silu, gelu_pytorch_tanh")
        self.activation = activation
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias,
                                                       linear_method=linear_method, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, linear_method=linear_method, tp=tp,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        gate_up = self.gate_up_proj(x)
        if self.activation == "gelu_pytorch_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.gelu(gate, approximate="tanh") * up
        elif (activated := cpu_ops.silu_and_mul(gate_up)) is None:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.silu(gate) * up
        return self.down_proj(activated)
