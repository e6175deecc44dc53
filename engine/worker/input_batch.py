"""The persistent batch: per-row state of the requests the worker runs.

docs/architecture.md, "The executor and the worker", describes it.

Rows are reused across steps: ``add_request`` fills the lowest free row,
``remove_request`` leaves a hole and ``condense`` moves tail rows into holes,
so a running request's tokens are written once, not rebuilt every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.worker.block_table import BlockTable
from pagedserve.engine.worker.sampling_metadata import LogitBias, SamplingMetadata


@dataclass
class CachedRequestState:
    """Everything the worker keeps about a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose logprobs were already returned; survives preemption,
    # so a recomputed prompt does not report them twice.
    num_prompt_logprobs_done: int = 0
    # A pooling request's parameters, and what its prompt's chunks have pooled so far (``Pooler``).
    pooling_params: PoolingParams | None = None
    pooled: torch.Tensor | None = None
    lora_request: LoRARequest | None = None  # its adapter; None = the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Fixed-capacity host arrays indexed by batch row.

    Args:
        max_num_reqs: rows.
        max_model_len: longest sequence, in tokens (columns of ``token_ids_cpu``).
        max_num_blocks_per_req: columns of the block table.
        block_size: tokens per KV block.
        vocab_size: model vocabulary (padding id for penalty inputs).
        device: where the model runs.
        pin_memory: pin host buffers for asynchronous copies (CUDA).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, block_size: int,
                 vocab_size: int, device: torch.device, pin_memory: bool = False) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs))  # kept sorted: lowest row first
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int64)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        # Draft tokens each row runs this step, written after its num_tokens known tokens.
        self.num_draft_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, max_num_blocks_per_req, block_size, device, pin_memory)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalties = np.ones(max_num_reqs, dtype=np.float32)
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        # Rows asking for prompt logprobs, so that steps without any skip that work.
        self.prompt_logprobs_req_ids: set[str] = set()

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        """Place a request in the lowest free row and fill its arrays. Returns the row.

        Raises:
            ValueError: a ``logit_bias`` token id outside the vocabulary (the ``InputProcessor`` refuses
                them; a request made without it fails here, alone, not in the batch's sampler).
        """
        self._check_logit_bias(state.sampling_params)
        row = self._free_rows.pop(0)
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.states[row] = state
        num_prompt = len(state.prompt_token_ids)
        num_tokens = state.num_tokens
        self.token_ids_cpu[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, num_prompt:num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        params = state.sampling_params
        if params.prompt_logprobs is not None:
            self.prompt_logprobs_req_ids.add(state.req_id)
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.presence_penalties[row] = params.presence_penalty
        self.frequency_penalties[row] = params.frequency_penalty
        self.repetition_penalties[row] = params.repetition_penalty
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free the row of ``req_id`` (a hole until ``condense``). Returns it, or None if absent."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.states[row] = None
        self.prompt_logprobs_req_ids.discard(req_id)
        self._free_rows.append(row)
        self._free_rows.sort()
        return row

    def condense(self) -> None:
        """Move tail rows into holes so rows ``0 .. num_reqs - 1`` are the live ones."""
        num_reqs = self.num_reqs
        holes = [r for r in self._free_rows if r < num_reqs]
        if not holes:
            return
        tails = [r for r in range(self.max_num_reqs - 1, num_reqs - 1, -1) if self.req_ids[r] is not None]
        for dst, src in zip(holes, tails, strict=True):
            self._move_row(src, dst)
        self._free_rows = list(range(num_reqs, self.max_num_reqs))

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[req_id] = dst
        n = self.num_tokens[src]
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu, self.temperature,
                      self.top_p, self.top_k, self.min_p, self.presence_penalties, self.frequency_penalties,
                      self.repetition_penalties):
            array[dst] = array[src]
        self.block_table.move_row(src, dst)

    def set_draft_tokens(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Place this step's draft tokens after each row's known tokens (rows without drafts get none)."""
        self.num_draft_tokens[:] = 0
        for req_id, drafts in draft_token_ids.items():
            row = self.req_id_to_index[req_id]
            start = self.num_tokens[row]
            self.token_ids_cpu[row, start:start + len(drafts)] = drafts
            self.num_draft_tokens[row] = len(drafts)

    def append_sampled_tokens(self, rows: np.ndarray, token_ids: list[list[int]]) -> None:
        """Record each row's new tokens (one, or accepted drafts and one more), so the scheduler never
        sends them back."""
        for row, tokens in zip(rows.tolist(), token_ids, strict=True):
            start = self.num_tokens[row]
            self.token_ids_cpu[row, start:start + len(tokens)] = tokens
            self.num_tokens[row] += len(tokens)
            self.states[row].output_token_ids.extend(tokens)

    def make_sampling_metadata(self, rows: np.ndarray, per_position: bool = False) -> SamplingMetadata:
        """Sampling inputs for ``rows`` (the rows that sample this step), in that order.

        Args:
            rows: ``[S]`` batch rows.
            per_position: one metadata row per scored position instead of per batch row: a row
                running k draft tokens gets k + 1 rows, where position j's output so far ends with
                drafts 0 .. j - 1 (so penalties see them). Its ``generators`` are then empty: the
                rejection sampler takes them per request (``generators_by_request``).
        """
        states = [self.states[r] for r in rows.tolist()]
        output_token_ids = [s.output_token_ids for s in states]
        if per_position:
            output_token_ids = [output + drafts[:j] for output, drafts in zip(output_token_ids,
                                                                               self.draft_token_ids(rows), strict=True)
                                for j in range(len(drafts) + 1)]
            rows = np.repeat(rows, self.num_draft_tokens[rows] + 1)
            states = [self.states[r] for r in rows.tolist()]
        params = [s.sampling_params for s in states]
        greedy = [p.is_greedy for p in params]
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        no_penalties = not any(p.has_penalties for p in params)

        def column(array: np.ndarray, used: bool) -> torch.Tensor | None:
            return torch.from_numpy(array[rows]).to(self.device, non_blocking=True) if used else None

        max_num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        return SamplingMetadata(
            temperature=column(self.temperature, True),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=column(self.top_p, any(p.top_p < 1.0 for p in random_params)),
            top_k=column(self.top_k, any(0 < p.top_k < self.vocab_size for p in random_params)),
            min_p=column(self.min_p, any(p.min_p > 0.0 for p in random_params)),
            generators={} if per_position else {i: s.generator for i, s in enumerate(states)
                                                 if s.generator is not None},
            no_penalties=no_penalties,
            presence_penalties=column(self.presence_penalties, True),
            frequency_penalties=column(self.frequency_penalties, True),
            repetition_penalties=column(self.repetition_penalties, True),
            prompt_token_ids=None if no_penalties else self._padded_prompt_token_ids(rows),
            output_token_ids=output_token_ids,
            logit_bias=LogitBias.from_rows([_logit_bias_arrays(p) for p in params], self.vocab_size, self.device),
            max_num_logprobs=max_num_logprobs,
        )

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """Raise ValueError when a ``logit_bias`` token id is outside ``[0, vocab_size)``."""
        bias = _logit_bias_arrays(params)
        largest = -1 if bias is None else int(bias[0].max())  # SamplingParams refuses negative ids
        if largest >= self.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {largest}")

    def draft_token_ids(self, rows: np.ndarray) -> list[list[int]]:
        """Per row, the draft tokens it runs this step (``set_draft_tokens``)."""
        return [self.token_ids_cpu[row, start:start + k].tolist()
                for row, start, k in zip(rows.tolist(), self.num_tokens[rows].tolist(),
                                         self.num_draft_tokens[rows].tolist(), strict=True)]

    def generators_by_request(self, rows: np.ndarray) -> dict[int, torch.Generator]:
        """Index into ``rows`` -> the generator of that row's seeded request."""
        return {i: self.states[r].generator for i, r in enumerate(rows.tolist())
                if self.states[r].generator is not None}

    def _padded_prompt_token_ids(self, rows: np.ndarray) -> torch.Tensor:
        """``[len(rows), max_prompt_len]`` int64 prompt ids, padded with ``vocab_size``."""
        max_len = int(self.num_prompt_tokens[rows].max())
        ids = self.token_ids_cpu[rows, :max_len].copy()
        ids[np.arange(max_len)[None, :] >= self.num_prompt_tokens[rows][:, None]] = self.vocab_size
        return torch.from_numpy(ids).to(self.device, non_blocking=True)


def _logit_bias_arrays(params: SamplingParams) -> tuple[np.ndarray, np.ndarray] | None:
    """The request's ``logit_bias`` as ``[k]`` int64 token ids and ``[k]`` float32 biases: views of the arrays
    ``SamplingParams`` built once (no copy); None without a bias."""
    if params.logit_bias_arrays is None:
        return None
    token_ids, values = params.logit_bias_arrays
    return np.frombuffer(token_ids, dtype=np.int64), np.frombuffer(values, dtype=np.float32)
