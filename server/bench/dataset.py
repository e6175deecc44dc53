"""Benchmark prompts, reproducible from a seed: random token ids detokenized, or grounded passages.

Grounded prompts (``grounded_requests``) hold a passage of real text, Python's
own reference manual as the standard library ships it (``pydoc_data.topics``),
and ask for it back: the output copies long runs of the prompt, the case
prompt-lookup (n-gram) speculative decoding is for. Every benchmark draws its
prompts from here so that all servers see exactly the same text. Request ``i``
depends only on ``(seed, i)``, so the first N prompts are identical whether 8
or 128 are drawn: a server run with a prompt cap gets a prefix of the others'
dataset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# Decode/encode round trips of random ids rarely reach a fixed point at once
# (byte-level BPE merges neighbours); a few passes settle every case we saw.
_MAX_RETOKENIZE_PASSES = 8


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the dataset needs."""

    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def load_tokenizer(name_or_path: str | None = None) -> Any:
    """A Hugging Face tokenizer for the benchmark's prompts (about 6 s for a GGUF one).

    Args:
        name_or_path: a ``.gguf`` file, a local tokenizer folder or a hub id (its tokenizer files only);
            None means the server's embedded default model.
    """
    from transformers import AutoTokenizer

    if not name_or_path:
        from pagedserve.engine.model.loader import load_tokenizer as load_model_tokenizer
        from pagedserve.engine.model.loader import resolve_model_path

        return load_model_tokenizer(resolve_model_path(None))
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(name_or_path)


@dataclass(frozen=True)
class SyntheticRequest:
    """One prompt of the dataset."""

    prompt: str
    prompt_len: int  # tokens of ``prompt`` as the tokenizer encodes it, no special tokens
    output_len: int  # tokens to ask for (max_tokens)


def parse_len_range(text: str) -> tuple[int, int]:
    """Parse ``"64:512"`` or ``"128"`` into an inclusive (min, max) token range.

    Raises:
        ValueError: when the bounds are not positive integers with min <= max.
    """
    low_text, _, high_text = text.partition(":")
    try:
        low = int(low_text)
        high = int(high_text) if high_text else low
    except ValueError:
        raise ValueError(f"invalid length range {text!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise ValueError(f"invalid length range {text!r}: need 1 <= MIN <= MAX")
    return low, high


def _prompt_of_length(tokenizer: Tokenizer, rng: np.random.Generator,
                      vocab: np.ndarray, num_tokens: int) -> tuple[str, int]:
    """Random text that encodes to ``num_tokens`` tokens (rarely a few off).

    Returns:
        The text and its token count.
    """
    ids = rng.choice(vocab, size=num_tokens)
    for _ in range(_MAX_RETOKENIZE_PASSES):
        text = tokenizer.decode(ids.tolist())
        encoded = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        if len(encoded) == num_tokens:
            return text, num_tokens
        # Too long: cut; too short: top up with fresh random ids, then re-check.
        ids = encoded[:num_tokens] if len(encoded) > num_tokens else np.concatenate(
            [encoded, rng.choice(vocab, size=num_tokens - len(encoded))])
    text = tokenizer.decode(ids.tolist())
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def sample_requests(tokenizer: Tokenizer, num_prompts: int, input_len: tuple[int, int],
                    output_len: tuple[int, int], seed: int = 0) -> list[SyntheticRequest]:
    """Draw ``num_prompts`` random prompts.

    Args:
        tokenizer: the served model's tokenizer; special tokens are never drawn.
        num_prompts: how many requests.
        input_len: inclusive (min, max) prompt length in tokens, drawn uniformly.
        output_len: inclusive (min, max) requested output length in tokens.
        seed: request ``i`` is drawn from ``numpy.random.default_rng([seed, i])``.
    Raises:
        ValueError: when ``num_prompts`` is negative.
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    vocab = np.setdiff1d(np.arange(tokenizer.vocab_size), np.asarray(tokenizer.all_special_ids))
    requests = []
    for index in range(num_prompts):
        rng = np.random.default_rng([seed, index])
        num_input = int(rng.integers(input_len[0], input_len[1] + 1))
        num_output = int(rng.integers(output_len[0], output_len[1] + 1))
        prompt, prompt_len = _prompt_of_length(tokenizer, rng, vocab, num_input)
        requests.append(SyntheticRequest(prompt, prompt_len, num_output))
    return requests


GROUNDED_INSTRUCTION = "\n\nRepeat the text above exactly, word for word.\n\n"


def grounded_requests(tokenizer: Tokenizer, num_prompts: int, passage_len: int, output_len: int,
                      seed: int = 0) -> list[SyntheticRequest]:
    """Prompts that hold a passage and ask for it to be repeated (a completion, no chat template).

    Request ``i`` takes ``passage_len`` tokens from the start of a topic of
    ``pydoc_data.topics`` (the text of ``pydoc``'s help, installed with every
    CPython) drawn with ``numpy.random.default_rng([seed, i])`` among the topics
    at least that long, then ``GROUNDED_INSTRUCTION`` and the passage's first
    line, so that the output continues copying from there.

    Raises:
        ValueError: when no topic has ``passage_len`` tokens.
    """
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics)]
    encoded = [ids for ids in (tokenizer.encode(text, add_special_tokens=False) for text in texts)
               if len(ids) >= passage_len]
    if not encoded:
        raise ValueError(f"no pydoc topic has {passage_len} tokens")
    requests = []
    for index in range(num_prompts):
        rng = np.random.default_rng([seed, index])
        passage = tokenizer.decode(encoded[int(rng.integers(len(encoded)))][:passage_len])
        prompt = passage + GROUNDED_INSTRUCTION + passage.splitlines()[0]
        requests.append(SyntheticRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)),
                                         output_len))
    return requests
