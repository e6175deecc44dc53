"""Build what ``LLM`` and ``AsyncLLM`` drive from ``EngineArgs``: resolve the model and the configuration, then
build the engine core and the input processor that feeds it.

Resolving is where the files are: the model is found (a local folder or file, the embedded package, the hub's
cache or a download), a GGUF file is converted once into the cache, and the model's config and generation
defaults are read. ``pagedserve.engine.config`` holds the result, as data.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from pagedserve.engine.config import EngineArgs, EngineConfig, ModelConfig, max_model_len_for
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.generation_config import load_generation_defaults
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.model.loader import (
    ModelSource,
    check_quantization,
    check_tensor_parallel_split,
    gguf_block_cache,
    gguf_cache_folder,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)
from pagedserve.engine.reasoning import ReasoningTokens, reasoning_format
from pagedserve.engine.structured_output import GrammarCompiler, GuidanceManager


class LoadedEngine(NamedTuple):
    """An engine core and its input processor, sharing one grammar compiler: the processor compiles
    (and so validates) each request's grammar before queueing it, and the core's manager finds it cached."""

    engine_core: EngineCore
    processor: InputProcessor


def resolve_model_config(args: EngineArgs) -> ModelConfig:
    """Find the model, convert a GGUF file once, read its config and generation defaults.

    Raises:
        ValueError: a model that cannot be found, ``max_model_len`` beyond the model's positions,
            heads that do not split over ``tensor_parallel_size`` ranks, or a ``quantization`` the model
            or its split cannot take.
        OSError: model files that cannot be read, a cache that cannot be written.
    """
    model = resolve_model_path(args.model)
    gguf = args.quantization == "gguf"
    # With gguf the workers load the GGUF's blocks: the converted folder needs no dequantized weights.
    source = gguf_cache_folder(model, with_weights=not gguf)
    hf_config = load_hf_config(source)
    if args.tensor_parallel_size > 1:
        check_tensor_parallel_split(hf_config, args.tensor_parallel_size)
    check_quantization(hf_config, args.quantization, model, args.tensor_parallel_size)
    if gguf:
        gguf_block_cache(model, hf_config)  # staged once here, not by every tensor-parallel rank at once
    return ModelConfig(path=source.path, served_model_name=args.served_model_name or source.display_name,
                       hf_config=hf_config, max_model_len=max_model_len_for(args.max_model_len, hf_config),
                       vocab_size=hf_config.vocab_size,
                       generation_defaults=load_generation_defaults(source.path, args.generation_config),
                       quantization=args.quantization,
                       gguf_path=os.path.join(model.path, model.gguf_file) if gguf else None,
                       reasoning_parser=args.reasoning_parser)


def resolve_engine_config(args: EngineArgs) -> EngineConfig:
    """``args`` resolved against the model they name (``cache_config.num_blocks`` still 0: the engine core
    measures it), as ``resolve_model_config`` raises."""
    return EngineConfig.for_model(args, resolve_model_config(args))


def load_engine(args: EngineArgs) -> LoadedEngine:
    """Load the model and its tokenizer and allocate the KV cache (blocking, seconds).

    Raises:
        ValueError: a setting the model or the machine cannot honour (model not found, no CUDA,
            a KV cache too small for ``max_model_len``), naming it.
        OSError: model or tokenizer files that cannot be read, a cache that cannot be written.
    """
    engine_core, tokenizer, grammars = _build_engine_core(args)
    return LoadedEngine(engine_core, _processor(engine_core.config, tokenizer, grammars))


def load_engine_core(args: EngineArgs) -> EngineCore:
    """The engine core alone, with a grammar compiler of its own (the engine process's: its frontend has
    another), as ``load_engine`` raises."""
    return _build_engine_core(args)[0]


def _build_engine_core(args: EngineArgs) -> tuple[EngineCore, PreTrainedTokenizerBase, GrammarCompiler]:
    config = resolve_engine_config(args)
    tokenizer = _tokenizer(config)
    grammars = GrammarCompiler(tokenizer, config.model_config.vocab_size)
    reasoning = config.model_config.reasoning_parser
    tokens = None if reasoning is None else ReasoningTokens.of(reasoning_format(reasoning), tokenizer)
    return EngineCore(config, structured_output_manager=GuidanceManager(grammars, tokens)), tokenizer, grammars


def load_processor(config: EngineConfig) -> InputProcessor:
    """The input processor, with a grammar compiler of its own, for an engine core's resolved ``config``
    (``cache_config.num_blocks`` measured)."""
    tokenizer = _tokenizer(config)
    return _processor(config, tokenizer, GrammarCompiler(tokenizer, config.model_config.vocab_size))


def _tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    model_config = config.model_config
    return load_tokenizer(ModelSource(model_config.path, None, model_config.served_model_name))


def _processor(config: EngineConfig, tokenizer: PreTrainedTokenizerBase, grammars: GrammarCompiler) -> InputProcessor:
    return InputProcessor(config.model_config, tokenizer, config.cache_config, config.args.max_logprobs, grammars,
                          config.pooler_config)
