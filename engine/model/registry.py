"""Model architectures by name, and the interface every model implements.

An architecture is found by the first entry of the HF config's
``architectures`` list (or, for configs read from GGUF files, which have none,
by its ``model_type``). Modules are imported lazily so that listing the
supported architectures costs nothing. Adding an architecture = one module
with a ``CausalLM`` subclass + one line in ``_ARCHITECTURES``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pagedserve.engine.model.attention import AttentionBackend, AttentionMetadata
from pagedserve.engine.model.linear_methods import release_plain_weights

# architecture name -> "module:class"
_ARCHITECTURES: dict[str, str] = {
    "Gemma2ForCausalLM": "pagedserve.engine.model.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pagedserve.engine.model.gemma:Gemma3ForCausalLM",
    "LlamaForCausalLM": "pagedserve.engine.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedserve.engine.model.llama:MistralForCausalLM",
    "MixtralForCausalLM": "pagedserve.engine.model.llama_moe:MixtralForCausalLM",
    "OlmoeForCausalLM": "pagedserve.engine.model.llama_moe:OlmoeForCausalLM",
    "Phi3ForCausalLM": "pagedserve.engine.model.llama:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "pagedserve.engine.model.llama:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "pagedserve.engine.model.llama_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "pagedserve.engine.model.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "pagedserve.engine.model.llama_moe:Qwen3MoeForCausalLM",
}


class CausalLM(nn.Module, ABC):
    """A decoder-only language model running on the paged KV cache.

    Constructed as ``cls(hf_config, attn_backend=name, block_size=..., linear_method=..., tp=...)``
    (see ``pagedserve.engine.model.loader.load_model``).

    Attributes (read by the model runner to allocate the KV cache and logits):
        num_layers: decoder layers, i.e. KV cache tensors.
        num_kv_heads: key/value heads per layer on this tensor-parallel rank.
        head_dim: channels per head.
        vocab_size: rows of the logits.
        attn_backend: the attention backend every layer runs; the runner builds
            each step's metadata with its ``build_metadata``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    attn_backend: AttentionBackend
    #: Whether a CUDA graph can replay a decode step: no shapes that depend on the values (a mixture of experts'
    #: routing does).
    supports_cuda_graphs: bool = True

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Run every scheduled token of a step through the decoder.

        Args:
            input_ids: ``[T]`` int64, the flattened batch (requests back to back, no padding between).
            positions: ``[T]`` int64 absolute position of each token in its request.
            kv_caches: one tensor per layer, each ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
                this step's keys and values are written into them.
            attn_metadata: the step's layout (``slot_mapping``, block table, ...), as
                ``attn_backend.build_metadata`` returns it; handed to every layer's backend.

        Returns:
            ``[T, hidden_size]`` final hidden states (after the last norm).
        """

    def after_loading(self) -> None:
        """Called once by the loader after every layer processed its loaded weights. By default it drops the
        plain weight copies a layer may keep for a fused decode path (``release_plain_weights``): a model
        whose path reads them overrides this."""
        release_plain_weights(self)

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                       attn_metadata: AttentionMetadata) -> torch.Tensor | None:
        """``forward`` for a decode-only step (one token per request) by a faster path, or None (nothing done)
        where the model has none for this step; the runner then calls ``forward``.

        ``attn_metadata`` is the runner's common ``AttentionMetadata``, not the backend's.
        """
        return None

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` hidden states -> ``[N, vocab_size]`` float32 logits."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors, named as in the HF checkpoint, into the parameters.

        Raises:
            ValueError: on a name the model does not know, or when parameters are left unloaded.
        """

    @abstractmethod
    def checkpoint_weight_names(self) -> list[str]:
        """HF checkpoint names ``load_weights`` expects, e.g. ``model.layers.0.self_attn.q_proj.weight``."""


def supported_architectures() -> list[str]:
    """Names of the architectures ``model_class`` accepts."""
    return sorted(_ARCHITECTURES)


def architecture_name(hf_config: PretrainedConfig) -> str:
    """The architecture a config describes: ``architectures[0]``, else derived from ``model_type``."""
    if hf_config.architectures:
        return hf_config.architectures[0]
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type, hf_config.model_type)


def model_class(hf_config: PretrainedConfig) -> type[CausalLM]:
    """The ``CausalLM`` subclass implementing a config's architecture.

    Raises:
        ValueError: when the architecture is not supported; the message lists those that are.
    """
    name = architecture_name(hf_config)
    if name not in _ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {name!r}; supported: {supported_architectures()}")
    module_name, class_name = _ARCHITECTURES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
