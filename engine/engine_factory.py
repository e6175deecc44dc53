"""Build what ``LLM`` and ``AsyncLLM`` drive: the engine core and the input processor that feeds it."""

from __future__ import annotations

from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from pagedserve.engine.config import EngineArgs, EngineConfig
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.model.loader import ModelSource, load_tokenizer
from pagedserve.engine.structured_output import GrammarCompiler, GuidanceManager


class LoadedEngine(NamedTuple):
    """An engine core and its input processor, sharing one grammar compiler: the processor compiles
    (and so validates) each request's grammar before queueing it, and the core's manager finds it cached."""

    engine_core: EngineCore
    processor: InputProcessor


def load_engine(args: EngineArgs) -> LoadedEngine:
    """Load the model and its tokenizer and allocate the KV cache (blocking, seconds).

    Raises:
        ValueError: a setting the model or the machine cannot honour (model not found, no CUDA,
            a KV cache too small for ``max_model_len``), naming it.
        OSError: model or tokenizer files that cannot be read, a cache that cannot be written.
    """
    config = EngineConfig.from_args(args)
    tokenizer = _tokenizer(config)
    grammars = GrammarCompiler(tokenizer, config.model_config.vocab_size)
    engine_core = EngineCore(config, structured_output_manager=GuidanceManager(grammars))
    return LoadedEngine(engine_core, _processor(engine_core.config, tokenizer, grammars))


def load_engine_core(args: EngineArgs) -> EngineCore:
    """The engine core alone, with a grammar compiler of its own (the engine process's: its frontend has
    another), as ``load_engine`` raises. The input processor left over costs nothing: it loads nothing."""
    return load_engine(args).engine_core


def load_processor(config: EngineConfig) -> InputProcessor:
    """The input processor, with a grammar compiler of its own, for an engine core's resolved ``config``
    (``cache_config.num_blocks`` measured)."""
    tokenizer = _tokenizer(config)
    return _processor(config, tokenizer, GrammarCompiler(tokenizer, config.model_config.vocab_size))


def _tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    model_config = config.model_config
    return load_tokenizer(ModelSource(model_config.path, None, model_config.served_model_name))


def _processor(config: EngineConfig, tokenizer: PreTrainedTokenizerBase, grammars: GrammarCompiler) -> InputProcessor:
    return InputProcessor(config.model_config, tokenizer, config.cache_config, config.args.max_logprobs, grammars)
