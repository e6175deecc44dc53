"""Where constrained decoding plugs into the scheduler: the protocol of a manager that owns the requests'
grammars (the implementation, ``GuidanceManager``, is in ``pagedserve.engine.structured_output``).

The scheduler hands each constrained request to its manager on arrival (``add_request``), which starts
compiling its grammar off the engine thread; the request waits in the queue, not the engine thread,
until ``grammar_ready`` says so. Between ``execute_model`` and ``sample_tokens`` the
scheduler asks the manager for the packed allowed-token bitmask of the step's constrained rows
(``GrammarOutput``); the sampler's mask op applies it. After sampling, the manager advances each
grammar by the request's new tokens. Requests without a grammar are not in the bitmask and pay nothing.
"""

from __future__ import annotations

from typing import Protocol

from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.request import Request


class StructuredOutputManager(Protocol):
    """Holds one grammar state per constrained request (``sampling_params.structured_outputs`` set)."""

    def add_request(self, request: Request) -> None:
        """Start compiling ``request``'s grammar (or find it compiled)."""

    def grammar_error(self, request_id: str) -> str | None:
        """Why the request's grammar failed to compile; None while it compiles or once it has."""

    def grammar_ready(self, request_id: str) -> bool:
        """True once the request's grammar has compiled (its grammar state is made then)."""

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until a compiling grammar is ready or ``timeout_s`` seconds have passed (the engine
        calls it when every waiting request is waiting for its grammar)."""

    def grammar_bitmask(self, requests: dict[str, Request],
                        scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """``GrammarOutput`` for the scheduled requests that are constrained and sample this step;
        None when none is.

        Args:
            requests: the scheduler's live requests by id.
            scheduler_output: the step being run (``num_computed_tokens`` already advanced past it).
        """

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> str | None:
        """Advance the grammar by sampled tokens. None when it takes them; else why it refused one (a
        grammar that outgrew the grammar engine's limits, as an alternative of 2,000 branches does), and it is
        in error from then on."""

    def is_terminated(self, request_id: str) -> bool:
        """True when the grammar is complete and allows nothing more."""

    def remove_request(self, request_id: str) -> None:
        """Forget a finished request's grammar; unknown ids are ignored."""
