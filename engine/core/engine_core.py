"""``EngineCore``: the scheduler and the model runner joined into one step function.

``step()`` is ``schedule() -> execute_model() -> update_from_output()``; the
caller (``LLM`` or ``AsyncLLM``'s engine thread) applies new requests and
aborts between steps.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.config import CacheConfig, EngineArgs, SchedulerConfig
from engine.core.scheduler import Scheduler, SchedulerStats
from engine.generation_config import load_generation_defaults
from engine.model.loader import (
    gguf_cache_folder,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from engine.outputs import EngineCoreOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.worker.host_resources import limit_threads_to_cpu_quota
from engine.worker.kv_cache import (
    allocate_kv_caches,
    available_cuda_kv_bytes,
    default_cpu_kv_cache_bytes,
    kv_cache_bytes_per_block,
    num_blocks_for_memory,
)
from engine.worker.model_runner import ModelRunner, profile_forward

logger = logging.getLogger(__name__)


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


class EngineCore:
    """Loads the model and owns the scheduler and the model runner.

    Args:
        args: engine arguments.

    Raises:
        ValueError: on arguments the model cannot honour (e.g. ``max_model_len``
            beyond the model's positions).
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        source = gguf_cache_folder(resolve_model_path(args.model))
        self.model_name = args.served_model_name or source.display_name
        self.hf_config = load_hf_config(source)
        self.tokenizer = load_tokenizer(source)
        # Defaults for the sampling fields a request leaves unset (the server applies them, as vLLM's does).
        self.default_sampling_params = load_generation_defaults(source.path, args.generation_config)
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":
            limit_threads_to_cpu_quota()
        dtype = resolve_dtype(args.dtype, self.device)
        self.max_model_len = self._resolve_max_model_len(args)
        attn_backend = "triton" if self.device.type == "cuda" else "cpu"
        model = load_model(source, self.hf_config, dtype, self.device, attn_backend=attn_backend)
        self.vocab_size = model.vocab_size
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else getattr(self.hf_config, "eos_token_id", None)

        max_num_batched_tokens = max(args.max_num_batched_tokens, args.max_num_seqs)
        bytes_per_block = kv_cache_bytes_per_block(model.num_layers, args.block_size, model.num_kv_heads,
                                                   model.head_dim, dtype)
        num_blocks = self._num_kv_blocks(model, dtype, max_num_batched_tokens, bytes_per_block)
        logger.info("allocating the KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB), "
                    "max %.1f requests of max_model_len",
                    num_blocks - 1, args.block_size, (num_blocks - 1) * args.block_size,
                    num_blocks * bytes_per_block / 2**20,
                    (num_blocks - 1) * args.block_size / self.max_model_len)
        kv_caches = allocate_kv_caches(model.num_layers, num_blocks, args.block_size, model.num_kv_heads,
                                       model.head_dim, dtype, self.device)
        self.model_runner = ModelRunner(model, kv_caches, args.max_num_seqs, self.max_model_len,
                                        max_num_batched_tokens, args.block_size, self.vocab_size, self.device,
                                        args.seed, args.enforce_eager)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, max_num_batched_tokens, self.max_model_len,
                            args.long_prefill_token_threshold),
            CacheConfig(num_blocks, args.block_size, args.enable_prefix_caching))

    def _resolve_max_model_len(self, args: EngineArgs) -> int:
        model_max = getattr(self.hf_config, "max_position_embeddings", None)
        if args.max_model_len is None:
            if model_max is None:
                raise ValueError("the model config has no max_position_embeddings: set max_model_len")
            return model_max
        if model_max is not None and args.max_model_len > model_max:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_max}")
        return args.max_model_len

    def _num_kv_blocks(self, model: torch.nn.Module, dtype: torch.dtype, max_num_batched_tokens: int,
                       bytes_per_block: int) -> int:
        args = self.args
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override
        if args.kv_cache_memory_bytes is not None:
            memory = args.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            profile_forward(model, max_num_batched_tokens, args.max_num_seqs, self.max_model_len, args.block_size,
                            dtype, self.device)
            torch.cuda.empty_cache()
            memory = available_cuda_kv_bytes(self.device, args.gpu_memory_utilization)
        else:
            memory = default_cpu_kv_cache_bytes()
        num_blocks = num_blocks_for_memory(memory, bytes_per_block)
        self._check_kv_cache_holds_one_request(num_blocks, bytes_per_block)
        return num_blocks

    def _check_kv_cache_holds_one_request(self, num_blocks: int, bytes_per_block: int) -> None:
        """Refuse a KV cache that cannot hold one request of ``max_model_len`` tokens, naming the
        largest ``max_model_len`` it can hold (block 0 is the null block)."""
        block_size = self.args.block_size
        needed = -(-self.max_model_len // block_size)
        if num_blocks - 1 < needed:
            raise ValueError(
                f"the KV cache ({(num_blocks - 1) * bytes_per_block / 2**20:.0f} MiB, {num_blocks - 1} blocks) "
                f"cannot hold one request of max_model_len {self.max_model_len} tokens, which needs "
                f"{needed * bytes_per_block / 2**20:.0f} MiB; give it more memory (kv_cache_memory_bytes, "
                f"gpu_memory_utilization, the container's memory limit) or set max_model_len to at most "
                f"{(num_blocks - 1) * block_size}")

    # ------------------------------------------------------------------ requests

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject a request the engine could never run, before it is queued.

        Thread-safe (reads only immutable configuration).

        Raises:
            ValueError: empty prompt, token ids (prompt, stop, bias) outside the vocabulary, prompt
                too long for ``max_model_len`` or the KV cache, too many logprobs.
        """
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        for name, token_ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                                ("logit_bias", list(params.logit_bias or ()))):
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.args.max_logprobs:
                raise ValueError(f"{name} must be <= {self.args.max_logprobs} (max_logprobs), got {value}")
        self.scheduler.check_request(len(prompt_token_ids), params.max_tokens)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request (``params.n`` must be 1: the frontend fans out ``n``).

        Raises:
            ValueError: see ``check_request``; also a request id already in use.
        """
        self.check_request(prompt_token_ids, params)
        self.scheduler.add_request(Request(request_id, prompt_token_ids, params, self.eos_token_id,
                                           self.args.block_size, arrival_time or time.time()))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests now and free their blocks; unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run and account one step. Returns the requests' new tokens."""
        if not self.scheduler.has_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()
