"""The model runner: applies each ``SchedulerOutput`` to the persistent batch,
builds the flattened inputs, runs the forward pass (``execute_model``) and
then samples (``sample_tokens``), as two calls so that the step's grammar
masks can be computed between them (docs/architecture.md, "The executor and the worker").

Fault isolation: an exception raised by one request's own data fails that request alone. Its
state and row are dropped and it is reported in ``ModelRunnerOutput.failed_req_ids``; the others
run on. The stages that can blame a request are: creating or updating its state and placing it
in the persistent batch (``_update_states``), its row's inputs (``_fail_inconsistent_rows``), and
sampling (``_sample_isolating_faults``). The forward pass and logits cover every row at once, so
what they raise propagates and stops the engine.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.model.attention import AttentionMetadata
from pagedserve.engine.model.cpu_threads import serial_elementwise, small_step_threads, threads_at_most
from pagedserve.engine.model.registry import CausalLM
from pagedserve.engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, TokenLogprobs
from pagedserve.engine.profiling import region
from pagedserve.engine.worker.cuda_graph import CudaGraphRunner, capture_sizes
from pagedserve.engine.worker.host_resources import available_cores
from pagedserve.engine.worker.input_batch import CachedRequestState, InputBatch
from pagedserve.engine.worker.lora_manager import LoRAManager
from pagedserve.engine.worker.pooler import Pooler
from pagedserve.engine.worker.rejection_sampler import RejectionSampler
from pagedserve.engine.worker.sampler import Sampler, compute_logprobs_tensors

logger = logging.getLogger(__name__)

#: Prompt positions whose logprobs are computed at once (bounds the fp32 logits' memory).
_PROMPT_LOGPROBS_ROWS = 256
#: CPU steps of at most this many tokens run their elementwise ops on one thread. Above it (long
#: prefill chunks) each op has hundreds of thousands of elements and parallelising them pays.
SERIAL_ELEMENTWISE_MAX_TOKENS = 512
#: CPU steps of at most this many tokens leave ``cpu_reserved_cores`` to the frontend (``engine/model/cpu_threads.py``).
#: Measured in the server (SmolLM2 GGUF, 2 cores, 3 interleaved runs), output tok/s on one thread / on two:
#: 1.3-2.2x at 1 stream, 1.2-1.4x at 2, 0.9-1.1x at 4; at 16 streams and above two threads win.
RESERVED_CORES_MAX_TOKENS = 4


@dataclass
class StepInputs:
    """The flattened inputs of one step.

    Attributes:
        input_ids: ``[T]`` int64 token ids of every scheduled token, request after request.
        positions: ``[T]`` int64 position of each token in its sequence.
        attn_metadata: paged-attention layout, common to every backend.
        logits_indices: ``[L]`` indices into the T tokens of the positions scored this step: each
            sampling row's last token, or its last k + 1 for a row running k draft tokens.
        sample_rows: ``[S]`` batch rows that sample this step (their prefill is complete).
        num_scheduled_tokens: ``[num_reqs]`` tokens of each row this step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: np.ndarray
    num_scheduled_tokens: np.ndarray


@dataclass
class _PendingSample:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    logits: torch.Tensor       # [L, V] float32, rows as StepInputs.logits_indices
    sample_rows: np.ndarray    # [S] batch rows that sample
    output: ModelRunnerOutput  # the step's output, prompt logprobs filled, tokens to come


class ModelRunner:
    """Owns the persistent batch, the KV caches, the forward pass and sampling.

    Args:
        config: the engine's resolved configuration (batch and sequence limits, block size, seed).
        model: a model from ``pagedserve.engine.model.loader.load_model``.
        kv_caches: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.
        device: where the model runs.
        lora: the adapter slots attached to ``model`` (``--enable-lora``), else None.
    """

    def __init__(self, config: EngineConfig, model: CausalLM, kv_caches: list[torch.Tensor],
                 device: torch.device, lora: LoRAManager | None = None) -> None:
        scheduler_config = config.scheduler_config
        max_num_reqs, max_model_len = scheduler_config.max_num_seqs, scheduler_config.max_model_len
        block_size = config.cache_config.block_size
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.reserved_cores = config.args.cpu_reserved_cores or 0  # None (offline) reserves none
        # Intra-op threads of a small CPU step, None for as many as any other step.
        self.small_step_threads = small_step_threads(
            torch.get_num_threads(), available_cores(), self.reserved_cores,
            config.args.tensor_parallel_size) if device.type == "cpu" else None
        if self.small_step_threads is not None:
            logger.info("CPU steps of at most %d tokens run on %d of %d threads: %d core(s) left to the frontend "
                        "(cpu_reserved_cores)", RESERVED_CORES_MAX_TOKENS, self.small_step_threads,
                        torch.get_num_threads(), self.reserved_cores)
        self.max_model_len = max_model_len
        self.input_batch = InputBatch(max_num_reqs, max_model_len, -(-max_model_len // block_size), block_size,
                                      model.vocab_size, device, pin_memory=device.type == "cuda")
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        # --runner pooling: every request is pooled once its prompt has run; none samples.
        self.pooler = Pooler(config.pooler_config) if config.pooler_config is not None else None
        # --enable-lora: adapter slots in the targeted layers, filled per step.
        self.lora = lora
        self.arange_np = np.arange(max(scheduler_config.max_num_batched_tokens, max_num_reqs) + 1, dtype=np.int64)
        # What execute_model leaves for sample_tokens.
        self._pending: _PendingSample | None = None
        # Requests failed in the current step: id -> error (ModelRunnerOutput.failed_req_ids).
        self._failed: dict[str, str] = {}
        # ... and in the step before: with async scheduling the next plan was made before the scheduler heard.
        self._failed_before: set[str] = set()
        torch.manual_seed(config.args.seed)
        self.cuda_graphs: CudaGraphRunner | None = None
        if device.type == "cuda" and not config.args.enforce_eager:
            if not model.supports_cuda_graphs:
                logger.info("CUDA graphs are off: %s routes tokens to experts by their values (data-dependent "
                            "shapes a graph cannot replay)", type(model).__name__)
            elif model.attn_backend.supports_cuda_graphs:
                if self.lora is not None:  # the graphs run the adapters' Triton kernels on per-token segments
                    self.lora.mapping.allocate_graph_rows(max_num_reqs, device)
                self.cuda_graphs = CudaGraphRunner(
                    self._graph_forward, capture_sizes(max_num_reqs), self.input_batch.block_table.block_table.shape[1],
                    max_model_len, device)
                self.cuda_graphs.capture()
            else:
                logger.info("CUDA graphs are off: the %s attention backend cannot be captured",
                            type(model.attn_backend).__name__)

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        # Rows are kept only for the requests this step runs. Preempted requests, and running ones the
        # budget left out, keep their CachedRequestState (generator included) and come back later.
        for req_id in [r for r in batch.req_id_to_index if r not in so.num_scheduled_tokens]:
            batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for new in so.scheduled_new_reqs:
            try:
                to_add.append(self._add_new_state(new))
            except Exception as exc:  # noqa: BLE001 - e.g. a seed torch cannot take: fail this request only
                self._fail_request(new.req_id, repr(exc))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._failed_before:
                continue  # reported already; the scheduler drops it when that report arrives
            try:
                if self._update_cached_state(cached, i):
                    to_add.append(self.requests[req_id])
            except Exception as exc:  # noqa: BLE001 - fail this request only
                self._fail_request(req_id, repr(exc))
        for state in to_add:
            try:
                batch.add_request(state)
            except Exception as exc:  # noqa: BLE001 - e.g. a value the batch's arrays cannot hold
                self._fail_request(state.req_id, repr(exc))
        batch.condense()
        batch.set_draft_tokens({req_id: drafts for req_id, drafts in so.scheduled_spec_decode_tokens.items()
                                if req_id in batch.req_id_to_index})

    def _add_new_state(self, new: NewRequestData) -> CachedRequestState:
        """Create and keep the state of a request the worker has not seen.

        Raises:
            ValueError: a seed ``torch.Generator.manual_seed`` cannot take (it overflows past 2**64).
        """
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = CachedRequestState(new.req_id, list(new.prompt_token_ids), params, generator,
                                   list(new.block_ids), new.num_computed_tokens, pooling_params=new.pooling_params,
                                   lora_request=new.lora_request)
        self.requests[new.req_id] = state
        return state

    def _update_cached_state(self, cached: CachedRequestData, i: int) -> bool:
        """Apply entry ``i`` of the step's diffs to a known request. Returns whether it needs a row
        (resumed, or left out of the previous step)."""
        batch = self.input_batch
        req_id = cached.req_ids[i]
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
        if len(state.output_token_ids) != cached.num_output_tokens[i]:
            # With async scheduling the count includes the token this worker sampled last step, which the
            # step's input needs; any other difference is a bookkeeping fault, this request's alone.
            raise RuntimeError(f"the worker holds {len(state.output_token_ids)} output tokens of the request, "
                               f"the scheduler counts {cached.num_output_tokens[i]}")
        row = batch.req_id_to_index.get(req_id)
        if row is None:
            return True
        batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
        if new_block_ids and not resumed:
            batch.block_table.append_row(new_block_ids, row)
        return False

    def _fail_request(self, req_id: str, message: str) -> None:
        """Drop a request's state and row now, and report it failed for this step."""
        # With the traceback when called while handling the exception.
        logger.error("request %s failed on the worker: %s", req_id, message, exc_info=sys.exc_info()[1] is not None)
        self.requests.pop(req_id, None)
        self.input_batch.remove_request(req_id)
        self._failed[req_id] = message

    # ------------------------------------------------------------------ inputs

    def _num_scheduled_tokens(self, so: SchedulerOutput) -> np.ndarray:
        """``[num_reqs]`` tokens each row runs this step."""
        return np.array([so.num_scheduled_tokens[r] for r in self.input_batch.req_ids[:self.input_batch.num_reqs]],
                        dtype=np.int64)

    def _fail_inconsistent_rows(self, num_scheduled: np.ndarray) -> bool:
        """Fail the rows whose inputs cannot be built: no tokens, tokens past the row's known ones
        (drafts included), or positions past the blocks it holds. A bookkeeping fault in one
        request then fails it alone, instead of raising in the batched preparation, which no
        request can be blamed for. Returns whether any row failed (the batch is condensed then).
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        seq_lens = batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled
        num_known = batch.num_tokens[:num_reqs] + batch.num_draft_tokens[:num_reqs]
        num_slots = batch.block_table.num_blocks_per_row[:num_reqs].astype(np.int64) * batch.block_table.block_size
        bad_rows = np.flatnonzero((num_scheduled <= 0) | (seq_lens > num_known) | (seq_lens > num_slots))
        for row in bad_rows.tolist():
            self._fail_request(batch.req_ids[row], (
                f"inconsistent row: {int(num_scheduled[row])} tokens scheduled after "
                f"{int(batch.num_computed_tokens_cpu[row])} computed, but {int(num_known[row])} tokens known "
                f"and {int(num_slots[row])} KV slots held"))
        if len(bad_rows):
            batch.condense()
        return bool(len(bad_rows))

    def _row_adapters(self) -> list[LoRARequest | None]:
        """Each row's ``LoRARequest`` (None: the base model)."""
        batch = self.input_batch
        return [batch.states[row].lora_request for row in range(batch.num_reqs)]

    def _fail_unservable_adapters(self) -> bool:
        """Fail the rows whose adapter cannot be read or fit (its folder changed since it was loaded); returns
        whether any did (the batch is condensed then)."""
        batch, loras = self.input_batch, self._row_adapters()
        errors = self.lora.failing(loras)
        bad = [(batch.req_ids[row], errors[lora.lora_int_id]) for row, lora in enumerate(loras)
               if lora is not None and lora.lora_int_id in errors]
        for req_id, message in bad:
            self._fail_request(req_id, message)
        if bad:
            batch.condense()
        return bool(bad)

    def _prepare_inputs(self, num_scheduled: np.ndarray) -> StepInputs:
        """The step's flat inputs from the persistent batch, ``num_scheduled`` tokens per row."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
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
        # Only requests whose every known token (drafts included) is computed after this
        # step sample; a partial prefill chunk samples nothing.
        num_drafts = batch.num_draft_tokens[:num_reqs]
        sample_rows = np.flatnonzero(seq_lens == batch.num_tokens[:num_reqs] + num_drafts)
        # A request with k drafts is scored at its last k + 1 positions, in order.
        num_scored = num_drafts[sample_rows] + 1
        logits_indices = (np.repeat(cu_num_tokens[sample_rows] - num_scored, num_scored)
                          + self.arange_np[:int(num_scored.sum())]
                          - np.repeat(np.cumsum(num_scored) - num_scored, num_scored))

        to_device = self._to_device
        common = AttentionMetadata(
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
                          positions=to_device(positions), attn_metadata=common,
                          logits_indices=to_device(logits_indices), sample_rows=sample_rows,
                          num_scheduled_tokens=num_scheduled)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's plan to the persistent batch and run the forward pass.

        Returns:
            None when rows sample this step (their logits are kept for ``sample_tokens``);
            otherwise the step's whole output (a cleanup step, only partial prefills, or a pooling runner's
            step, with the vectors of the prompts it completed).
        """
        self._failed_before, self._failed = set(self._failed), {}
        with region("model_runner.update_states"):
            self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        with region("model_runner.prepare_inputs"):
            num_scheduled = self._num_scheduled_tokens(so)
            if self._fail_inconsistent_rows(num_scheduled):
                num_scheduled = self._num_scheduled_tokens(so)
            if self.lora is not None and self._fail_unservable_adapters():
                num_scheduled = self._num_scheduled_tokens(so)
            if batch.num_reqs == 0:  # every scheduled request failed
                return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                         failed_req_ids=self._failed)
            inputs = self._prepare_inputs(num_scheduled)
            if self.lora is not None:
                self.lora.set_step(self._row_adapters(), num_scheduled)
        with region("model_runner.forward"), self._threads_for(len(inputs.input_ids)):
            hidden_states = self._forward(inputs)

        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        prompt_logprobs = (self._compute_prompt_logprobs(hidden_states, inputs, req_ids)
                           if batch.prompt_logprobs_req_ids else {})
        common = inputs.attn_metadata
        pooled = {} if self.pooler is None else self.pooler(
            hidden_states, [batch.states[row] for row in range(num_reqs)], common.query_start_loc_cpu,
            common.seq_lens_cpu - inputs.num_scheduled_tokens)
        # CachedRequestState.num_computed_tokens is not advanced here: it is only read
        # when a row is (re)added, and _update_states sets it from the scheduler first.
        batch.num_computed_tokens_cpu[:num_reqs] = inputs.attn_metadata.seq_lens_cpu
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[[] for _ in range(num_reqs)], prompt_logprobs=prompt_logprobs,
                                   failed_req_ids=self._failed, pooler_output=pooled)
        if self.pooler is not None or not len(inputs.sample_rows):  # a pooling runner samples nothing
            return output
        with region("model_runner.compute_logits"), self._threads_for(len(inputs.input_ids)):
            logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
        self._pending = _PendingSample(logits, inputs.sample_rows, output)
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the rows ``execute_model`` left logits for, within the step's grammar masks.

        Returns:
            The step's output: 1 token per sampling request, or 1..k+1 for one with k drafts;
            rows whose sampling raised on their own are in its ``failed_req_ids``.

        Raises:
            RuntimeError: when the last ``execute_model`` left nothing to sample.
        """
        if self._pending is None:
            raise RuntimeError("sample_tokens() needs an execute_model() that returned None first")
        pending, self._pending = self._pending, None
        batch = self.input_batch
        output = pending.output
        with region("model_runner.sample"):
            sample_rows, sampled, logprobs = self._sample_isolating_faults(pending.logits, pending.sample_rows,
                                                                           grammar_output)
        rows = sample_rows.tolist()
        batch.append_sampled_tokens(sample_rows, sampled)
        for row, tokens in zip(rows, sampled, strict=True):
            output.sampled_token_ids[row] = tokens
        if logprobs is not None:
            output.logprobs = [None] * len(output.req_ids)
            for row, entries in zip(rows, logprobs, strict=True):
                output.logprobs[row] = entries
        return output

    def _sample_isolating_faults(self, logits: torch.Tensor, sample_rows: np.ndarray,
                                 grammar_output: GrammarOutput | None
                                 ) -> tuple[np.ndarray, list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Sample every row at once; when that raises, sample row by row and fail the rows that raise alone.

        The rows that survive get the tokens and logprobs the batch would have given them when they
        are greedy or seeded: the seeded rows' generators are rewound to their state before the
        batched try. Unseeded random rows draw again from the global RNG.

        Returns:
            The rows that sampled, their tokens and their logprobs (None when no row asks).
        """
        if grammar_output is not None and self.input_batch.num_draft_tokens[sample_rows].any():
            # Constrained rows sample under their masks and drafting rows through the rejection
            # sampler, which takes no mask (the scheduler gives constrained requests no drafts).
            return self._sample_row_by_row(logits, sample_rows, grammar_output)
        generator_states = [(g, g.get_state()) for g in self.input_batch.generators_by_request(sample_rows).values()]
        try:
            return sample_rows, *self._sample_batch(logits, sample_rows, grammar_output)
        except Exception:  # noqa: BLE001 - find and fail the rows at fault below
            logger.warning("sampling %d rows failed; sampling them one by one", len(sample_rows), exc_info=True)
        for generator, state in generator_states:
            generator.set_state(state)
        return self._sample_row_by_row(logits, sample_rows, grammar_output)

    def _sample_row_by_row(self, logits: torch.Tensor, sample_rows: np.ndarray, grammar_output: GrammarOutput | None
                           ) -> tuple[np.ndarray, list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Sample each row alone (its k + 1 logits rows when it runs k drafts); fail the rows that raise."""
        ends = np.cumsum(self.input_batch.num_draft_tokens[sample_rows] + 1).tolist()
        kept, sampled, logprobs = [], [], []
        for i, row in enumerate(sample_rows.tolist()):
            start = ends[i - 1] if i else 0
            try:
                tokens, row_logprobs = self._sample_batch(logits[start:ends[i]], sample_rows[i:i + 1], grammar_output)
            except Exception as exc:  # noqa: BLE001 - this row's own fault
                self._fail_request(self.input_batch.req_ids[row], repr(exc))
                continue
            kept.append(row)
            sampled += tokens
            logprobs.append(None if row_logprobs is None else row_logprobs[0])
        has_logprobs = any(entry is not None for entry in logprobs)
        return np.array(kept, dtype=np.int64), sampled, logprobs if has_logprobs else None

    def _sample_batch(self, logits: torch.Tensor, sample_rows: np.ndarray, grammar_output: GrammarOutput | None
                      ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Tokens of ``sample_rows`` (by the rejection sampler when any runs drafts), and logprobs when asked."""
        if self.input_batch.num_draft_tokens[sample_rows].any():
            return self._verify_drafts(logits, sample_rows, grammar_output)
        return self._sample(logits, sample_rows, grammar_output)

    def _sample(self, logits: torch.Tensor, sample_rows: np.ndarray, grammar_output: GrammarOutput | None
                ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """One token per row, and its logprobs when any row asks."""
        batch = self.input_batch
        metadata = batch.make_sampling_metadata(sample_rows)
        if grammar_output is not None:
            metadata.allowed_token_bitmask, metadata.constrained_rows = self._bitmask_rows(
                grammar_output, sample_rows)
        sampler_output = self.sampler(logits, metadata)
        sampled = [[token_id] for token_id in sampler_output.sampled_token_ids.tolist()]
        if sampler_output.logprobs is None:
            return sampled, None
        asked = [batch.states[r].sampling_params.logprobs for r in sample_rows.tolist()]
        return sampled, [None if entry is None else [entry] for entry in sampler_output.logprobs.to_lists(asked)]

    def _verify_drafts(self, logits: torch.Tensor, sample_rows: np.ndarray, grammar_output: GrammarOutput | None
                       ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """1..k+1 tokens per row from its k drafts (the rejection sampler), and their logprobs when asked.

        Raises:
            ValueError: when a constrained request runs drafts (grammars advance one token per step).
        """
        batch = self.input_batch
        constrained = set(grammar_output.structured_output_request_ids) if grammar_output is not None else set()
        if constrained.intersection(batch.req_ids[row] for row in sample_rows.tolist()):
            raise ValueError("draft tokens for requests with a grammar are not supported")
        metadata = batch.make_sampling_metadata(sample_rows, per_position=True)
        result = self.rejection_sampler(logits, metadata, batch.draft_token_ids(sample_rows),
                                        batch.generators_by_request(sample_rows))
        if result.logprobs is None:
            return result.sampled_token_ids, None
        asked = [batch.states[r].sampling_params.logprobs for r in sample_rows.tolist()]
        return result.sampled_token_ids, result.logprobs_per_request(asked)

    def _bitmask_rows(self, grammar_output: GrammarOutput, sample_rows: np.ndarray
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The grammar's bitmask rows that sample this step, and their rows in the step's logits."""
        logits_row = {self.input_batch.req_ids[row]: i for i, row in enumerate(sample_rows.tolist())}
        keep = [(i, logits_row[r]) for i, r in enumerate(grammar_output.structured_output_request_ids)
                if r in logits_row]
        bitmask_index = [i for i, _ in keep]
        bitmask = torch.from_numpy(grammar_output.grammar_bitmask[bitmask_index]).to(self.device)
        return bitmask, torch.tensor([row for _, row in keep], dtype=torch.int64, device=self.device)

    def _threads_for(self, num_tokens: int) -> contextlib.AbstractContextManager[None]:
        """The CPU thread policy of a step of ``num_tokens`` tokens: small ones leave cores to the frontend."""
        small = num_tokens <= RESERVED_CORES_MAX_TOKENS
        return threads_at_most(self.small_step_threads) if small else contextlib.nullcontext()

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       metadata: AttentionMetadata) -> torch.Tensor:
        """The forward a CUDA graph captures: with adapters, their kernels read the static per-token rows."""
        if self.lora is not None:
            self.lora.mapping.capture_rows(len(input_ids))
        return self.model(input_ids, positions, self.kv_caches, self.model.attn_backend.build_metadata(metadata))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """``[T, hidden_size]``: for decode-only steps a replayed CUDA graph, or the model's fused CPU path
        (``CausalLM.decode_forward``); else eager, layer by layer."""
        common = inputs.attn_metadata
        if self.cuda_graphs is not None and common.max_query_len == 1:
            hidden_states = self.cuda_graphs.run(inputs.input_ids, inputs.positions, common.slot_mapping,
                                                 common.seq_lens, common.block_table)
            if hidden_states is not None:
                return hidden_states
        if self.lora is not None and self.lora.mapping.active:
            return self._forward_eager(inputs)  # the fused CPU decode was built without adapters
        if (self.device.type == "cpu" and common.max_query_len == 1
                and (hidden_states := self.model.decode_forward(inputs.input_ids, inputs.positions, self.kv_caches,
                                                                common)) is not None):
            return hidden_states
        return self._forward_eager(inputs)

    def _forward_eager(self, inputs: StepInputs) -> torch.Tensor:
        metadata = self.model.attn_backend.build_metadata(inputs.attn_metadata)
        # See pagedserve.engine.model.cpu_threads: small steps' elementwise ops are not worth a barrier.
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
