"""The model runner: applies each ``SchedulerOutput`` to the persistent batch,
builds the flattened inputs and runs the forward pass and the sampler
(design section 4)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.model.attention import AttentionMetadata
from engine.model.cpu_threads import serial_elementwise
from engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, TokenLogprobs
from engine.worker.block_table import slot_mapping
from engine.worker.cuda_graph import CudaGraphRunner, capture_sizes
from engine.worker.input_batch import CachedRequestState, InputBatch
from engine.worker.sampler import Sampler, compute_logprobs_tensors

logger = logging.getLogger(__name__)

#: Prompt positions whose logprobs are computed at once (bounds the fp32 logits' memory).
_PROMPT_LOGPROBS_ROWS = 256
#: CPU steps of at most this many tokens run their elementwise ops on one thread. Above it (long
#: prefill chunks) each op has hundreds of thousands of elements and parallelising them pays.
SERIAL_ELEMENTWISE_MAX_TOKENS = 512


@dataclass
class StepInputs:
    """The flattened inputs of one step.

    Attributes:
        input_ids: ``[T]`` int64 token ids of every scheduled token, request after request.
        positions: ``[T]`` int64 position of each token in its sequence.
        attn_metadata: paged-attention layout.
        logits_indices: ``[S]`` index into the T tokens of each sampling request's last token.
        sample_rows: ``[S]`` batch rows that sample this step (their prefill is complete).
        num_scheduled_tokens: ``[num_reqs]`` tokens of each row this step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: np.ndarray
    num_scheduled_tokens: np.ndarray


class ModelRunner:
    """Owns the persistent batch, the KV caches and the forward pass.

    Args:
        model: a model from ``engine.model.loader.load_model``.
        kv_caches: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.
        max_num_reqs: rows of the persistent batch (``max_num_seqs``).
        max_model_len: longest sequence, in tokens.
        max_num_batched_tokens: most tokens in one step.
        block_size: tokens per KV block.
        vocab_size: logits width.
        device: where the model runs.
        seed: seeds the global generator used by unseeded random requests.
        enforce_eager: on CUDA, never replay CUDA graphs.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_num_reqs: int,
                 max_model_len: int, max_num_batched_tokens: int, block_size: int, vocab_size: int,
                 device: torch.device, seed: int = 0, enforce_eager: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.max_model_len = max_model_len
        self.block_size = block_size
        pin = device.type == "cuda"
        self.input_batch = InputBatch(max_num_reqs, max_model_len, -(-max_model_len // block_size), block_size,
                                      vocab_size, device, pin_memory=pin)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.arange_np = np.arange(max(max_num_batched_tokens, max_num_reqs) + 1, dtype=np.int64)
        torch.manual_seed(seed)
        self.cuda_graphs: CudaGraphRunner | None = None
        if device.type == "cuda" and not enforce_eager:
            self.cuda_graphs = CudaGraphRunner(
                lambda ids, pos, md: self.model(ids, pos, self.kv_caches, md), capture_sizes(max_num_reqs),
                self.input_batch.block_table.block_table.shape[1], max_model_len, device)
            self.cuda_graphs.capture()

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        # Rows are kept only for requests scheduled this step (preempted ones
        # included); the others keep their CachedRequestState and come back later.
        for req_id in [r for r in batch.req_id_to_index if r not in so.num_scheduled_tokens]:
            batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), params, generator,
                                       list(new.block_ids), new.num_computed_tokens)
            self.requests[new.req_id] = state
            to_add.append(state)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                state.block_ids = list(new_block_ids)
            elif new_block_ids:
                state.block_ids.extend(new_block_ids)
            if req_id in cached.all_token_ids:
                state.output_token_ids = list(cached.all_token_ids[req_id][len(state.prompt_token_ids):])
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
            if new_block_ids and not resumed:
                batch.block_table.append_row(new_block_ids, row)
        for state in to_add:
            batch.add_request(state)
        batch.condense()

    # ------------------------------------------------------------------ inputs

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids[:num_reqs]], dtype=np.int64)
        total = int(num_scheduled.sum())
        # [2, 5, 3] -> req_indices [0,0,1,1,1,1,1,2,2,2], query_pos [0,1,0,1,2,3,4,0,1,2]
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)
        cu_num_tokens = np.cumsum(num_scheduled)
        query_pos = self.arange_np[:total] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs]
        positions = num_computed[req_indices] + query_pos
        token_indices = torch.from_numpy(req_indices * self.max_model_len + positions)
        input_ids = torch.index_select(batch.token_ids_cpu_tensor.flatten(), 0, token_indices)
        slots = batch.block_table.compute_slot_mapping(req_indices, positions)

        seq_lens = (num_computed + num_scheduled).astype(np.int32)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        query_start_loc[1:] = cu_num_tokens
        # Only requests whose every known token is computed after this step sample;
        # a partial prefill chunk samples nothing.
        sample_rows = np.flatnonzero(seq_lens == batch.num_tokens[:num_reqs])
        logits_indices = cu_num_tokens[sample_rows] - 1

        to_device = self._to_device
        metadata = AttentionMetadata(
            num_actual_tokens=total,
            query_start_loc=to_device(query_start_loc),
            seq_lens=to_device(seq_lens),
            block_table=batch.block_table.commit(num_reqs),
            slot_mapping=to_device(slots),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(input_ids=input_ids.to(self.device, non_blocking=True),
                          positions=to_device(positions), attn_metadata=metadata,
                          logits_indices=to_device(logits_indices), sample_rows=sample_rows,
                          num_scheduled_tokens=num_scheduled)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update state, forward all scheduled tokens, sample.

        Returns:
            Sampled tokens per scheduled request (empty for partial prefills).
        """
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        inputs = self._prepare_inputs(so)
        hidden_states = self._forward(inputs)

        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        prompt_logprobs = (self._compute_prompt_logprobs(hidden_states, inputs, req_ids)
                           if batch.prompt_logprobs_req_ids else {})
        # CachedRequestState.num_computed_tokens is not advanced here: it is only read
        # when a row is (re)added, and _update_states sets it from the scheduler first.
        batch.num_computed_tokens_cpu[:num_reqs] = inputs.attn_metadata.seq_lens_cpu

        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: list[list[TokenLogprobs] | None] | None = None
        sample_rows = inputs.sample_rows
        if len(sample_rows):
            logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
            metadata = batch.make_sampling_metadata(sample_rows)
            sampler_output = self.sampler(logits, metadata)
            sampled = sampler_output.sampled_token_ids.tolist()
            batch.append_sampled_tokens(sample_rows, sampled)
            for row, token_id in zip(sample_rows.tolist(), sampled, strict=True):
                sampled_token_ids[row] = [token_id]
            if sampler_output.logprobs is not None:
                asked = [batch.states[r].sampling_params.logprobs for r in sample_rows.tolist()]
                logprobs = [None] * num_reqs
                per_row = sampler_output.logprobs.to_lists(asked)
                for row, entry in zip(sample_rows.tolist(), per_row, strict=True):
                    logprobs[row] = None if entry is None else [entry]
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled_token_ids, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """``[T, hidden_size]``: a replayed CUDA graph for decode-only steps, else eager."""
        metadata = inputs.attn_metadata
        if self.cuda_graphs is not None and metadata.max_query_len == 1:
            hidden_states = self.cuda_graphs.run(inputs.input_ids, inputs.positions, metadata.slot_mapping,
                                                 metadata.seq_lens, metadata.block_table)
            if hidden_states is not None:
                return hidden_states
        # See engine.model.cpu_threads: small steps' elementwise ops are not worth a barrier.
        serial = self.device.type == "cpu" and len(inputs.input_ids) <= SERIAL_ELEMENTWISE_MAX_TOKENS
        with serial_elementwise(serial):
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, metadata)

    def _compute_prompt_logprobs(self, hidden_states: torch.Tensor, inputs: StepInputs,
                                 req_ids: list[str]) -> dict[str, list[TokenLogprobs | None]]:
        """Logprobs of the prompt tokens this step computes, for requests that ask for them.

        The logits at position p score the token at p + 1; position 0 has none.
        Positions already reported (before a preemption) are skipped.
        """
        result: dict[str, list[TokenLogprobs | None]] = {}
        starts = inputs.attn_metadata.query_start_loc_cpu
        for row, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            chunk_start = int(self.input_batch.num_computed_tokens_cpu[row])
            first = max(chunk_start, state.num_prompt_logprobs_done)
            last = min(chunk_start + int(inputs.num_scheduled_tokens[row]), num_prompt - 1)  # exclusive
            if k is None or first >= num_prompt or (first >= last and first > 0):
                continue
            entries: list[TokenLogprobs | None] = [None] if first == 0 else []
            offset = starts[row] + first - chunk_start
            # In slices: a whole chunk's fp32 logits over the vocabulary can take gigabytes.
            for lo in range(first, last, _PROMPT_LOGPROBS_ROWS):
                hi = min(lo + _PROMPT_LOGPROBS_ROWS, last)
                hidden = hidden_states[offset + lo - first:offset + hi - first]
                logprobs = torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)
                targets = torch.tensor(state.prompt_token_ids[lo + 1:hi + 1], device=logprobs.device)
                entries += compute_logprobs_tensors(logprobs, targets, k).to_lists([k] * (hi - lo))
            state.num_prompt_logprobs_done = max(last, 1)
            result[req_id] = entries
        return result

@torch.inference_mode()
def profile_forward(model: torch.nn.Module, num_tokens: int, num_seqs: int, max_model_len: int,
                    block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Run the largest step the engine will ever run, so the allocator's peak includes activations.

    ``num_tokens`` prompt tokens are split into up to ``num_seqs`` sequences of at
    most ``max_model_len - 1`` tokens, against a throwaway KV cache just large
    enough for them; logits are computed for ``num_seqs`` rows as the sampler would.
    """
    seq_len = max(1, min(max_model_len - 1, -(-num_tokens // num_seqs)))
    query_lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = blocks_per_seq * len(query_lens) + 1
    kv_caches = [torch.zeros((2, num_blocks, block_size, model.num_kv_heads, model.head_dim), dtype=dtype,
                             device=device) for _ in range(model.num_layers)]
    query_lens_np = np.array(query_lens, dtype=np.int64)
    req_indices = np.repeat(np.arange(len(query_lens)), query_lens_np)
    cu = np.cumsum(query_lens_np)
    positions = np.arange(num_tokens) - np.repeat(cu - query_lens_np, query_lens_np)
    block_table = 1 + np.arange(len(query_lens) * blocks_per_seq, dtype=np.int32).reshape(len(query_lens), -1)
    slots = slot_mapping(block_table, block_size, req_indices, positions)
    query_start_loc = np.concatenate([[0], cu]).astype(np.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(query_lens_np.astype(np.int32)).to(device),
        block_table=torch.from_numpy(block_table).to(device), slot_mapping=torch.from_numpy(slots).to(device),
        max_query_len=max(query_lens), max_seq_len=max(query_lens), query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=query_lens_np.astype(np.int32))
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden_states = model(input_ids, torch.from_numpy(positions).to(device), kv_caches, metadata)
    model.compute_logits(hidden_states[:num_seqs])
    del kv_caches, hidden_states
