"""Gemma 2 and Gemma 3 (text): Gemma Team, 2024, arXiv:2408.00118, and 2025, arXiv:2503.19786.

The Llama decoder with Gemma's changes, each mirrored from transformers'
``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` operation for operation:

* every RMSNorm scales by ``1 + w`` in float32 (``RMSNorm(unit_offset=True)``),
  and each block has four: before and after attention, before and after the MLP;
  the residual is added after the post-norms;
* the softmax scale is ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
  Gemma 3 RMS-norms queries and keys per head (as Qwen3); Gemma 2 soft-caps the attention
  scores (``attn_logit_softcapping``: ``cap * tanh(s / cap)``, in the attention backend);
* the MLP is GeGLU (``gelu_pytorch_tanh``);
* token embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the
  model's dtype first;
* local layers (``layer_types``: every other one in Gemma 2, five of every six in Gemma 3)
  attend within a sliding window; Gemma 3's rotate by their own rope
  (``rope_parameters["sliding_attention"]``, base 10,000) and its global layers by
  ``rope_parameters["full_attention"]`` (base 1,000,000, linear scaling on the larger models);
* the head is tied to the embedding (unless the config says otherwise); logits may be soft-capped
  (``final_logit_softcapping``: ``cap * tanh(logits / cap)``).

The KV cache keeps every block of a local layer: its global layers read them all (see ``llama.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.engine.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from pagedserve.engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pagedserve.engine.model.linear_methods import LinearMethodBase
from pagedserve.engine.model.llama import ArchFlags, LlamaAttention, LlamaForCausalLM
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.registry import CausalLM
from pagedserve.engine.model.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.engine.model.weights import StackedParamsMapping, checkpoint_weight_names, load_weights
from pagedserve.engine.model.windows import layer_windows


class GemmaDecoderLayer(nn.Module):
    """``h = x + post_attn_norm(attn(input_norm(x)))``, then ``h + post_ff_norm(mlp(pre_ff_norm(h)))``."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, *, linear_method: LinearMethodBase,
                 tp: TensorParallel, sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        attention_bias = bool(getattr(config, "attention_bias", False))
        flags = ArchFlags(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=qk_norm, norm_unit_offset=True)
        self.self_attn = LlamaAttention(config, flags, backend, linear_method=linear_method, tp=tp,
                                        sliding_window=sliding_window, scale=config.query_pre_attn_scalar ** -0.5)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, linear_method=linear_method, tp=tp,
                            activation=config.hidden_activation)
        norm = [RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True) for _ in range(4)]
        self.input_layernorm, self.post_attention_layernorm = norm[:2]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm[2:]

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``, with this layer's rope (``cos``, ``sin``)."""
        attended = self.self_attn(self.input_layernorm(hidden_states), cos, sin, kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mixed)


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers and final norm (HF's ``model.*`` parameters)."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, *, linear_method: LinearMethodBase,
                 tp: TensorParallel, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        # transformers rounds the scale to the model's dtype before multiplying.
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(torch.get_default_dtype()).item()
        self.layer_types = list(config.layer_types)
        # A rope per kind of layer where the config has one per kind (Gemma 3), else one for all (Gemma 2).
        per_kind = all(kind in config.rope_parameters for kind in self.layer_types)
        self.rotary_embs = nn.ModuleDict({kind: RotaryEmbedding(config, kind if per_kind else None)
                                          for kind in set(self.layer_types)})
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, backend, linear_method=linear_method, tp=tp, sliding_window=window,
                              qk_norm=qk_norm)
            for window in layer_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """See ``CausalLM.forward``."""
        rope = {kind: rotary(positions) for kind, rotary in self.rotary_embs.items()}
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches, strict=True):
            hidden_states = layer(hidden_states, *rope[kind], kv_cache, attn_metadata)
        return self.norm(hidden_states)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model on the paged KV cache; built and loaded as ``LlamaForCausalLM`` is."""

    #: Queries and keys RMS-normed per head.
    qk_norm = True

    #: The same fused modules as the Llama family's (Qwen3's q/k norms included).
    stacked_params_mapping: StackedParamsMapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: PretrainedConfig, *, attn_backend: str, block_size: int,
                 linear_method: LinearMethodBase, tp: TensorParallel) -> None:
        super().__init__()
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.attn_backend = get_attention_backend(attn_backend, block_size,
                                                  getattr(config, "attn_logit_softcapping", None))
        self.model = GemmaModel(config, self.attn_backend, linear_method=linear_method, tp=tp, qk_norm=self.qk_norm)
        attention = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim
        # Gemma ties its head to the embedding (transformers' default); a tied head is loaded once, as the embedding.
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, linear_method=linear_method, tp=tp,
                                      tied_to=self.model.embed_tokens if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """See ``CausalLM.forward``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """See ``CausalLM.compute_logits``; soft-capped in the head's dtype, as transformers does, then float32."""
        logits = self.lm_head(hidden_states)
        if (cap := self.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def checkpoint_weight_names(self) -> list[str]:
        """See ``CausalLM.checkpoint_weight_names``."""
        return checkpoint_weight_names(self, self.stacked_params_mapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See ``CausalLM.load_weights``; a tied head saved anyway (``lm_head.weight``) is skipped."""
        load_weights(self, weights, self.stacked_params_mapping,
                     ignored=lambda name: self.tie_word_embeddings and name == "lm_head.weight")


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's decoder without the per-head q/k norms, with one rope and soft-capped attention scores."""

    qk_norm = False
