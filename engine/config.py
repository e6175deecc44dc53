"""Engine configuration: the user's ``EngineArgs``, and the resolved configs each part reads.

Field names follow vLLM's engine arguments so that users can carry their
flags over unchanged. Each field's ``metadata`` holds the help text and unit
used by the CLI, the YAML loader and the README's configuration table.
``EngineConfig`` (vLLM's ``VllmConfig``) bundles what is resolved once from
them and the model: the frontend, the engine core and the workers all read it.

Data only: finding the model, converting a GGUF file and reading its files is
``pagedserve.engine.engine_factory``'s job (``resolve_engine_config``). This
module imports no torch: the scheduler side imports it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.lora.registry import LoRAModulePath
from pagedserve.engine.model.windows import uniform_sliding_window
from pagedserve.engine.pooling_params import PoolerConfig
from pagedserve.engine.reasoning import REASONING_FORMATS

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
}


def parse_size(value: int | str) -> int:
    """Parse a byte size such as ``2GiB``, ``512MB`` or ``1073741824``.

    Returns:
        The size in bytes.
    Raises:
        ValueError: when the text is not a number followed by a known unit.
    """
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"invalid size {value!r}: expected a number with an optional unit "
            f"(B, KB, MB, GB, KiB, MiB, GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def setting(default: Any, help: str, unit: str = "", choices: tuple | None = None) -> Any:
    """A dataclass field for a setting, whose metadata the CLI's flags and ``--help``, the YAML loader and the
    README's configuration table read (``pagedserve.server.config_table``).

    Args:
        default: the value when nobody sets it; a list is copied for each instance.
        help: one line on what it does, and what an empty value means.
        unit: what its number counts (``tokens``, ``bytes``, ``seconds``); empty for none.
        choices: the values it accepts, None (unset) included where allowed; None = any value of its type.
    """
    metadata = {"help": help, "unit": unit, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EngineArgs:
    """Every knob of the engine. See the README's configuration table."""

    model: str | None = setting(
        None, "Local HF folder, .gguf file or hub id; empty = the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = setting(
        None, "Model name reported by /v1/models and accepted in requests; empty = derived from model")
    dtype: str = setting(
        "auto", "Weight and activation dtype; auto = float32 on CPU, bfloat16 on CUDA",
        choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str | None = setting(
        None, "Weight quantization: gguf = keep a GGUF model's Q4_0/Q4_1/Q8_0 blocks as stored; int8 = int8 per "
        "output channel, int4 = 4-bit groups of 32, both made at load from any model (LM head left in dtype); "
        "empty = the weights in dtype", choices=(None, "gguf", "int8", "int4"))
    device: str = setting("auto", "Where the model runs; auto = CUDA when available",
                          choices=("auto", "cpu", "cuda"))
    seed: int = setting(0, "Seed for the random sampling of requests that set no seed")
    max_model_len: int | None = setting(
        None, "Longest sequence (prompt + output); empty = the model's max_position_embeddings", "tokens")
    max_num_seqs: int = setting(64, "Most requests running in one step", "requests")
    max_num_batched_tokens: int = setting(2048, "Token budget of one engine step; at least max_num_seqs", "tokens")
    block_size: int = setting(16, "Tokens per KV cache block", "tokens")
    enable_prefix_caching: bool = setting(True, "Reuse KV blocks of identical prompt prefixes")
    long_prefill_token_threshold: int = setting(
        0, "Longest prefill chunk of one request per step; 0 = only the step budget limits it", "tokens")
    num_gpu_blocks_override: int | None = setting(
        None, "Fixed number of KV cache blocks (any device); empty = sized from memory", "blocks")
    gpu_memory_utilization: float = setting(
        0.9, "Fraction of GPU memory the engine may use (weights, activations, KV cache)", "fraction")
    kv_cache_memory_bytes: int | str | None = setting(
        None, "KV cache size (e.g. 2GiB); empty = on CPU 2GiB or half the memory left after loading the weights "
        "(cgroup limit included) when that is less, on CUDA from gpu_memory_utilization", "bytes")
    attention_backend: str = setting(
        "auto", "Paged attention implementation: auto = cpu on CPU, triton on CUDA; cpu = C kernels for decodes "
        "and prefill chunks (CPU only); triton = Triton kernels (CUDA only); torch = the plain torch reference "
        "(either)",
        choices=("auto", "cpu", "torch", "triton"))
    enforce_eager: bool = setting(False, "Disable CUDA graphs")
    cpu_reserved_cores: int | None = setting(
        None, "CPU cores that small steps (at most 4 tokens: decoding a few requests) leave to the HTTP frontend, "
        "so that its per-token work does not preempt a kernel's threads between their barriers; larger steps use "
        "every thread. No change when the torch threads already leave them free, or with tensor parallelism. "
        "Empty = 1 when serving HTTP (AsyncLLM), 0 offline (LLM)", "cores")
    tensor_parallel_size: int = setting(
        1, "Processes the weights are split over (Megatron-style tensor parallelism): one per GPU on CUDA "
        "(NCCL), a share of the cores each on CPU (gloo); KV cache sizes are per process", "processes")
    max_logprobs: int = setting(20, "Most logprobs a request may ask for per token", "tokens")
    generation_config: str = setting(
        "auto", "Defaults for the sampling fields a request leaves unset: auto = the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as "
        "max_tokens), vllm or none = the engine's own, or a folder holding a generation_config.json")
    max_waiting_requests: int = setting(
        1024, "Waiting-queue length above which new requests get HTTP 429", "requests")
    max_stream_backlog_tokens: int = setting(
        16384, "Most output tokens a request may hold that its client has not read (all its choices together); a "
        "client further behind (one that stopped reading its stream) has its request aborted, freeing its KV "
        "blocks and memory", "tokens")
    step_record_buffer_size: int = setting(
        2048, "Step records kept for the dashboard (/dashboard, /v1/dashboard/*); 0 = no records", "steps")
    speculative_config: dict | str | None = setting(
        None, "Speculative decoding as a JSON object (a mapping in YAML) with vLLM's keys: method (ngram = "
        "prompt lookup), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max (default 5 each), "
        "disable_by_batch_size; empty = off")
    reasoning_parser: str | None = setting(
        None, "How the model writes its reasoning before its answer (vLLM's --reasoning-parser): deepseek_r1 = the "
        "reply starts inside <think> (the template opens it) and runs to </think>; qwen3 = an optional "
        "<think>...</think> first. Chat replies then carry it as reasoning_content (and reasoning), and structured "
        "output and tool-call grammars apply after it; empty = replies are all content",
        choices=(None, *REASONING_FORMATS))
    runner: str = setting(
        "generate", "What the model is served for (vLLM's --runner): generate = text (completions, chat, responses, "
        "messages); pooling = one vector per input (/v1/embeddings, /pooling), from its hidden states",
        choices=("generate", "pooling"))
    convert: str = setting(
        "auto", "How a decoder serves --runner pooling (vLLM's --convert): embed (auto, with pooling) = its last "
        "layer's hidden states, after the final norm, pooled by --pooler-config", choices=("auto", "embed"))
    pooler_config: dict | str | None = setting(
        None, "With --runner pooling, a JSON object (a mapping in YAML) with vLLM's keys: pooling_type (LAST, the "
        "default; MEAN; CLS = the first token) and normalize (true by default: unit-length vectors)")
    enable_lora: bool = setting(
        False, "Serve LoRA adapters beside the base model (vLLM's --enable-lora): a request names one as its model; "
        "requests of different adapters and of the base model share each step (docs/lora.md)")
    lora_modules: list[str] = setting(
        [], "Adapters to serve from the start, each a string: name=path to a PEFT folder, or vLLM's JSON form "
        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (quoted in YAML too); needs enable_lora")
    max_loras: int = setting(1, "Most distinct adapters in one step (the worker's adapter slots)", "adapters")
    max_lora_rank: int = setting(16, "Largest adapter rank served (the slots' size)")
    max_cpu_loras: int | None = setting(
        None, "Adapters the worker keeps read in memory (at least max_loras, the least recently used dropped first); "
        "empty = max_loras", "adapters")
    async_scheduling: bool = setting(
        False, "Plan each engine step while the worker runs the one before (vLLM's --async-scheduling): the "
        "scheduler counts the tokens being sampled as placeholders and the worker fills them in, which hides the "
        "scheduler's and the output path's time behind the forward pass. On 2 CPU cores: 6% faster per token with one "
        "stream, 9-13% fewer tokens per second with 16-64 (the overlap takes a core from the forward pass). With "
        "speculative_config, a step with drafts is waited for before the next is planned")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs",
                    "max_waiting_requests", "max_stream_backlog_tokens", "tensor_parallel_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to run one token per step.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.cpu_reserved_cores is not None and self.cpu_reserved_cores < 0:
            raise ValueError(f"cpu_reserved_cores must be >= 0, got {self.cpu_reserved_cores}")
        if self.step_record_buffer_size < 0:
            raise ValueError(f"step_record_buffer_size must be >= 0, got {self.step_record_buffer_size}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, "
                             f"got {self.long_prefill_token_threshold}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_size(self.kv_cache_memory_bytes)
        if isinstance(self.speculative_config, str):
            try:
                self.speculative_config = json.loads(self.speculative_config)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from err
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # validated here, resolved by EngineConfig
        if self.enable_lora:
            for name in ("max_loras", "max_lora_rank"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
            if self.runner == "pooling":
                raise ValueError("enable_lora is for --runner generate")
            for entry in self.lora_modules:
                LoRAModulePath.parse(entry)
        elif self.lora_modules:
            raise ValueError("lora_modules needs enable_lora")
        if self.runner == "pooling":
            PoolerConfig.parse(self.pooler_config)  # validated here, resolved by EngineConfig
            for name in ("speculative_config", "async_scheduling", "reasoning_parser"):
                if getattr(self, name):
                    raise ValueError(f"{name} is for generating; --runner pooling runs each prompt once")
        elif self.pooler_config is not None or self.convert != "auto":
            raise ValueError("pooler_config and convert are for --runner pooling")


#: ``speculative_config`` methods: ngram = prompt lookup (``pagedserve.engine.core.ngram_proposer``).
SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, resolved from ``EngineArgs.speculative_config`` (vLLM's keys and defaults).

    Attributes:
        method: where drafts come from: ``ngram`` (prompt lookup).
        num_speculative_tokens: most draft tokens per request per step (k).
        prompt_lookup_min, prompt_lookup_max: shortest and longest n-gram matched, in tokens.
        disable_by_batch_size: no drafts in a step with at least this many running requests; None = no limit.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, value: object) -> SpeculativeConfig:
        """Resolve the JSON object; as in vLLM, a missing prompt_lookup bound equals the other one, and
        both default to 5.

        Raises:
            ValueError: not an object, an unknown key, an unknown method, a missing num_speculative_tokens,
                a value that is not a positive integer, or prompt_lookup_min > prompt_lookup_max; the
                message names the field (``speculative_config.<key>``).
        """
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {', '.join(unknown)}; known keys: {', '.join(known)}")
        if value.get("method") not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                             f"got {value.get('method')!r}")
        if value.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        for key in known[1:]:
            item = value.get(key)
            if item is not None and (not isinstance(item, int) or isinstance(item, bool) or item < 1):
                raise ValueError(f"speculative_config.{key} must be an integer >= 1, got {item!r}")
        lookup_min = value.get("prompt_lookup_min") or value.get("prompt_lookup_max") or 5
        lookup_max = value.get("prompt_lookup_max") or lookup_min
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max "
                             f"({lookup_max})")
        return cls(method=value["method"], num_speculative_tokens=value["num_speculative_tokens"],
                   prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max,
                   disable_by_batch_size=value.get("disable_by_batch_size"))


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits, resolved from ``EngineArgs`` and the model."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False  # plan step N + 1 while step N runs (``Request.num_output_placeholders``)
    max_loras: int | None = None  # most distinct adapters among the running requests; None = no adapters

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache's shape, resolved from ``EngineArgs`` and memory.

    ``sliding_window``: the window every layer of the model shares (Mistral v0.1, Phi-3-mini), whose blocks wholly
    before it a request gives back as it goes; None (any layer attends to everything) keeps them all.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    sliding_window: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The model as the engine serves it, resolved once from ``EngineArgs``
    (``pagedserve.engine.engine_factory.resolve_model_config``).

    Attributes:
        path: a local HF folder (a GGUF file is converted to one once, see ``pagedserve.engine.model.loader``).
        served_model_name: the name clients use.
        hf_config: the transformers ``PretrainedConfig``.
        max_model_len: longest sequence, in tokens.
        vocab_size: rows of the logits.
        generation_defaults: ``SamplingParams`` field -> the model's default (``generation_config``).
        quantization: ``EngineArgs.quantization``.
        reasoning_parser: ``EngineArgs.reasoning_parser``.
        gguf_path: with ``quantization`` gguf, the GGUF file whose blocks the workers load (staged once,
            ``pagedserve.engine.model.loader.gguf_block_cache``; ``path`` serves the config and tokenizer only); else
            None, the weights are ``path``'s.
    """

    path: str
    served_model_name: str
    hf_config: Any
    max_model_len: int
    vocab_size: int
    generation_defaults: dict[str, Any]
    quantization: str | None = None
    gguf_path: str | None = None
    reasoning_parser: str | None = None


def max_model_len_for(requested: int | None, hf_config: Any) -> int:
    """The longest sequence served, in tokens: ``requested`` (``EngineArgs.max_model_len``), or the model's
    ``max_position_embeddings`` when that is None.

    A ``longrope`` model (Phi-3 128k, Phi-4-mini) serves up to its ``original_max_position_embeddings``: within
    it transformers rotates by the short factors, which a fixed rotary table holds; beyond it by the long ones
    for the whole sequence once it is longer, which no fixed table can.

    Raises:
        ValueError: ``requested`` beyond the model's positions, or neither set.
    """
    model_max = getattr(hf_config, "max_position_embeddings", None)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None)
        if original is not None and requested is not None and requested > original:
            raise ValueError(f"max_model_len {requested} exceeds original_max_position_embeddings {original}: "
                             "longrope's long factors (longer sequences) are not implemented")
        model_max = original if original is not None else model_max
    if requested is None:
        if model_max is None:
            raise ValueError("the model config has no max_position_embeddings: set max_model_len")
        return model_max
    if model_max is not None and requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {model_max}")
    return requested


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters' limits (``--enable-lora``): ``max_loras`` distinct adapters per step (the worker's slots), of
    rank at most ``max_lora_rank``; the worker keeps ``max_cpu_loras`` adapters read, the least recently used
    dropped first."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


@dataclass(frozen=True)
class EngineConfig:
    """Everything resolved for one engine (vLLM's ``VllmConfig``).

    ``cache_config.num_blocks`` is 0 until the engine core has measured the
    memory its executor can give the KV cache (``EngineCore``).
    """

    args: EngineArgs
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    speculative_config: SpeculativeConfig | None = None  # None = no speculative decoding
    pooler_config: PoolerConfig | None = None  # ``--runner pooling``'s; None = the generate runner
    lora_config: LoRAConfig | None = None  # None = no adapters (``--enable-lora`` off)

    @classmethod
    def for_model(cls, args: EngineArgs, model_config: ModelConfig) -> EngineConfig:
        """The configuration of ``args`` for the model they name, resolved into ``model_config``
        (``pagedserve.engine.engine_factory.resolve_engine_config`` does both)."""
        pooler_config = PoolerConfig.parse(args.pooler_config) if args.runner == "pooling" else None
        # A prompt served from the prefix cache is not run again: MEAN and CLS would miss its cached positions.
        # (LAST always runs the prompt's last token.)
        prefix_caching = args.enable_prefix_caching and (pooler_config is None or pooler_config.pooling_type == "LAST")
        return cls(args=args, model_config=model_config,
                   scheduler_config=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                                    model_config.max_model_len, args.long_prefill_token_threshold,
                                                    args.async_scheduling,
                                                    args.max_loras if args.enable_lora else None),
                   cache_config=CacheConfig(0, args.block_size, prefix_caching,
                                            uniform_sliding_window(model_config.hf_config)),
                   speculative_config=None if args.speculative_config is None
                   else SpeculativeConfig.from_dict(args.speculative_config),
                   pooler_config=pooler_config,
                   lora_config=LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras)
                   if args.enable_lora else None)
