"""Incremental detokenization and stop-string checks for one completion.

Decoding a token alone is wrong for byte-level BPE: a character may be split
across tokens (each piece alone decodes to U+FFFD). Re-decoding the whole output
every step is right but costs O(output length) per step. This module uses the
technique of Hugging Face TGI and vLLM instead: keep a small window of token ids
whose first part (the *prefix*) has already been turned into text, decode the
window with and without its unread tail, and emit only the difference. The
prefix gives the tokenizer the context it needs (leading spaces of SentencePiece
tokens), and the window moves forward as soon as its text ends on a complete
character, so each step decodes a handful of tokens whatever the output length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Iterable

    from transformers import PreTrainedTokenizerBase

#: Prompt tokens that prime the window, so the first output token decodes in context.
PROMPT_CONTEXT_TOKENS = 5

#: What the tokenizer decodes an incomplete (or invalid) UTF-8 byte sequence to.
REPLACEMENT_CHAR = "\ufffd"

#: Unread tokens that may still be an incomplete character: UTF-8 needs at most 4 bytes.
MAX_INCOMPLETE_CHAR_TOKENS = 4


class StopStrings:
    """Finds stop strings in text that grows at its end, one dictionary look-up per new character.

    A stop string can only end at a character equal to its last one, so the strings are grouped by
    their last character; a new character is compared (in C, by ``str.endswith``) only with the group
    it ends. A request's cost per token is thus its new characters, whatever the number of strings
    (``MAX_STOP_STRINGS`` and ``MAX_STOP_STRING_CHARS`` bound the rare comparisons), and nothing is
    built beyond the groups: an automaton (Aho-Corasick) in Python would cost each request about 230
    bytes and 2 us per stop-string character on the event loop (14.5 MiB and 0.1 s for 64 strings of
    1,000 characters).

    Args:
        stops: the stop strings, non-empty.

    Attributes:
        max_length: the longest stop string's length (0 without any).
    """

    def __init__(self, stops: Iterable[str]) -> None:
        groups: dict[str, list[str]] = {}
        # Longest first, so that the first string of a group that ends at a character is the longest one.
        for stop in sorted(set(stops), key=len, reverse=True):
            groups.setdefault(stop[-1], []).append(stop)
        self._by_last_char = {char: tuple(group) for char, group in groups.items()}
        self.max_length = max((len(group[0]) for group in self._by_last_char.values()), default=0)

    def find(self, text: str, start: int) -> tuple[str, int] | None:
        """The stop string whose match in ``text`` ends first after ``text[:start]``, the longest of those
        ending there; it may begin before ``start``.

        Costs one look-up per character of ``text[start:]``, plus, where a character ends stop strings,
        one comparison with each of them.

        Returns:
            (stop string, index in ``text`` where it begins) or None.
        """
        for end in range(start + 1, len(text) + 1):
            group = self._by_last_char.get(text[end - 1])
            if group is not None and text.endswith(group, 0, end):
                stop = next(stop for stop in group if text.endswith(stop, 0, end))
                return stop, end - len(stop)
        return None


class IncrementalDetokenizer:
    """Turns the output tokens of one completion into text, a few tokens at a time.

    Attributes:
        output_token_ids: every output token received, stop strings included.
        output_text: the text of those tokens, minus a trailing incomplete
            character (held back until its bytes complete; dropped if they never
            do), truncated at a matched stop string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        """Prepares decoding for a request.

        Args:
            tokenizer: the model's Hugging Face tokenizer.
            prompt_token_ids: the request's prompt; its last tokens prime the window.
            params: uses ``skip_special_tokens``, ``stop``, ``include_stop_str_in_output``
                and ``min_tokens``.
        """
        self.tokenizer = tokenizer
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._skip_special_tokens = params.skip_special_tokens
        # Skipped tokens never enter the window: it would otherwise grow (and be
        # re-decoded) for as long as the model emits tokens that decode to nothing.
        self._skipped_ids = frozenset(
            token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special
        ) if params.skip_special_tokens else frozenset()
        self._stop = StopStrings(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # A streaming client must not see the start of a stop string that may still
        # complete; when the stop string is kept in the output anyway, that is moot.
        self._stop_buffer_length = (
            self._stop.max_length - 1 if self._stop.max_length and not self._include_stop else 0)
        self._stopped = False
        self._sent_offset = 0  # chars of output_text returned by get_next_output_text(delta=True)

        context = [t for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if t not in self._skipped_ids]
        # A context that starts or ends inside a character would shift the text
        # differences below; such a prompt tail is rare enough to go without context.
        if REPLACEMENT_CHAR in self._decode(context):
            context = []
        self._window = context
        self._read_offset = len(context)  # window[:read_offset] is the prefix, already emitted
        self._emitted_past_prefix = 0  # chars of the unread tail already emitted

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends new output tokens, extends ``output_text`` and checks stop strings.

        Costs O(new tokens) whatever the output length and the number of stop strings
        (``StopStrings.find``).

        Stop strings are only looked for in text that ends after the first
        ``min_tokens`` output tokens (vLLM's rule), so a match may start in earlier
        text but not end there. When several stop strings match, the one whose
        match ends first wins (the one a character-by-character stream would have
        hit first), and among those the longest.

        Args:
            new_token_ids: tokens generated since the last call.

        Returns:
            The matched stop string, after which ``output_text`` has been cut right
            before it (after it with ``include_stop_str_in_output``) and
            ``output_token_ids`` ends with the token that completed it; else None.

        Raises:
            RuntimeError: when called again after a stop string was matched.
        """
        if self._stopped:
            raise RuntimeError("update() called after a stop string ended the output")
        if len(new_token_ids) > 1 and self._stop.max_length:
            # Several tokens in one step (accepted draft tokens): those after the token whose
            # text completes a stop string would never have been generated one at a time.
            for token_id in new_token_ids:
                if (stop := self.update([token_id])) is not None:
                    return stop
            return None
        num_suppressed = max(0, self._min_tokens - len(self.output_token_ids))
        self._append(new_token_ids[:num_suppressed])
        check_from = len(self.output_text)
        self._append(new_token_ids[num_suppressed:])
        match = self._stop.find(self.output_text, check_from)
        if match is None:
            return None
        stop, start = match
        self.output_text = self.output_text[:start + len(stop) if self._include_stop else start]
        self._stopped = True
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Returns the text to send to the client now.

        While the request runs, the last (longest stop string length - 1)
        characters are held back so that the start of a stop string never
        reaches a streaming client.

        Args:
            finished: the request is complete: nothing is held back.
            delta: return only text not returned by an earlier ``delta`` call;
                else the whole text so far.

        Returns:
            The text (possibly empty).
        """
        end = len(self.output_text) if finished else len(self.output_text) - self._stop_buffer_length
        if not delta:
            return self.output_text[:max(end, 0)]
        if end <= self._sent_offset:
            return ""
        text = self.output_text[self._sent_offset:end]
        self._sent_offset = end
        return text

    def _append(self, token_ids: list[int]) -> None:
        """Adds tokens and appends the stable part of their text to ``output_text``."""
        if not token_ids:
            return
        self.output_token_ids.extend(token_ids)
        # One token at a time, so the unread tail counts only the tokens since the
        # last complete character (the engine sends one token per step anyway).
        for token_id in token_ids:
            if token_id not in self._skipped_ids:
                self._append_token(token_id)

    def _append_token(self, token_id: int) -> None:
        self._window.append(token_id)
        prefix_text = self._decode(self._window[:self._read_offset])
        window_text = self._decode(self._window)
        # Trailing U+FFFD usually comes from a character whose remaining bytes are
        # in tokens not generated yet: emit what precedes it, hold it back. But a
        # character has at most 4 bytes, so past that many unread tokens the
        # U+FFFD is real (a token for the character itself, or invalid bytes) and
        # holding it would swallow the rest of the output.
        incomplete = len(self._window) - self._read_offset <= MAX_INCOMPLETE_CHAR_TOKENS
        stable_end = len(window_text.rstrip(REPLACEMENT_CHAR)) if incomplete else len(window_text)
        start = len(prefix_text) + self._emitted_past_prefix
        if stable_end > start:
            self.output_text += window_text[start:stable_end]
            self._emitted_past_prefix += stable_end - start
        if stable_end == len(window_text) and len(window_text) > len(prefix_text):
            # The window ends on a complete character: the unread tail becomes the
            # prefix. A tail that added no text stays unread (as in TGI): some
            # tokenizers only render such tokens once the next one arrives.
            self._window = self._window[self._read_offset:]
            self._read_offset = len(self._window)
            self._emitted_past_prefix = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
