"""Where constrained decoding plugs into the scheduler: a manager that fills each step's token masks.

The scheduler asks its manager, between ``execute_model`` and ``sample_tokens``,
for the packed allowed-token bitmask of the step's constrained requests
(``GrammarOutput``); the sampler's mask op applies it. Requests without a
grammar are not in the bitmask and pay nothing.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from engine.request import Request


class StructuredOutputManager(Protocol):
    """Computes the allowed-token masks of the constrained requests scheduled in a step."""

    def grammar_bitmask(self, requests: dict[str, Request],
                        scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """``GrammarOutput`` for the scheduled requests that are constrained; None when none is.

        Args:
            requests: the scheduler's live requests by id.
            scheduler_output: the step being run.
        """
