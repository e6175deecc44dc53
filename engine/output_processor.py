"""Turns the engine core's per-step outputs into the ``RequestOutput`` s callers see.

The frontend (``LLM`` or ``AsyncLLM``) registers each request here, sends the
engine core the child requests this returns, and feeds every step's
``EngineCoreOutput`` s back in. Per child it detokenizes incrementally, checks
stop strings (a match finishes the child here; the caller aborts it in the core)
and accumulates logprobs; per parent it merges the ``n`` children's completions
in the caller's ``RequestOutputKind``.

Plain Python with no locking: the one caller drives it from one thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.errors import InvalidRequestError, RequestFailedError
from pagedserve.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    FinishReason,
    RequestOutput,
    TokenLogprobs,
)
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from transformers import PreTrainedTokenizerBase


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries."""

    CUMULATIVE = "cumulative"  # the full text, tokens and logprobs so far, at every step
    DELTA = "delta"            # only what is new since the previous output (server streaming)
    FINAL_ONLY = "final_only"  # a single output once every completion is finished (LLM.generate)


@dataclass
class ProcessedOutputs:
    """The result of one ``OutputProcessor.process_outputs`` call.

    Attributes:
        request_outputs: one per parent request that has something to report.
        reqs_to_abort: child request ids finished here by a stop string, which
            the engine core is still running and must abort; and the siblings of failed children.
        failed: parent request id -> what to raise for it: ``InvalidRequestError`` when a child's
            own input failed it (``EngineCoreOutput.error_param``), else ``RequestFailedError``. The
            parent is forgotten (its other children are in ``reqs_to_abort``); its caller must raise.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    #: Those of ``reqs_to_abort`` that a stop string finished (the others are siblings of failed children).
    stopped: list[str] = field(default_factory=list)
    failed: dict[str, InvalidRequestError | RequestFailedError] = field(default_factory=dict)


@dataclass(eq=False)
class _ChildState:
    """One completion (one engine-core request) of a parent request."""

    request_id: str
    index: int
    parent: _ParentState = field(repr=False)
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None  # None when the request asked for no logprobs
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # output tokens already sent in DELTA mode


@dataclass(eq=False)
class _ParentState:
    """A request as the caller added it, with its ``n`` children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: list[_ChildState] = field(default_factory=list)  # by index; kept after they finish
    num_unfinished: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    pooling_output: torch.Tensor | None = None  # a pooling request's vector, once its prompt has run
    asks_prompt_logprobs: bool = False
    # DELTA: children with news held back until child 0's prompt logprobs are complete (see _release).
    held: dict[str, _ChildState] = field(default_factory=dict)

    def awaits_prompt_logprobs(self) -> bool:
        """Whether the prompt's logprobs may be incomplete: child 0, which computes them, reports the last
        ones in the step it samples its first token."""
        first = self.children[0]
        return self.asks_prompt_logprobs and not first.detokenizer.output_token_ids and first.finish_reason is None


class OutputProcessor:
    """Detokenizes engine-core outputs and assembles ``RequestOutput`` s per parent request."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._children: dict[str, _ChildState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams,
                    output_kind: RequestOutputKind) -> list[tuple[str, SamplingParams]]:
        """Registers a request and returns the child requests the engine core must run.

        With ``n == 1`` the only child is the request itself. With ``n > 1``,
        child ``i`` has id ``f"{i}_{request_id}"`` and ``params.for_child(i)`` (sharing
        its stop strings and logit bias, not copying them), with ``n = 1`` and,
        when ``seed`` is set, ``seed + i`` (vLLM's rule: siblings
        differ yet each stays reproducible). Only child 0 keeps ``prompt_logprobs``:
        the prompt is the same for all, and a request that computes them gets no
        prefix-cache hits, while its siblings share the blocks child 0 caches.

        Args:
            request_id: the caller's id, used on every ``RequestOutput``.
            prompt: the prompt text, if the caller has one (echoed back only).
            prompt_token_ids: the tokenized prompt.
            params: sampling parameters of the request.
            output_kind: what each ``RequestOutput`` carries.

        Returns:
            ``(child request id, child params)`` per child, in index order.

        Raises:
            ValueError: when the request id or a child id is already in use.
        """
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [(f"{i}_{request_id}", params.for_child(i)) for i in range(params.n)]
        in_use = sorted(rid for rid in {request_id, *(cid for cid, _ in children)}
                        if rid in self._parents or rid in self._children)
        if in_use:
            raise ValueError(f"request_id {request_id!r} clashes with requests in progress: {in_use}")
        parent = _ParentState(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                              output_kind=output_kind, num_unfinished=len(children),
                              asks_prompt_logprobs=params.prompt_logprobs is not None)
        asks_logprobs = params.logprobs is not None
        for index, (child_id, child_params) in enumerate(children):
            child = _ChildState(
                request_id=child_id, index=index, parent=parent,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params),
                logprobs=[] if asks_logprobs else None,
                cumulative_logprob=0.0 if asks_logprobs else None)
            parent.children.append(child)
            self._children[child_id] = child
        self._parents[request_id] = parent
        return children

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Applies one engine step's outputs and builds what to report.

        Outputs of unknown children (aborted here, or finished by a stop string
        while the core was still running them) are ignored. A child the engine failed
        (``EngineCoreOutput.error``) fails its whole parent: one completion of ``n`` is no answer.

        Args:
            outputs: at most one per child request, as the engine core emits them.

        Returns:
            The ``RequestOutput`` s, in the order their parents first appear in
            ``outputs``, and the children to abort in the engine core.
        """
        processed = ProcessedOutputs()
        advanced: dict[str, dict[str, _ChildState]] = {}  # parent id -> child id -> child with news
        for output in outputs:
            child = self._children.get(output.request_id)
            if child is None:
                continue
            if output.error is not None:
                parent_id = child.parent.request_id
                processed.failed[parent_id] = (
                    RequestFailedError(parent_id, output.error) if output.error_param is None
                    else InvalidRequestError(output.error, output.error_param))
                processed.reqs_to_abort += [c for c in self.abort_requests([parent_id]) if c != output.request_id]
                advanced.pop(parent_id, None)
                continue
            if self._apply(child, output):
                processed.reqs_to_abort.append(child.request_id)
                processed.stopped.append(child.request_id)
            if output.new_token_ids or child.finish_reason is not None:
                advanced.setdefault(child.parent.request_id, {})[child.request_id] = child
        for parent_id, children in advanced.items():
            parent = self._parents[parent_id]
            children = self._release(parent, children)
            request_output = self._make_request_output(parent, children) if children else None
            if request_output is not None:
                processed.request_outputs.append(request_output)
        return processed

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forgets requests, e.g. when their clients went away.

        Args:
            request_ids: parent ids; a child id forgets its whole parent, whose
                other completions are of no use alone. Unknown ids are ignored.

        Returns:
            The child ids forgotten, which the engine core must abort.
        """
        aborted: list[str] = []
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            if parent is None and request_id in self._children:
                parent = self._children[request_id].parent
            if parent is None:
                continue
            del self._parents[parent.request_id]
            aborted.extend(c.request_id for c in parent.children
                           if self._children.pop(c.request_id, None) is not None)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Whether any parent request still awaits outputs."""
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        """The number of parent requests (not children) still awaiting outputs."""
        return len(self._parents)

    def _apply(self, child: _ChildState, output: EngineCoreOutput) -> bool:
        """Updates a child from one output; returns whether a stop string was found here
        in a child the engine core is still running."""
        parent = child.parent
        # Siblings share the prompt: only child 0 computes its logprobs (add_request); take its cache hits too.
        if child.index == 0:
            if output.pooling_output is not None:
                parent.pooling_output = output.pooling_output
            if output.new_prompt_logprobs:
                parent.prompt_logprobs = (parent.prompt_logprobs or []) + output.new_prompt_logprobs
            if output.num_cached_tokens:
                parent.num_cached_tokens = output.num_cached_tokens
        num_tokens = len(child.detokenizer.output_token_ids)
        stop = child.detokenizer.update(output.new_token_ids)
        # A stop string may end before the step's last token (accepted draft tokens): drop the rest's logprobs.
        num_new = len(child.detokenizer.output_token_ids) - num_tokens
        if child.logprobs is not None and output.new_logprobs:
            child.logprobs.extend(output.new_logprobs[:num_new])
            child.cumulative_logprob += sum(lp.logprobs[0] for lp in output.new_logprobs[:num_new])
        if stop is not None:
            child.finish_reason, child.stop_reason = FinishReason.STOP.value, stop
        elif output.finish_reason is not None:
            child.finish_reason, child.stop_reason = output.finish_reason.value, output.stop_reason
        if child.finish_reason is None:
            return False
        parent.num_unfinished -= 1
        del self._children[child.request_id]
        return stop is not None and output.finish_reason is None

    @staticmethod
    def _release(parent: _ParentState, children: dict[str, _ChildState]) -> list[_ChildState]:
        """The children to report now: in DELTA mode none while child 0's prompt logprobs are incomplete
        (they are sent once, in the first output), then those held back meanwhile too.

        Siblings compute no prompt logprobs and may take child 0's cached blocks, so with chunked prefill
        (``long_prefill_token_threshold``) one can sample before child 0 has run its whole prompt.
        """
        if parent.output_kind is not RequestOutputKind.DELTA or not (parent.held or parent.awaits_prompt_logprobs()):
            return list(children.values())
        parent.held.update(children)
        if parent.awaits_prompt_logprobs():
            return []
        released, parent.held = list(parent.held.values()), {}
        return released

    def _make_request_output(self, parent: _ParentState,
                             children: list[_ChildState]) -> RequestOutput | None:
        """Builds the parent's output for the children that advanced, or None when
        its kind has nothing to report yet."""
        finished = parent.num_unfinished == 0
        if finished:
            del self._parents[parent.request_id]
        if parent.output_kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            children = parent.children
        delta = parent.output_kind is RequestOutputKind.DELTA
        completions = [self._make_completion(child, delta) for child in children]
        prompt_logprobs = parent.prompt_logprobs
        # In DELTA mode they are complete here (_release): send them once.
        if delta and parent.prompt_logprobs_sent:
            prompt_logprobs = None
        elif delta:
            parent.prompt_logprobs_sent = prompt_logprobs is not None
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids,
                             outputs=sorted(completions, key=lambda c: c.index), finished=finished,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=parent.num_cached_tokens,
                             pooling_output=parent.pooling_output)

    @staticmethod
    def _make_completion(child: _ChildState, delta: bool) -> CompletionOutput:
        """The child's completion: everything so far, or only what is new when ``delta``."""
        finished = child.finish_reason is not None
        token_ids = child.detokenizer.output_token_ids
        start = child.num_sent_tokens if delta else 0
        child.num_sent_tokens = len(token_ids)
        return CompletionOutput(
            index=child.index,
            text=child.detokenizer.get_next_output_text(finished, delta),
            token_ids=token_ids[start:],
            logprobs=None if child.logprobs is None else child.logprobs[start:],
            cumulative_logprob=child.cumulative_logprob,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason)
