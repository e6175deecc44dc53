"""One frame of the plan the scheduler hands the model runner (docs/architecture.md, "Objects that cross a boundary").

The worker sees full data for a request once (``NewRequestData``) and diffs
afterwards (``CachedRequestData``). ``num_computed_tokens`` in here is where
a request's input *starts* this step; the scheduler's own counter is already
past it when ``schedule()`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.request import Request
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler side imports neither torch nor numpy at run time
    import numpy as np


@dataclass
class NewRequestData:
    """A request the worker has not seen: everything it needs to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request's: the worker pools it instead of sampling
    lora_request: LoRARequest | None = None  # its adapter; None = the base model

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                   sampling_params=request.sampling_params, block_ids=block_ids,
                   num_computed_tokens=request.num_computed_tokens, pooling_params=request.pooling_params,
                   lora_request=request.lora_request)


@dataclass
class CachedRequestData:
    """Diffs for requests the worker already holds; parallel lists aligned by index.

    Attributes:
        req_ids: the requests.
        resumed_req_ids: those coming back after preemption; their
            ``new_block_ids`` replace the block list instead of extending it.
        new_block_ids: blocks allocated this step (None when none).
        num_computed_tokens: position where each request's input starts.
        num_output_tokens: how many output tokens the worker's copy of each request holds when the
            step starts: the scheduler's count plus the tokens in flight (async scheduling's
            placeholders). A worker whose copy holds another count fails the request rather than run it
            on a context the scheduler does not know.
        all_token_ids: prompt + output of requests not scheduled in the
            previous step (resumed ones included), keyed by request id.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """Everything the model runner needs to execute one step.

    Attributes:
        scheduled_new_reqs: first time the worker sees these.
        scheduled_cached_reqs: requests the worker has seen, as diffs.
        num_scheduled_tokens: request id -> tokens it runs this step.
        total_num_scheduled_tokens: the sum of ``num_scheduled_tokens``; 0 for
            a cleanup-only step that just carries ``finished_req_ids``.
        finished_req_ids: requests finished since the previous step: the worker drops their state.
        preempted_req_ids: requests preempted this step, for observers (tests, step records); the
            worker needs no list: it drops the row of every request the step does not run.
        scheduled_spec_decode_tokens: request id -> draft tokens it runs after its
            last token this step (speculative decoding); requests without drafts are absent.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class GrammarOutput:
    """The allowed tokens of one step's constrained requests, for the sampler's mask op.

    Attributes:
        structured_output_request_ids: the constrained requests, in bitmask row order.
        grammar_bitmask: ``[R, ceil(vocab_size / 32)]`` int32 numpy array; bit j of word i set = token
            ``32 * i + j`` allowed (xgrammar's and llguidance's packed layout).
    """

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray
