"""``GuidanceManager``: the scheduler's ``StructuredOutputManager`` over llguidance matchers."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.reasoning import ReasoningTokens
from pagedserve.engine.request import Request
from pagedserve.engine.structured_output.compiler import GrammarCompiler, client_message

#: Threads filling the step's masks (each row is independent): one per row up to this many.
NUM_MASK_THREADS = 2


class GuidanceManager:
    """One llguidance matcher per constrained request, copied from the compiler's cached template.

    Used from the engine thread only (the compiler's pool does the compiling).

    With a reasoning format (``--reasoning-parser``) a grammar constrains only what follows the end of the
    reasoning, as in vLLM: a request still reasoning gets no mask, and its matcher takes the tokens after the
    end tag. Where thinking is optional (Qwen3) and the prompt has not decided, the first token's mask is the
    grammar's plus the start tag: a reply that opens with it reasons first, any other is the answer, held to
    the grammar from its first token.

    Args:
        compiler: the engine's. On a thread of the server's process (``InprocClient``, offline ``LLM``) it is
            the frontend's too, which compiled (and so validated) each grammar before the request was queued,
            and the engine finds it in the cache; in an engine process the grammar compiles again here.
        reasoning: the reasoning format's tag token ids, or None for a model that does not reason.
    """

    def __init__(self, compiler: GrammarCompiler, reasoning: ReasoningTokens | None = None) -> None:
        self.compiler = compiler
        self.reasoning = reasoning
        self._templates: dict[str, Future[llguidance.LLMatcher]] = {}
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._reasoning: set[str] = set()  # requests whose reasoning has not ended
        self._open: set[str] = set()       # requests whose first token decides whether they reason
        self._executor = llguidance.LLExecutor(NUM_MASK_THREADS)

    def add_request(self, request: Request) -> None:
        """Start compiling ``request``'s grammar, or find it in the compiler's cache."""
        self._templates[request.request_id] = self.compiler.compile(request.sampling_params.structured_outputs)
        if self.reasoning is not None:
            state = self.reasoning.prompt_state(request.prompt_token_ids)
            if state != "answer":
                (self._reasoning if state == "reasoning" else self._open).add(request.request_id)

    def grammar_error(self, request_id: str) -> str | None:
        """Why the grammar did not compile (or its compilation was cancelled, at shutdown)."""
        template = self._templates[request_id]
        if not template.done():
            return None
        if template.cancelled():
            return "the grammar's compilation was cancelled"
        error = template.exception()
        return None if error is None else str(error)

    def grammar_ready(self, request_id: str) -> bool:
        """True once compiled; the request's matcher is copied from the template then."""
        if request_id in self._matchers:
            return True
        template = self._templates[request_id]
        if not template.done() or self.grammar_error(request_id) is not None:
            return False
        self._matchers[request_id] = template.result().deep_copy()
        return True

    def wait_for_grammars(self, timeout_s: float) -> None:
        pending = [template for template in self._templates.values() if not template.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, requests: dict[str, Request],
                        scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The masks of the constrained requests that sample this step, filled on ``NUM_MASK_THREADS``."""
        # A request samples this step when the step computes its last known token.
        rows = [req_id for req_id in scheduler_output.num_scheduled_tokens
                if req_id in self._matchers and req_id not in self._reasoning
                and requests[req_id].num_computed_tokens >= requests[req_id].num_tokens]
        if not rows:
            return None
        bitmask = np.empty((len(rows), (self.compiler.vocab_size + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(self._matchers[r], i) for i, r in enumerate(rows)], bitmask)
        if self._open:
            start = self.reasoning.start_id
            for i, req_id in enumerate(rows):
                if req_id in self._open:  # the start tag too: the reply may open a thinking block
                    bitmask.view(np.uint32)[i, start // 32] |= np.uint32(1 << (start % 32))
        return GrammarOutput(structured_output_request_ids=rows, grammar_bitmask=bitmask)

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> str | None:
        """Advance the matcher by the tokens after the reasoning; None when it takes them, else llguidance's
        error."""
        if request_id in self._open and token_ids:
            self._open.discard(request_id)
            if token_ids[0] == self.reasoning.start_id:
                self._reasoning.add(request_id)
        if request_id in self._reasoning:
            if self.reasoning.end_id not in token_ids:
                return None
            self._reasoning.discard(request_id)
            token_ids = token_ids[token_ids.index(self.reasoning.end_id) + 1:]
        matcher = self._matchers[request_id]
        if matcher.consume_tokens(token_ids):
            return None
        error = client_message(matcher.get_error()) or "token refused"
        return f"the grammar failed while generating (llguidance: {error})"

    def is_terminated(self, request_id: str) -> bool:
        """True when the grammar is complete and allows nothing but EOS."""
        return self._matchers[request_id].is_stopped()

    def remove_request(self, request_id: str) -> None:
        """Drop the request's matcher (the compiled template stays in the compiler's cache)."""
        self._templates.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._reasoning.discard(request_id)
        self._open.discard(request_id)
