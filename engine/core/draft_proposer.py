"""Where speculative decoding's drafts come from: a proposer on the scheduler side, without torch.

After each step the scheduler asks its drafter for up to ``k`` tokens that
likely follow each decoding request; the next step runs them after the
request's last token and the model runner keeps the longest prefix the model
agrees with, plus one token of its own (Leviathan et al. 2023,
arXiv:2211.17192). A proposer that reads only the token ids (n-gram lookup in
the prompt, Saxena 2023's prompt lookup decoding: ``ngram_proposer.NgramProposer``,
what ``--speculative-config '{"method": "ngram", ...}'`` builds) needs no device at
all. Which requests are asked is the scheduler's ``DraftGate`` (``spec_decode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftProposer(Protocol):
    """Proposes draft tokens from a request's tokens.

    Attributes:
        num_speculative_tokens: the most drafts per request per step (k).
    """

    num_speculative_tokens: int

    def propose(self, token_ids: Sequence[int]) -> Sequence[int]:
        """Up to ``num_speculative_tokens`` tokens likely to follow ``token_ids`` (prompt + output so far);
        none when there is no good guess."""
