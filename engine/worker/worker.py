"""The worker: one device, the model on it, and the KV cache it can hold.

docs/architecture.md, "The executor and the worker", describes it.

The executor drives it in this order: ``init_device`` -> ``load_model`` ->
``determine_available_memory`` / ``kv_cache_bytes_per_block`` (the engine core
turns them into a block count) -> ``initialize_kv_cache`` -> per step
``execute_model`` then ``sample_tokens``. A tensor-parallel executor runs one
worker per rank, each in its own process, with the same calls: every rank
computes the same logits (the LM head is gathered) and samples the same
tokens (the same seed, the same ops in the same order), so each keeps its own
persistent batch in step without the ranks exchanging tokens.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.distributed as dist

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.model.attention import AttentionMetadata, check_attention_backend
from pagedserve.engine.model.loader import load_model, model_weights_source, resolve_dtype
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.registry import CausalLM
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.engine.worker.block_table import slot_mapping
from pagedserve.engine.worker.host_resources import limit_threads_to_cpu_quota
from pagedserve.engine.worker.kv_cache import (
    allocate_kv_caches,
    available_cuda_kv_bytes,
    default_cpu_kv_cache_bytes,
    kv_cache_bytes_per_block,
)
from pagedserve.engine.worker.lora_manager import LoRAManager
from pagedserve.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: ``attention_backend: auto`` on each device type.
DEFAULT_ATTENTION_BACKENDS = {"cpu": "cpu", "cuda": "triton"}


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU.

    Raises:
        ValueError: when ``cuda`` is asked for and none is available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(device)


class Worker:
    """Owns the device, the model, memory profiling and the KV cache of one rank.

    Args:
        config: the engine's resolved configuration.
        rank: this worker's tensor-parallel rank, in ``[0, tensor_parallel_size)``.
        distributed_init_method: the ``torch.distributed`` rendezvous (``file://...`` or
            ``tcp://host:port``) shared by the ranks; needed when ``tensor_parallel_size > 1``.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.tp = TensorParallel(rank, config.args.tensor_parallel_size)
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.attention_backend: str | None = None
        self.model: CausalLM | None = None
        self.model_runner: ModelRunner | None = None
        self.lora: LoRAManager | None = None  # --enable-lora: the adapter slots, attached to the model

    def init_device(self) -> None:
        """Pick the device, the dtype and the attention backend; on CPU, size torch's threads to the cgroup
        (shared evenly by the ranks); with several ranks, join their process group.

        Raises:
            ValueError: no CUDA device when one is asked for, or fewer than the ranks; an unknown dtype;
                an attention backend that does not run on the device.
        """
        args = self.config.args
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":
            threads = limit_threads_to_cpu_quota()
            if self.tp.size > 1 and "OMP_NUM_THREADS" not in os.environ:
                # The ranks run at once: more threads than cores would make every barrier wait.
                torch.set_num_threads(max(1, threads // self.tp.size))
                logger.info("rank %d of %d: %d torch threads", self.tp.rank, self.tp.size,
                            torch.get_num_threads())
        elif self.tp.size > 1:
            if torch.cuda.device_count() < self.tp.size:
                raise ValueError(f"tensor_parallel_size {self.tp.size} needs as many CUDA devices; torch sees "
                                 f"{torch.cuda.device_count()}")
            self.device = torch.device("cuda", self.tp.rank)
            torch.cuda.set_device(self.device)
        if self.tp.size > 1:
            cuda = self.device.type == "cuda"
            # device_id binds NCCL's communicator to this rank's device and creates it now, not mid-step.
            dist.init_process_group("nccl" if cuda else "gloo", init_method=self.distributed_init_method,
                                    rank=self.tp.rank, world_size=self.tp.size,
                                    device_id=self.device if cuda else None)
        self.dtype = resolve_dtype(args.dtype, self.device)
        backend = args.attention_backend
        if backend == "auto":
            backend = DEFAULT_ATTENTION_BACKENDS[self.device.type]
        check_attention_backend(backend, self.device)
        self.attention_backend = backend

    def load_model(self) -> None:
        model_config = self.config.model_config
        self.model = load_model(model_weights_source(model_config), model_config.hf_config, self.dtype, self.device,
                                attn_backend=self.attention_backend, block_size=self.config.cache_config.block_size,
                                tp=self.tp, quantization=model_config.quantization)
        # The adapter slots are allocated now, before the KV cache is sized from what memory is left.
        self.lora = None if self.config.lora_config is None else LoRAManager(
            self.model, self.config.lora_config, self.dtype, self.device, triton=self.attention_backend == "triton")

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes across all layers (keys and values)."""
        model = self.model
        return kv_cache_bytes_per_block(model.num_layers, self.config.cache_config.block_size, model.num_kv_heads,
                                        model.head_dim, self.dtype)

    def determine_available_memory(self) -> int:
        """Bytes this rank's KV cache may take: ``kv_cache_memory_bytes``; on CUDA what
        ``gpu_memory_utilization`` leaves after the weights and the largest step's activations; on CPU
        ``default_cpu_kv_cache_bytes`` shared by the ranks (they share the host's memory)."""
        args = self.config.args
        if args.kv_cache_memory_bytes is not None:
            return args.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return default_cpu_kv_cache_bytes() // self.tp.size
        torch.cuda.reset_peak_memory_stats(self.device)
        scheduler_config = self.config.scheduler_config
        profile_forward(self.model, scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs,
                        scheduler_config.max_model_len, self.config.cache_config.block_size, self.dtype,
                        self.device)
        torch.cuda.empty_cache()
        return available_cuda_kv_bytes(self.device, args.gpu_memory_utilization)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks per layer and build the model runner over them."""
        model = self.model
        kv_caches = allocate_kv_caches(model.num_layers, num_blocks, self.config.cache_config.block_size,
                                       model.num_kv_heads, model.head_dim, self.dtype, self.device)
        self.model_runner = ModelRunner(self.config, model, kv_caches, self.device, self.lora)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        """Leave the process group (a no-op for a single rank)."""
        if self.tp.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def profile_forward(model: CausalLM, num_tokens: int, num_seqs: int, max_model_len: int,
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
    hidden_states = model(input_ids, torch.from_numpy(positions).to(device), kv_caches,
                          model.attn_backend.build_metadata(metadata))
    model.compute_logits(hidden_states[:num_seqs])
    del kv_caches, hidden_states
