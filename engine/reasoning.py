"""Reasoning formats: where a thinking model's reasoning ends and its answer begins (vLLM's reasoning parsers).

A model that thinks first writes its reasoning between ``<think>`` and
``</think>`` and its answer after them. ``--reasoning-parser`` names the format,
with vLLM's names:

* ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the chat template opens the
  thinking itself (the prompt ends with ``<think>``), so the reply starts inside it,
  and a reply without ``</think>`` is reasoning to its end (the budget ran out).
* ``qwen3`` (Qwen3): the reply opens with ``<think>`` when the model thinks; without
  ``</think>`` a reply is the answer, unless it opened with ``<think>`` (then it is
  reasoning cut short). With ``enable_thinking: false`` the template closes an empty
  thinking block in the prompt and the whole reply is the answer.

The server splits each reply into ``reasoning_content`` and ``content``, whole
(``split_reasoning``) or delta by delta (``ReasoningStream``); the engine lets
structured output (and tool-call grammars) constrain only what follows the end of
the reasoning (``ReasoningTokens``), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ReasoningFormat:
    """A format's tags, and whether a reply is inside its reasoning before any tag (``starts_inside``)."""

    name: str
    starts_inside: bool
    start_tag: str = "<think>"
    end_tag: str = "</think>"


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The format called ``name``.

    Raises:
        ValueError: for an unknown name; the message lists the known ones.
    """
    if name not in REASONING_FORMATS:
        raise ValueError(f"reasoning_parser {name!r} is unknown; known: {sorted(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """A whole reply as ``(reasoning, content)``, each None when empty."""
    stream = ReasoningStream(fmt)
    reasoning, content = stream.feed(text)
    tail_reasoning, tail_content = stream.finish()
    return (reasoning + tail_reasoning) or None, (content + tail_content) or None


class ReasoningStream:
    """One reply's text, delta by delta, split into reasoning and content.

    A tag may arrive cut over two deltas (the detokenizer sends text as it
    becomes valid), so text that could be the start of the awaited tag is held
    back until the next delta decides it.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._inside = fmt.starts_inside  # in the reasoning
        self._done = False               # past the end tag: the rest is content
        self._at_start = True            # nothing but whitespace seen yet: a start tag may come
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the text that ``delta`` settles (either may be empty)."""
        text, self._held = self._held + delta, ""
        reasoning, content = [], []
        while text:
            if self._done:
                content.append(text)
                break
            if self._at_start:
                stripped = text.lstrip()
                if not stripped:  # whitespace only: wait for what follows
                    self._held = text
                    break
                if stripped.startswith(self.fmt.start_tag):
                    self._inside, self._at_start = True, False
                    text = stripped[len(self.fmt.start_tag):]
                    continue
                if self.fmt.start_tag.startswith(stripped):  # perhaps the tag, cut short
                    self._held = text
                    break
                self._at_start = False
                if not self._inside:  # an answer without reasoning
                    self._done = True
                    continue
            end = text.find(self.fmt.end_tag)
            if end >= 0:
                reasoning.append(text[:end])
                text, self._inside, self._done = text[end + len(self.fmt.end_tag):], False, True
                continue
            keep = partial_suffix(text, self.fmt.end_tag)
            reasoning.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended: reasoning if still inside it, else content."""
        held, self._held = self._held, ""
        return (held, "") if self._inside and not self._done else ("", held)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (shorter than the tag; 0 when none): what a
    streaming parser holds back, since it may be a tag cut across deltas."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclass(frozen=True)
class ReasoningTokens:
    """A format's tags as token ids of one tokenizer, for the engine's grammars; ``starts_inside`` as the format's.

    Raises (``of``):
        ValueError: when the tokenizer does not have each tag as one token.
    """

    start_id: int
    end_id: int
    starts_inside: bool = False

    @classmethod
    def of(cls, fmt: ReasoningFormat, tokenizer: PreTrainedTokenizerBase) -> ReasoningTokens:
        ids = []
        for tag in (fmt.start_tag, fmt.end_tag):
            token_ids = tokenizer.encode(tag, add_special_tokens=False)
            if len(token_ids) != 1:
                raise ValueError(f"reasoning_parser {fmt.name!r} needs {tag} as one token of the model's "
                                 f"tokenizer; it encodes to {len(token_ids)}")
            ids.append(token_ids[0])
        return cls(*ids, starts_inside=fmt.starts_inside)

    def prompt_state(self, prompt_token_ids: Sequence[int]) -> str:
        """Where a reply to this prompt starts: ``"answer"`` (the prompt's last tag closes a thinking block),
        ``"reasoning"`` (its last tag opens one, or it has none and the format starts inside), or ``"open"``
        (no tag and thinking optional: the reply's first token decides)."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end_id:
                return "answer"
            if token_id == self.start_id:
                return "reasoning"
        return "reasoning" if self.starts_inside else "open"
