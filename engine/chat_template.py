"""Rendering chat messages into prompt token ids with the model's own template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

#: Arguments of ``apply_chat_template`` that a request's ``chat_template_kwargs`` may not set: the server sets
#: them from the request's own fields, or they would change what the call returns.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


def chat_prompt_token_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          tools: Sequence[Mapping[str, Any]] | None = None,
                          template_kwargs: Mapping[str, Any] | None = None,
                          continue_final_message: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template.

    Exactly ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=...,
    continue_final_message=..., **template_kwargs)``: with ``continue_final_message`` the prompt ends inside
    the last message, without its end-of-turn tokens, so that the reply continues it (a prefill);
    ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts) only reach a template that
    takes them (``takes_tools``); ``template_kwargs`` (vLLM's ``chat_template_kwargs``, e.g. Qwen3's
    ``enable_thinking``) become variables of the template, none of ``RESERVED_TEMPLATE_KWARGS``.

    Raises:
        ValueError: when the tokenizer has no chat template, or (``continue_final_message``) the template
            does not render the last message's content as it is.
    """
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                        add_generation_prompt=add_generation_prompt, tokenize=True,
                                        continue_final_message=continue_final_message, **(template_kwargs or {}))
    # transformers 5 returns a BatchEncoding, 4.x a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def takes_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (it reads a variable of that name)."""
    return "tools" in str(tokenizer.chat_template or "")
