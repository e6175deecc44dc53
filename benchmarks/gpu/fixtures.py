"""Models, tokenizers and prompts the check builds in code: the check machine has no gguf and no hub access."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gpu.context import free_memory
from benchmarks.roofline import ModelShape

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Tokens 0, 1, 2 are <unk>, <s>, </s> in the check's tokenizer; prompts use the others.
FIRST_PLAIN_TOKEN = 3


def build_tokenizer(vocab_size: int) -> Any:
    """A whitespace word-level tokenizer over ``<unk> <s> </s> t3 t4 ...``: id i <-> word ``t{i}``.

    Big enough vocabularies (128256 words) take under a second.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(FIRST_PLAIN_TOKEN, vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<unk>")


def random_prompts(rng: np.random.Generator, lengths: Sequence[int], vocab_size: int) -> list[list[int]]:
    """One prompt of random plain-token ids per length."""
    return [rng.integers(FIRST_PLAIN_TOKEN, vocab_size, size=int(n)).tolist() for n in lengths]


def save_random_model(shape: ModelShape, folder: Path, dtype: torch.dtype, device: str) -> float:
    """Write a random-weight Llama (llama3 rope, tied embeddings) of ``shape`` and a tokenizer to ``folder``.

    Weights are drawn by transformers' own initialiser directly on ``device``.

    Returns:
        Seconds it took.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    config = AutoConfig.for_model(
        "llama", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE),
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    build_tokenizer(shape.vocab_size).save_pretrained(folder)
    del model
    free_memory()
    return time.perf_counter() - start
