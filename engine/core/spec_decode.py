"""Speculative decoding on the scheduler side: when to ask for drafts, and how many were accepted.

Drafts are not free: every draft token is one more token in the step's forward pass, and a rejected
one buys nothing. ``DraftGate`` steps aside where speculation does not pay:

- a busy batch (vLLM's ``disable_by_batch_size``): no request gets drafts in a step that starts
  with at least that many running requests, where the forward is no longer bound by reading the
  weights and each draft token costs about as much as a sampled one;
- a request whose drafts keep failing (text that is not grounded in its prompt, where n-grams
  match by chance): once its last ``BACKOFF_WINDOW`` verified draft steps accepted less than
  ``BACKOFF_MIN_ACCEPTANCE`` of their draft tokens, it gets no drafts for ``BACKOFF_FIRST_PAUSE``
  of its decode steps, then is tried again; each failure in a row doubles the pause (up to
  ``BACKOFF_MAX_PAUSE``), a window that meets the rate resets it.

A drafter that finds no match proposes nothing and costs nothing but its lookup.

``SpecDecodingStats`` counts drafts and accepted tokens as vLLM's ``SpecDecodingStats`` does, as
totals since start; the metrics report their differences (``pagedserve.engine.metrics``).

This package imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

#: Verified draft steps of one request judged together by the back-off rule.
BACKOFF_WINDOW = 4
#: Accepted / drafted tokens under which a window fails.
BACKOFF_MIN_ACCEPTANCE = 0.25
#: Decode steps without drafts after a first failed window; doubled for each failure in a row.
BACKOFF_FIRST_PAUSE = 8
BACKOFF_MAX_PAUSE = 256


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters, totals since start (vLLM's names).

    Attributes:
        num_drafts: request steps that ran at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: accepted drafts by position in their step (index 0 = first
            draft), ``num_speculative_tokens`` entries.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_speculative_tokens: int) -> SpecDecodingStats:
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request step that verified ``num_draft_tokens`` drafts and accepted the first
        ``num_accepted_tokens`` of them."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:  # a drafter that proposes more than it declared
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted_tokens):
            per_pos[position] += 1

    def copy(self) -> SpecDecodingStats:
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def minus(self, earlier: SpecDecodingStats | None) -> SpecDecodingStats:
        """What was counted since ``earlier`` (a snapshot of the same counters; None = since start)."""
        if earlier is None:
            return self.copy()
        per_pos = list(self.num_accepted_tokens_per_pos)
        for position, count in enumerate(earlier.num_accepted_tokens_per_pos):
            per_pos[position] -= count
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts,
                                 self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    def add(self, other: SpecDecodingStats) -> None:
        """Add ``other``'s counts to these (summing intervals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[position] += count


@dataclass
class _Backoff:
    """One request's recent draft outcomes."""

    num_draft_tokens: int = 0      # in the current window
    num_accepted_tokens: int = 0   # in the current window
    num_steps: int = 0             # verified draft steps in the current window
    pause: int = 0                 # decode steps left without drafts
    next_pause: int = BACKOFF_FIRST_PAUSE


class DraftGate:
    """Decides, each step, which decoding requests the drafter is asked for (the module's rules).

    Args:
        disable_by_batch_size: no drafts in a step with at least this many running requests;
            None = no limit.
    """

    def __init__(self, disable_by_batch_size: int | None = None) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self._requests: dict[str, _Backoff] = {}

    def allows_batch(self, num_running: int) -> bool:
        """Whether a step of ``num_running`` running requests may have drafts at all."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def allows(self, request_id: str) -> bool:
        """Whether to ask for drafts for this request's next step; a paused request's pause counts
        this step down."""
        state = self._requests.get(request_id)
        if state is None or state.pause == 0:
            return True
        state.pause -= 1
        return False

    def record(self, request_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Account a verified draft step of the request; may start its pause (the module's rule)."""
        state = self._requests.setdefault(request_id, _Backoff())
        state.num_steps += 1
        state.num_draft_tokens += num_draft_tokens
        state.num_accepted_tokens += num_accepted_tokens
        if state.num_steps < BACKOFF_WINDOW:
            return
        if state.num_accepted_tokens < BACKOFF_MIN_ACCEPTANCE * state.num_draft_tokens:
            state.pause = state.next_pause
            state.next_pause = min(2 * state.next_pause, BACKOFF_MAX_PAUSE)
        else:
            state.next_pause = BACKOFF_FIRST_PAUSE
        state.num_steps = state.num_draft_tokens = state.num_accepted_tokens = 0

    def remove(self, request_id: str) -> None:
        """Forget a finished request."""
        self._requests.pop(request_id, None)
