"""Tiny random-weight checkpoints of each supported architecture, built in code: for the benchmarks that need a
model of a family without its size (the GPU check's parity and tensor-parallel sections) and for the tests.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

# The architectures built: model_type -> extra config values.
TINY_ARCHITECTURES: dict[str, dict] = {
    # Gemma 2's shape in small: alternating local (window 8) and global layers, soft-capped scores and logits.
    "gemma2": {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0},
    # Gemma 3's shape in small: local layers (window 8) with one global layer, query_pre_attn_scalar unlike
    # head_dim (16), linear rope scaling on the global layer, soft-capped logits.
    "gemma3_text": {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0}},
                    "final_logit_softcapping": 30.0},
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}},
    "mistral": {"sliding_window": None},
    # Phi-4-mini's shape in small: half the channels rotated, longrope (served within 128 positions).
    "phi3": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0],
                                 "original_max_position_embeddings": 128},
             "original_max_position_embeddings": 128},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    # Mixtures of experts: 4 experts, 2 per token; Qwen2-MoE's second layer dense (mlp_only_layers), its first
    # with the shared expert; Qwen3-MoE's scores renormalised.
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 2.0},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                  "head_dim": 16},
}


def tiny_hf_model(model_type: str, folder: Path, *, tie_word_embeddings: bool, seed: int = 0,
                  **overrides: object) -> PreTrainedModel:
    """Build a tiny random-weight transformers model and ``save_pretrained`` it (safetensors) to ``folder``.

    hidden 64, 2 layers, 4 query heads, 2 KV heads, vocab 256. Every parameter,
    biases and norm weights included, is drawn at random (norms around 1) so
    that a loader mixing up two tensors changes the outputs.

    Args:
        model_type: a key of ``TINY_ARCHITECTURES``.
        folder: where the checkpoint is written.
        tie_word_embeddings: share the embedding with the output head.
        seed: seed of the weights.
        overrides: config values that replace the sizes above (e.g. ``num_key_value_heads=1``).

    Returns:
        The float32 transformers model, in eval mode, as the reference.
    """
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = AutoConfig.for_model(
        model_type, tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **(sizes | TINY_ARCHITECTURES[model_type] | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)
    return model


def random_lora_adapter(base: str | Path, folder: Path, *, rank: int, targets: list[str], seed: int,
                        scale: float = 0.15, rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of the model in ``base``, ``lora_alpha`` twice the rank, with A and B drawn from
    N(0, ``scale``²) (PEFT's own initialisation makes B zero, an adapter that changes nothing), saved to ``folder``.

    Args:
        targets: checkpoint module names (``q_proj``, ``down_proj``...).
        rslora: scale by ``alpha / sqrt(rank)`` (rsLoRA) instead of ``alpha / rank``.

    Returns:
        ``folder``.
    """
    import peft  # a test and benchmark extra

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora,
                             lora_dropout=0.0)
    lora_model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    lora_model.save_pretrained(folder)
    return folder
