"""The scheduler's record of one request (docs/architecture.md, "The life of a request")."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from pagedserve.engine.core.kv_cache_utils import BlockHash, hash_new_full_blocks
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.outputs import FinishReason
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a fault in this request alone (its state, inputs or sampling)

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class EngineCoreRequest:
    """A request as the frontend hands it to the engine core: validated, tokenized, ``n`` fanned out.

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: the prompt, at least one token, ids in the vocabulary.
        sampling_params: with ``n == 1`` and ``max_tokens`` resolved.
        eos_token_id: the model's end-of-sequence token (None: no EOS stop).
        arrival_time: wall-clock seconds (``time.time()``) the request arrived.
        pooling_params: set for a pooling request (``--runner pooling``), which runs its prompt once and
            finishes with its vector; ``sampling_params`` are then never read.
        lora_request: the adapter it runs with; None = the base model.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens of ``all_token_ids`` whose K/V are in
    the cache; a token sampled at step t is appended at once but computed at
    step t + 1. With async scheduling the scheduler plans step t + 1 before step t's
    token comes back: ``num_output_placeholders`` counts the tokens sampled (or being
    sampled) by the worker that are not in ``all_token_ids`` yet, and
    ``num_computed_tokens`` may run up to ``num_tokens + num_output_placeholders``.
    ``block_hashes`` holds the chained hash of every full block of ``all_token_ids``
    (prompt and output), kept current on each append.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, at least one token.
        sampling_params: how to sample.
        eos_token_id: the model's end-of-sequence token (None: no EOS stop).
        block_size: KV block size in tokens, used for ``block_hashes``.
        arrival_time: wall-clock seconds (``time.time()``) the request arrived.
        pooling_params: set for a pooling request (``EngineCoreRequest.pooling_params``).
        lora_request: its adapter, whose id is part of every block hash (the prefix cache never shares K/V
            across adapters); None = the base model.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: int | None, block_size: int, arrival_time: float | None = None,
                 pooling_params: PoolingParams | None = None, lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self._hash_keys = (lora_request.cache_key,) if lora_request is not None else ()
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens of steps in flight, sampled on the worker but not appended yet (async scheduling; else 0).
        self.num_output_placeholders = 0
        # Draft tokens to verify in the next step (speculative decoding); not part of the sequence.
        self.spec_token_ids: list[int] = []
        # Prompt tokens served from the prefix cache at first scheduling; -1 before.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # time.monotonic() seconds when the scheduler first gave it tokens; None before (for metrics).
        self.first_scheduled_time: float | None = None
        self.block_hashes: list[BlockHash] = []
        hash_new_full_blocks(self._all_token_ids, self.block_hashes, block_size, self._hash_keys)

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, block_size: int) -> Request:
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params, request.eos_token_id,
                   block_size, request.arrival_time, request.pooling_params, request.lora_request)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled tokens to the output and refresh ``block_hashes``."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if len(self._all_token_ids) // self.block_size > len(self.block_hashes):
            hash_new_full_blocks(self._all_token_ids, self.block_hashes, self.block_size, self._hash_keys)
