"""The Llama family: Llama 1-3 (incl. llama3 rope scaling), Mistral, Qwen2 and Qwen3.

They share one decoder (Touvron et al., 2023, arXiv:2302.13971): pre-norm
RMSNorm blocks, rotary attention with grouped-query heads (Ainslie et al.,
2023, arXiv:2305.13245) and a SwiGLU MLP. The variants differ only in
``ArchFlags``: biases on the q/k/v projections (Qwen2), per-head RMSNorm of
queries and keys before rotation (Qwen3), plus config values (tied embeddings,
head counts, rope scaling).

Parameter names follow the HF checkpoints, except that projections consumed
together are stored fused so that each runs as one matmul: ``q_proj``,
``k_proj``, ``v_proj`` -> ``qkv_proj``; ``gate_proj``, ``up_proj`` ->
``gate_up_proj``; Qwen3's ``q_norm``, ``k_norm`` -> ``qk_norm``
(``stacked_params_mapping``). Layers are tensor-parallel as in vLLM's
``llama.py`` (``pagedserve.engine.model.linear``); each parameter's weight loader copies
its rank's slice of a checkpoint tensor into its place.

Sliding-window attention (Mistral v0.1; Qwen2 and Qwen3 with
``use_sliding_window``, on the layers from ``max_window_layers`` on) is each
layer's ``sliding_window`` (``windows.layer_windows``), honoured by every attention
backend. When every layer shares the window, the KV cache gives back the blocks
wholly before it (``KVCacheManager``); a model mixing windowed and full layers keeps
them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.engine.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from pagedserve.engine.model.fused_decode import FusedDecoder
from pagedserve.engine.model.layers import (
    GatedMLP,
    ProjectionQKNorm,
    QKNorm,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from pagedserve.engine.model.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.engine.model.linear_methods import LinearMethodBase, release_plain_weights
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.registry import CausalLM
from pagedserve.engine.model.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.engine.model.weights import StackedParamsMapping, checkpoint_weight_names, load_weights
from pagedserve.engine.model.windows import layer_windows


@dataclass(frozen=True)
class ArchFlags:
    """What distinguishes one member of the family from another."""

    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj
    o_bias: bool = False    # bias on o_proj
    mlp_bias: bool = False  # biases on gate_proj, up_proj, down_proj
    qk_norm: bool = False   # RMSNorm over head_dim of each query and key head, before rotation
    projection_qk_norm: bool = False  # RMSNorm over the whole query and key projections (OLMoE)
    clip_qkv: float | None = None     # queries, keys and values clamped to [-clip, clip] (OLMo)
    norm_unit_offset: bool = False  # norms scale by 1 + w (Gemma; RMSNorm's unit_offset)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Rotary grouped-query self-attention over the paged KV cache, on this rank's heads.

    Attributes:
        num_heads, num_kv_heads: query and KV heads on this rank (see ``QKVParallelLinear``).
        sliding_window: keys each query sees, its own included; None: all before it.
        scale: the softmax scale, ``head_dim ** -0.5`` unless the model says otherwise.
    """

    def __init__(self, config: PretrainedConfig, flags: ArchFlags, backend: AttentionBackend, *,
                 linear_method: LinearMethodBase, tp: TensorParallel, sliding_window: int | None = None,
                 scale: float | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, flags.qkv_bias, linear_method=linear_method,
                                          tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        flags.o_bias, linear_method=linear_method, tp=tp)
        self.qk_norm: nn.Module | None = None
        if flags.qk_norm:
            self.qk_norm = QKNorm(self.num_heads, self.num_kv_heads, self.head_dim, config.rms_norm_eps,
                                  flags.norm_unit_offset)
        elif flags.projection_qk_norm:
            self.qk_norm = ProjectionQKNorm(self.num_heads, self.num_kv_heads, self.head_dim,
                                            config.num_attention_heads, config.num_key_value_heads,
                                            self.qkv_proj.num_kv_head_replicas, config.rms_norm_eps, tp)
        self.clip_qkv = flags.clip_qkv
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``; writes this step's K/V into ``kv_cache``."""
        num_tokens = hidden_states.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        qk, v = self.qkv_proj(hidden_states).split(
            [qk_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        # Queries and keys are normalised and rotated together: one op each instead of two.
        qk = qk.view(num_tokens, qk_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        if self.clip_qkv is not None:
            qk, v = qk.clamp(-self.clip_qkv, self.clip_qkv), v.clamp(-self.clip_qkv, self.clip_qkv)
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.backend.forward(q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim), kv_cache,
                                   attn_metadata, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


#: A layer's feed-forward block: (its name in the checkpoint, the module).
MLPBlock = tuple[str, nn.Module]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    The feed-forward block (a ``GatedMLP``, or a mixture of experts) is registered under the name the checkpoint
    gives it, ``mlp_name``: ``"mlp"`` (Mixtral's: ``"block_sparse_moe"``).
    """

    def __init__(self, config: PretrainedConfig, flags: ArchFlags, backend: AttentionBackend, mlp: MLPBlock, *,
                 linear_method: LinearMethodBase, tp: TensorParallel, sliding_window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, flags, backend, linear_method=linear_method, tp=tp,
                                        sliding_window=sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_name = mlp[0]
        self.add_module(*mlp)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output and the residual stream, both ``[T, hidden_size]``.

        The residual addition is deferred into the next norm (``RMSNorm(x, residual)``),
        which saves a pass over the activations per block.
        """
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return getattr(self, self.mlp_name)(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` parameters); ``mlp_blocks`` holds each
    layer's feed-forward block, in layer order."""

    def __init__(self, config: PretrainedConfig, flags: ArchFlags, backend: AttentionBackend,
                 mlp_blocks: list[MLPBlock], *, linear_method: LinearMethodBase, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, flags, backend, mlp, linear_method=linear_method,
                                                      tp=tp, sliding_window=window)
                                    for window, mlp in zip(layer_windows(config), mlp_blocks, strict=True))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """See ``CausalLM.forward``."""
        cos, sin = self.rotary_emb(positions)
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(hidden_states, residual, cos, sin, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CausalLM):
    """A Llama-family model on the paged KV cache.

    Build it under ``torch.device(...)`` and the wanted default dtype (see
    ``pagedserve.engine.model.loader.load_model``); parameters start uninitialised until
    ``load_weights``, after which the loader lets each layer's linear method
    process its weights.

    Args:
        config: the HF config.
        attn_backend: name of a registered attention backend (``pagedserve.engine.model.attention``).
        block_size: tokens per KV cache block, for the attention backend.
        linear_method: how every linear layer stores and multiplies its weight.
        tp: the tensor-parallel group; ``num_heads`` and ``num_kv_heads`` are this rank's.
    """

    #: checkpoint modules stored fused: (fused module, checkpoint module, shard id).
    stacked_params_mapping: StackedParamsMapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
        ("qk_norm", "q_norm", "q"),
        ("qk_norm", "k_norm", "k"),
    ]

    def __init__(self, config: PretrainedConfig, *, attn_backend: str, block_size: int,
                 linear_method: LinearMethodBase, tp: TensorParallel) -> None:
        super().__init__()
        flags = self.arch_flags(config)
        self.num_layers = config.num_hidden_layers
        self.head_dim = _head_dim(config)
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.attn_backend = get_attention_backend(attn_backend, block_size)
        mlp_blocks = [self.mlp_block(config, flags, i, linear_method=linear_method, tp=tp)
                      for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, flags, self.attn_backend, mlp_blocks, linear_method=linear_method, tp=tp)
        attention = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        # A tied head shares the embedding's parameter, so it is loaded once, under the embedding's name.
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, linear_method=linear_method, tp=tp,
                                      tied_to=self.model.embed_tokens if self.tie_word_embeddings else None)
        self._fused_decoder: FusedDecoder | None = None  # built by after_loading where it applies

    @staticmethod
    def mlp_block(config: PretrainedConfig, flags: ArchFlags, layer_index: int, *, linear_method: LinearMethodBase,
                  tp: TensorParallel) -> MLPBlock:
        """Layer ``layer_index``'s feed-forward block: a dense ``GatedMLP`` named ``mlp`` (the mixtures of
        experts override this)."""
        return "mlp", GatedMLP(config.hidden_size, config.intermediate_size, flags.mlp_bias,
                               linear_method=linear_method, tp=tp)

    @staticmethod
    def arch_flags(config: PretrainedConfig) -> ArchFlags:
        """Llama: optional biases everywhere, per ``attention_bias`` and ``mlp_bias``."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(qkv_bias=attention_bias, o_bias=attention_bias,
                         mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """See ``CausalLM.forward``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def after_loading(self) -> None:
        """See ``CausalLM.after_loading``: builds the fused CPU decode where it applies; the plain weight copies
        it would read are dropped where it does not."""
        self._fused_decoder = FusedDecoder.build(self)
        dense = self._fused_decoder is not None and not self._fused_decoder.quantized
        release_plain_weights(self.lm_head if dense else self)

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                       attn_metadata: AttentionMetadata) -> torch.Tensor | None:
        """See ``CausalLM.decode_forward``: every layer in one native call on the CPU (``fused_decode``)."""
        if self._fused_decoder is None:
            return None
        return self._fused_decoder(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """See ``CausalLM.compute_logits``."""
        return self.lm_head(hidden_states).float()

    def checkpoint_weight_names(self) -> list[str]:
        """See ``CausalLM.checkpoint_weight_names``."""
        return checkpoint_weight_names(self, self.stacked_params_mapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See ``CausalLM.load_weights``; tensors are cast to the parameters' dtype.

        A tied head saved anyway (``lm_head.weight``) and the inverse rotary
        frequencies older checkpoints store (``rotary_emb.inv_freq``) are skipped.
        """
        load_weights(self, weights, self.stacked_params_mapping,
                     ignored=lambda name: name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama without biases."""

    @staticmethod
    def arch_flags(config: PretrainedConfig) -> ArchFlags:
        return ArchFlags()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on the q/k/v projections only."""

    @staticmethod
    def arch_flags(config: PretrainedConfig) -> ArchFlags:
        return ArchFlags(qkv_bias=True)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4-mini: Llama's decoder whose checkpoints store ``qkv_proj`` and ``gate_up_proj`` fused as
    we do (no stacked-params mapping), with a partial rotary embedding (Phi-4-mini) and ``longrope`` served
    within ``original_max_position_embeddings`` (``config.max_model_len_for``)."""

    stacked_params_mapping: StackedParamsMapping = []

    @staticmethod
    def arch_flags(config: PretrainedConfig) -> ArchFlags:
        return ArchFlags()


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm of queries and keys before rotation; optional attention biases."""

    @staticmethod
    def arch_flags(config: PretrainedConfig) -> ArchFlags:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
