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
``gate_up_proj``; Qwen3's ``q_norm``, ``k_norm`` -> ``qk_norm``.
``load_weights`` copies each checkpoint tensor into its slice.

Not implemented: sliding-window attention (Mistral v0.1, Qwen2 with
``use_sliding_window``); such models attend to their full context, which
equals the reference only for sequences within the window (a warning says so).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from engine.model.cpu_threads import all_threads
from engine.model.layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from engine.model.registry import CausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArchFlags:
    """What distinguishes one member of the family from another."""

    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj
    o_bias: bool = False    # bias on o_proj
    mlp_bias: bool = False  # biases on gate_proj, up_proj, down_proj
    qk_norm: bool = False   # RMSNorm over head_dim of each query and key head, before rotation


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Rotary grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: PretrainedConfig, flags: ArchFlags, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                               flags.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, flags.o_bias)
        self.qk_norm = (RMSNorm((self.num_heads + self.num_kv_heads, self.head_dim), config.rms_norm_eps)
                        if flags.qk_norm else None)
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
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        with all_threads():
            out = self.backend.forward(q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim), kv_cache,
                                       attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: PretrainedConfig, flags: ArchFlags, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, flags, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, flags.mlp_bias)

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
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` parameters)."""

    def __init__(self, config: PretrainedConfig, flags: ArchFlags, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, flags, backend)
                                    for _ in range(config.num_hidden_layers))
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
    ``engine.model.loader.load_model``); parameters start uninitialised until
    ``load_weights``.

    Args:
        config: the HF config.
        attn_backend: name of a registered attention backend (``engine.model.attention``).
    """

    def __init__(self, config: PretrainedConfig, attn_backend: str = "torch") -> None:
        super().__init__()
        flags = self.arch_flags(config)
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        window = getattr(config, "sliding_window", None)
        if window is not None and window < config.max_position_embeddings:
            logger.warning("sliding-window attention (window %d) is not implemented: sequences longer "
                           "than %d tokens attend to their full context", window, window)
        self.attn_backend = get_attention_backend(attn_backend)
        self.model = LlamaModel(config, flags, self.attn_backend)
        self.lm_head = (None if self.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, bias=False))
        qkv_rows = [n * self.head_dim for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        # checkpoint module name -> (fused module name, first row, end row) along dim 0
        self._shards: dict[str, tuple[str, int, int]] = {
            **_row_ranges("qkv_proj", ("q_proj", "k_proj", "v_proj"), qkv_rows),
            **_row_ranges("gate_up_proj", ("gate_proj", "up_proj"), [config.intermediate_size] * 2),
            **_row_ranges("qk_norm", ("q_norm", "k_norm"), [self.num_heads, self.num_kv_heads]),
        }

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

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """See ``CausalLM.compute_logits``."""
        if self.lm_head is None:
            return F.linear(hidden_states, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden_states).float()

    def pack_linear_weights(self) -> None:
        """See ``CausalLM.pack_linear_weights``; a tied head gets a packed copy of the embedding table."""
        if self.lm_head is None:
            embedding = self.model.embed_tokens.weight
            self.lm_head = Linear(embedding.shape[1], embedding.shape[0])
            self.lm_head.weight = embedding
        super().pack_linear_weights()

    def checkpoint_weight_names(self) -> list[str]:
        """See ``CausalLM.checkpoint_weight_names``."""
        parts: dict[str, list[str]] = {}
        for part, (fused, _, _) in self._shards.items():
            parts.setdefault(fused, []).append(part)
        names = []
        for name, _ in self.named_parameters():
            *path, module, suffix = name.split(".")
            names += [".".join([*path, part, suffix]) for part in parts.get(module, [module])]
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See ``CausalLM.load_weights``; tensors are cast to the parameters' dtype."""
        params = dict(self.named_parameters())
        expected = set(self.checkpoint_weight_names())
        loaded = set()
        for name, tensor in weights:
            if name not in expected and (name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")):
                continue  # a tied head saved anyway, or a buffer older checkpoints store
            if name not in expected:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
            *path, module, suffix = name.split(".")
            fused, start, end = self._shards.get(module, (module, None, None))
            target = params[".".join([*path, fused, suffix])].data[start:end]
            # Norm weights of single heads ([head_dim]) fill every row of their slice.
            if tensor.shape != target.shape[target.dim() - tensor.dim():]:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        if expected - loaded:
            raise ValueError(f"checkpoint lacks weights: {sorted(expected - loaded)}")


def _row_ranges(fused: str, parts: tuple[str, ...], rows: list[int]) -> dict[str, tuple[str, int, int]]:
    """Consecutive row ranges of ``parts`` inside the ``fused`` parameter."""
    ranges, start = {}, 0
    for part, n in zip(parts, rows, strict=True):
        ranges[part] = (fused, start, start + n)
        start += n
    return ranges


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


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm of queries and keys before rotation; optional attention biases."""

    @staticmethod
    def arch_flags(config: PretrainedConfig) -> ArchFlags:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
