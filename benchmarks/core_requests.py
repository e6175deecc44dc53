"""Requests added straight to an ``LLM``'s engine core and stepped one engine step at a time.

Benchmarks that time single engine steps drive ``LLM.engine_core`` themselves
instead of calling ``LLM.generate``: they need to know which step produced
which token, and to stop while requests are still decoding. The requests go
through the ``LLM``'s input processor first, as the frontend's do.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class CoreRequests:
    """Requests ``<prefix>-0``, ``<prefix>-1``, ... added to ``llm.engine_core``, one per prompt.

    Args:
        llm: an ``engine.LLM``; its engine core must not be running other requests of these ids.
        prompts: token-id prompts.
        params: ``SamplingParams`` of every request, ``n == 1`` and ``max_tokens`` set.
        prefix: request-id prefix, unique within the engine's lifetime.
    """

    def __init__(self, llm: Any, prompts: Sequence[Sequence[int]], params: Any, prefix: str) -> None:
        self.core = llm.engine_core
        #: request id -> output tokens so far.
        self.generated = {f"{prefix}-{i}": 0 for i in range(len(prompts))}
        for request_id, prompt in zip(self.generated, prompts, strict=True):
            request = llm.processor.process(list(prompt), params)
            for core_request in request.engine_core_requests([(request_id, request.sampling_params)], time.time()):
                self.core.add_request(core_request)

    def step(self) -> int:
        """Run one engine step; returns the tokens it gave these requests."""
        new_tokens = 0
        for output in self.core.step():
            if output.request_id in self.generated:
                self.generated[output.request_id] += len(output.new_token_ids)
                new_tokens += len(output.new_token_ids)
        return new_tokens

    def step_until_decoding(self) -> None:
        """Step until every request has its first token, i.e. has left prefill."""
        while min(self.generated.values()) == 0:
            self.step()

    def finish(self) -> None:
        """Abort every request and step until the worker has dropped their state."""
        self.core.abort_requests(list(self.generated))
        while self.core.has_unfinished_requests():
            self.core.step()
