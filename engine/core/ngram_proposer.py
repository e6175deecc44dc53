"""Drafts by n-gram lookup in the request's own tokens: prompt lookup decoding, without a draft model.

Text that quotes, edits or summarises its input (code edits, retrieval answers, "repeat this with
one word changed") repeats long runs of its prompt. The tokens that followed the last earlier
occurrence of the sequence's final n tokens are then a good guess of what comes next, and the
target model verifies the guess in the same forward pass (``pagedserve.engine.worker.rejection_sampler``).
Apoorv Saxena, "Prompt Lookup Decoding" (2023, github.com/apoorvumang/prompt-lookup-decoding);
vLLM's ``NgramProposer`` (vllm/v1/spec_decode/ngram_proposer.py, ``--speculative-config
'{"method": "ngram", ...}'``) implements the same rule.

Pure Python and stateless: the search runs in C. The tokens are packed as fixed-width integers into a
``bytes`` object, and ``bytes.rfind`` finds the most recent earlier occurrence of the packed suffix;
a hit at an offset that is not a whole token is a false match across token boundaries and is skipped.
One call costs one search of the sequence per suffix length (about 45 us for 4,096 random tokens
without a match on this machine, by ``timeit``; ``benchmarks/speculative.py`` reports the drafter's
share of a run), not the O(n^2) of comparing every earlier window.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

#: array typecode of a packed token: unsigned 32-bit (token ids are below 2**32).
_TOKEN_TYPECODE = "I"


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    n runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the longest suffix that occurred
    before wins, and of its occurrences the most recent one. Implements ``DraftProposer``.

    Args:
        num_speculative_tokens: most drafts per call (k), >= 1.
        prompt_lookup_min: shortest suffix matched, in tokens, >= 1.
        prompt_lookup_max: longest suffix matched, in tokens, >= ``prompt_lookup_min``.

    Raises:
        ValueError: a bound out of range, naming it.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min "
                             f"({prompt_lookup_min})")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Up to ``num_speculative_tokens`` tokens likely to follow ``token_ids`` (prompt + output so far).

        Returns:
            The tokens after the match (fewer than k when the match is near the end); [] when no suffix
            of ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens occurred earlier.
        """
        num_tokens = len(token_ids)
        # A match must end before the last token, so that at least one token follows it.
        if num_tokens <= self.prompt_lookup_min:
            return []
        packed = array(_TOKEN_TYPECODE, token_ids).tobytes()
        width = len(packed) // num_tokens
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            start = _rfind_aligned(packed, packed[-n * width:], (num_tokens - 1) * width, width)
            if start >= 0:
                follow = start // width + n
                return list(token_ids[follow:follow + self.num_speculative_tokens])
        return []


def _rfind_aligned(haystack: bytes, needle: bytes, end: int, width: int) -> int:
    """The byte offset of the last occurrence of ``needle`` within ``haystack[:end]`` that starts on a
    multiple of ``width`` (a token boundary); -1 when there is none."""
    while (found := haystack.rfind(needle, 0, end)) >= 0 and found % width:
        end = found + len(needle) - 1  # the next search ends just before this false match
    return found
