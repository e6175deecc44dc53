"""Rendering chat messages into prompt token ids with the model's own template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase


def chat_prompt_token_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template.

    Exactly ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=...)``;
    ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts) only reach a template that
    takes them (``takes_tools``).

    Raises:
        ValueError: when the tokenizer has no chat template.
    """
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                        add_generation_prompt=add_generation_prompt, tokenize=True)
    # transformers 5 returns a BatchEncoding, 4.x a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def takes_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (it reads a variable of that name)."""
    return "tools" in str(tokenizer.chat_template or "")
