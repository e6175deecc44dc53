"""Building blocks of decoder-only transformers: linear, norm, rotary, MLP.

Parameters are created with ``torch.empty`` (no random init): the loader
fills every one from a checkpoint, and skipping init keeps construction of a
large model cheap. Modules follow the current default device and dtype, so the
loader builds them inside ``torch.device(...)`` and a default-dtype context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model.cpu_threads import all_threads

# Rope types whose inverse frequencies depend on the current sequence length;
# a fixed cos/sin table cannot express them.
_SEQ_LEN_DEPENDENT_ROPE = ("dynamic", "longrope")


def can_pack_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``Linear.pack`` works here: oneDNN on the CPU, in float32 or (with CPU support) bfloat16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with uninitialised parameters.

    Args:
        in_features: input width.
        out_features: output width.
        bias: whether a bias is added.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None

    def pack(self) -> None:
        """Replace the weight by a copy reordered once into oneDNN's blocked layout (CPU only).

        ``F.linear`` hands a plain row-major weight to the GEMM, which then
        re-blocks it on every call; with few token rows that repacking, not
        the arithmetic, sets the speed. Measured on the 2-core test machine
        over SmolLM2-135M's GEMMs: 1.4-1.6x faster in bf16 at 1-16 rows and
        1.25x at 64, 1.7-2.4x in fp32. ``torch.compile``'s CPU backend
        packs bf16 weights the same way (inductor's ``mkldnn_fusion`` pass).
        In bf16 the results are bit-identical to ``F.linear``; in fp32 the
        summation order differs (relative error about 1e-6). Call after the
        weights are loaded: the plain weight is dropped, for good (the module
        no longer lists it in ``parameters()`` or ``state_dict()``).
        """
        if self.packed_weight is not None:
            return
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]``."""
        with all_threads():
            if self.packed_weight is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
            return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table ``[num_embeddings, embedding_dim]``, uninitialised."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 ids -> ``[T, embedding_dim]``."""
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019, arXiv:1910.07467).

    Normalises over the last dimension. ``weight_shape`` may have more than one
    dimension so that several per-head norms with different weights run as one
    op (Qwen3's q/k norms share a single ``[num_heads + num_kv_heads, head_dim]``
    weight).

    The arithmetic mirrors transformers' ``LlamaRMSNorm`` operation for
    operation (statistics in float32, then cast back before the weight), so
    outputs match it bit for bit in float32.
    """

    def __init__(self, weight_shape: int | tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(weight_shape), requires_grad=False)
        self.eps = eps

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
        if residual is not None:
            x = residual + x
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


def rope_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """Inverse rotary frequencies and cos/sin scale of a model, as transformers computes them.

    Uses ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for scaled
    variants (linear, llama3, yarn, ...) so scaling rules live in one place.

    Returns:
        ``inv_freq`` ``[head_dim // 2]`` float32, and the attention scaling factor
        applied to cos and sin.
    Raises:
        ValueError: for rope types whose frequencies change with the sequence
            length (``dynamic``, ``longrope``) and for partial rotary embeddings.
    """
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type in _SEQ_LEN_DEPENDENT_ROPE:
        raise ValueError(f"rope_type {rope_type!r} is not supported (frequencies depend on sequence length)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Su et al., 2021 (RoFormer, arXiv:2104.09864): theta_i = base^(-2i/d).
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known: {['default', *ROPE_INIT_FUNCTIONS]}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer, arXiv:2104.09864), "rotate half" layout.

    cos and sin are tabulated once for every position up to
    ``max_position_embeddings``; a step looks its positions up once and every
    layer reuses the result (``apply_rotary``). The table is computed exactly as
    transformers computes cos/sin on the fly (float32 product of position and
    inverse frequency, scaled, then cast), so rotations match it.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config)
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
    """Rotate ``x`` (``[T, num_heads, head_dim]``) by ``RotaryEmbedding`` cos/sin; returns a new tensor.

    Queries and keys may be stacked on the head axis to rotate both in one op.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block (Shazeer, 2020, arXiv:2002.05202): ``down(silu(gate(x)) * up(x))``.

    ``gate_proj`` and ``up_proj`` are stored as one ``gate_up_proj`` weight
    ``[2 * intermediate_size, hidden_size]`` so both run as a single matmul.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
