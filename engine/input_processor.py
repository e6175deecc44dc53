"""The frontend's one way in: every request is tokenized and checked here, once (vLLM's ``InputProcessor``).

``LLM`` and ``AsyncLLM`` (and so the server) turn each prompt (text, token
ids, or chat messages rendered with the model's chat template) and its
``SamplingParams`` into a ``ProcessedRequest`` here, before anything is queued:
a request the engine could never run fails at once with an
``InvalidRequestError`` naming the field at fault, and the engine core takes
what it is given without checking it again.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.chat_template import RESERVED_TEMPLATE_KWARGS, chat_prompt_token_ids
from pagedserve.engine.config import CacheConfig, ModelConfig
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.pooling_params import PoolerConfig, PoolingParams
from pagedserve.engine.request import EngineCoreRequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import GrammarCompiler

#: A prompt as text, or as token ids.
PromptType = str | list[int]

#: Inputs of more characters than this are tokenized (or rendered) on a worker thread: a few ms of work
#: on the event loop is cheaper than a thread hop, tens of ms would hold up every other client.
OFF_LOOP_CHARS = 32_768
#: What decoding one token id costs, in characters tokenized (about the characters a token stands for).
CHARS_PER_DECODED_TOKEN = 4
#: How many characters one token may stand for, over the longest token in the vocabulary: headroom for
#: normalizers that merge characters (NFKC), so that the cheap length check never refuses a prompt that fits.
_CHARS_PER_TOKEN_HEADROOM = 2

#: Most completions one request may ask for (``n``), OpenAI's limit: each is a sequence in the batch, and
#: the server and the offline ``LLM`` refuse more alike.
MAX_N = 128

_T = TypeVar("_T")
# One thread: large inputs queue up behind each other instead of taking every core from the engine.
_tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


_malloc_trim = _load_malloc_trim()


def release_memory() -> None:
    """Give freed heap memory back to the OS.

    Tokenizing a large input makes many small allocations; once they are freed glibc keeps the pages,
    and the process's RSS would stay up by as much as the largest request ever made it grow.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


async def _run_sized(num_chars: int, function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)``: inline for small inputs, ``run_off_loop`` for inputs above ``OFF_LOOP_CHARS``
    characters, so that the event loop keeps serving other clients."""
    if num_chars <= OFF_LOOP_CHARS:
        return function(*args)
    return await run_off_loop(function, *args)


async def run_off_loop(function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)`` on the tokenizer thread, then trims the heap: for work of tens of ms or more
    on large inputs or outputs (tokenizing, converting logprobs), which would hold up every other client
    on the event loop. Such jobs queue up on the one thread rather than take every core from the engine."""
    def run_and_trim() -> _T:
        try:
            return function(*args)
        finally:
            release_memory()

    return await asyncio.get_running_loop().run_in_executor(_tokenizer_thread, run_and_trim)


@dataclass(frozen=True)
class ProcessedRequest:
    """A request the ``InputProcessor`` has tokenized and validated, before ``n`` is fanned out.

    Attributes:
        prompt: the prompt text as given; None when it was given as token ids or chat messages.
        prompt_token_ids: at least one token, every id in the vocabulary.
        sampling_params: with ``max_tokens`` resolved (never None).
        eos_token_id: the model's end-of-sequence token (None: no EOS stop).
        pooling_params: set for a pooling request (``process_pooling``), whose ``sampling_params`` are never read.
        lora_request: the adapter it runs with (the server sets it from ``model``); None = the base model.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None

    def engine_core_requests(self, children: Sequence[tuple[str, SamplingParams]],
                             arrival_time: float) -> list[EngineCoreRequest]:
        """One engine-core request per child that ``OutputProcessor.add_request`` made of this request.

        Args:
            children: ``(request id, params with n == 1)`` per child.
            arrival_time: wall-clock seconds (``time.time()``) the request arrived.
        """
        return [EngineCoreRequest(request_id, self.prompt_token_ids, params, self.eos_token_id, arrival_time,
                                  self.pooling_params, self.lora_request) for request_id, params in children]


class InputProcessor:
    """Tokenizes prompts, renders chat messages and checks requests against the engine's limits.

    Loads nothing (``pagedserve.engine.engine_factory.load_engine`` loads the tokenizer). Thread-safe (reads only
    immutable state; the grammar compiler is thread-safe).

    Args:
        model_config: the served model (context length, vocabulary, generation defaults).
        tokenizer: the model's tokenizer.
        cache_config: the KV cache as allocated (``num_blocks`` filled in by the engine core).
        max_logprobs: the most logprobs a request may ask for, per token.
        grammars: compiles structured-output constraints (shared with the engine core's manager);
            None = constrained requests are refused.
        pooler_config: the pooling runner's (``--runner pooling``), which takes pooling requests only; None = the
            generate runner, which takes generation requests only.

    Raises:
        ValueError: a ``cache_config`` whose ``num_blocks`` the engine core has not filled in.
    """

    def __init__(self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, cache_config: CacheConfig,
                 max_logprobs: int, grammars: GrammarCompiler | None = None,
                 pooler_config: PoolerConfig | None = None) -> None:
        if cache_config.num_blocks < 2:
            raise ValueError("cache_config.num_blocks is not set: build the processor from an engine core's config")
        self.model_config = model_config
        self.pooler_config = pooler_config
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self.grammars = grammars
        # Block 0 is the null block and holds no tokens.
        self.kv_cache_tokens = (cache_config.num_blocks - 1) * cache_config.block_size
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else getattr(model_config.hf_config, "eos_token_id", None)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of input one token can stand for (read from the vocabulary on first use)."""
        return _longest_token_chars(self.tokenizer) * _CHARS_PER_TOKEN_HEADROOM

    def check_length(self, num_chars: int, param: str) -> None:
        """Refuse, without tokenizing, an input too long to fit ``max_model_len`` whatever its tokens.

        No token stands for more than ``max_chars_per_token`` characters, so ``num_chars`` characters
        are at least ``num_chars / max_chars_per_token`` tokens.

        Raises:
            InvalidRequestError: (``param``) when those are ``max_model_len`` tokens or more.
        """
        max_model_len = self.model_config.max_model_len
        min_tokens = num_chars // self.max_chars_per_token
        if min_tokens >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{num_chars} characters of input, at least {min_tokens} tokens. Please reduce the length of "
                "the input messages.", param)

    async def tokenize_async(self, prompt: PromptType, param: str = "prompt") -> list[int]:
        """``tokenize``, after ``check_length``; a large prompt is tokenized off the event loop."""
        if not isinstance(prompt, str):
            return list(prompt)
        self.check_length(len(prompt), param)
        return await _run_sized(len(prompt), self.tokenize, prompt)

    async def detokenize_async(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (ids in the vocabulary); a long list is decoded off the event loop, each
        id weighed as ``CHARS_PER_DECODED_TOKEN`` characters of input."""
        return await _run_sized(len(token_ids) * CHARS_PER_DECODED_TOKEN, self.tokenizer.decode, token_ids)

    async def render_chat_async(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                                tools: Sequence[Mapping[str, Any]] | None = None,
                                template_kwargs: Mapping[str, Any] | None = None,
                                continue_final_message: bool = False) -> list[int]:
        """``render_chat``, after ``check_length`` on the messages' text; a large conversation is rendered
        off the event loop.

        Raises:
            InvalidRequestError: (``messages``) as ``render_chat``, or too long to fit ``max_model_len``.
        """
        num_chars = sum(len(str(message.get("content") or "")) for message in messages)
        self.check_length(num_chars, "messages")
        return await _run_sized(num_chars, self.render_chat, messages, add_generation_prompt, tools, template_kwargs,
                                continue_final_message)

    async def process_async(self, prompt: PromptType, params: SamplingParams, default_max_tokens: int | None = None,
                            lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """``process``, after ``check_length``; a large prompt is tokenized off the event loop."""
        num_chars = len(prompt) if isinstance(prompt, str) else 0
        if num_chars:
            self.check_length(num_chars, "prompt")
        await self.check_params_async(params)
        return await _run_sized(num_chars, self.process, prompt, params, default_max_tokens, lora_request)

    def check_params(self, params: SamplingParams) -> None:
        """The checks that need no prompt, cheapest first: ``n``, then the structured-output constraint,
        compiled (blocking) so that a bad one fails now.

        Raises:
            InvalidRequestError: ``n`` above ``MAX_N``; (``structured_outputs``) llguidance's message for a
                schema, regex or grammar it refuses, or JSON-schema features it cannot enforce; or no
                grammar compiler.
        """
        _check_n(params)
        if params.structured_outputs is not None and self.grammars is None:
            raise InvalidRequestError("structured output is not available in this engine", "structured_outputs")
        if self.grammars is not None:
            self.grammars.check(params.structured_outputs)

    async def check_params_async(self, params: SamplingParams) -> None:
        """``check_params`` compiling on the grammar pool, not the event loop; ``process`` then finds it cached."""
        if self.grammars is None:
            self.check_params(params)
        else:
            _check_n(params)
            await self.grammars.check_async(params.structured_outputs)

    def tokenize(self, prompt: PromptType) -> list[int]:
        """The token ids of a text prompt (with the special tokens the tokenizer adds), or the ids given."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """The prompt token ids of chat messages (and ``tools``, for a template that takes them; and the
        template's own variables, ``chat_template_kwargs``; ending inside the last message with
        ``continue_final_message``), exactly as the tokenizer's ``apply_chat_template`` makes them.

        Raises:
            InvalidRequestError: (``messages``) no messages, or the template refuses them (or there is none);
                (``chat_template_kwargs``) a key the server sets itself.
        """
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})):
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own "
                                      "fields do", "chat_template_kwargs")
        try:
            return chat_prompt_token_ids(self.tokenizer, messages, add_generation_prompt, tools, template_kwargs,
                                         continue_final_message)
        except (ValueError, TemplateError) as exc:
            raise InvalidRequestError(f"The chat template cannot render these messages: {exc}", "messages") from exc

    def process(self, prompt: PromptType, params: SamplingParams, default_max_tokens: int | None = None,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Tokenize ``prompt`` and check the request; ``max_tokens`` None becomes all the context the prompt
        leaves, at most ``default_max_tokens``.

        Args:
            prompt: text, or token ids.
            params: the request's sampling parameters (``n`` not yet fanned out).
            default_max_tokens: caps an open ``max_tokens``: the server passes the model's default
                (``generation_config``), as vLLM's server does; the offline ``LLM`` passes none, as vLLM's.
            lora_request: the adapter it runs with (already checked: ``LoRARegistry``); None = the base model.

        Raises:
            InvalidRequestError: naming the field at fault (``prompt``, ``max_tokens``, ``logprobs``, ...):
                an empty prompt; a prompt of ``max_model_len`` tokens or more; prompt + ``max_tokens`` beyond
                ``max_model_len``; token ids (prompt, ``stop_token_ids``, ``logit_bias``) outside the
                vocabulary; more logprobs than ``max_logprobs``; ``min_tokens`` above the resolved
                ``max_tokens``; a request that can outgrow the whole KV cache (``max_tokens``, or ``prompt``
                when ``max_tokens`` was left open); a structured-output constraint that does not compile
                (``structured_outputs``), ``n`` above ``MAX_N`` (see ``check_params``).
        """
        if self.pooler_config is not None:
            raise InvalidRequestError("this server pools (--runner pooling): it answers /v1/embeddings and /pooling, "
                                      "and generates no text", None)
        self.check_params(params)
        token_ids = self.tokenize(prompt)
        requested_max_tokens = params.max_tokens
        # replace() runs SamplingParams' checks again, so min_tokens is checked against the resolved max_tokens.
        params = dataclasses.replace(params, max_tokens=self._max_tokens(len(token_ids), params.max_tokens,
                                                                         default_max_tokens))
        self._check_token_ids(token_ids, params)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequestError(f"{name} must be <= {self.max_logprobs} (max_logprobs), got {value}", name)
        max_len = len(token_ids) + params.max_tokens
        if max_len > self.kv_cache_tokens:
            # Otherwise it would be preempted forever once it had grown to fill the cache alone. The client
            # can fix it by asking for fewer tokens; an open max_tokens is all the room the prompt leaves.
            param = "prompt" if requested_max_tokens is None else "max_tokens"
            raise InvalidRequestError(f"a request of up to {max_len} tokens needs more KV cache than the engine "
                                      f"has ({self.kv_cache_tokens} tokens)", param)
        return ProcessedRequest(prompt if isinstance(prompt, str) else None, token_ids, params, self.eos_token_id,
                                lora_request=lora_request)

    async def process_pooling_async(self, prompt: PromptType, params: PoolingParams) -> ProcessedRequest:
        """``process_pooling``, after ``check_length``; a large prompt is tokenized off the event loop."""
        num_chars = len(prompt) if isinstance(prompt, str) else 0
        if num_chars:
            self.check_length(num_chars, "input")
        return await _run_sized(num_chars, self.process_pooling, prompt, params)

    def process_pooling(self, prompt: PromptType, params: PoolingParams) -> ProcessedRequest:
        """Tokenize ``prompt`` and check a pooling request: its prompt runs once, and no token follows it.

        Raises:
            InvalidRequestError: naming the field: a generate runner (no field), ``dimensions`` the model does not
                allow (``PoolingParams.check``), an empty prompt, one longer than ``max_model_len`` or the KV cache,
                token ids outside the vocabulary (``input``).
        """
        if self.pooler_config is None:
            raise InvalidRequestError("this server generates (--runner generate): start it with --runner pooling to "
                                      "serve embeddings", None)
        hf_config = self.model_config.hf_config
        allowed = getattr(hf_config, "matryoshka_dimensions", None)
        params.check(hf_config.hidden_size, allowed, bool(allowed or getattr(hf_config, "is_matryoshka", False)))
        token_ids = self.tokenize(prompt)
        max_model_len = self.model_config.max_model_len
        if not token_ids:
            raise InvalidRequestError("The input is empty; it must contain at least one token.", "input")
        if len(token_ids) > min(max_model_len, self.kv_cache_tokens):
            raise InvalidRequestError(f"This model's maximum context length is {max_model_len} tokens (the KV cache "
                                      f"holds {self.kv_cache_tokens}). However, your input has {len(token_ids)} "
                                      "tokens. Please reduce the length of the input.", "input")
        vocab_size = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise InvalidRequestError(f"input token ids must be in [0, {vocab_size})", "input")
        return ProcessedRequest(prompt if isinstance(prompt, str) else None, token_ids, _POOLING_SAMPLING_PARAMS,
                                None, params)

    def _max_tokens(self, num_prompt_tokens: int, requested: int | None, default: int | None) -> int:
        """The output budget: ``requested``, or all the context the prompt leaves (at most ``default``).

        The texts are vLLM's, giving both numbers.
        """
        max_model_len = self.model_config.max_model_len
        if num_prompt_tokens == 0:
            raise InvalidRequestError("The prompt is empty; it must contain at least one token.", "prompt")
        if num_prompt_tokens >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.", "prompt")
        if requested is None:
            room = max_model_len - num_prompt_tokens
            return room if default is None else min(room, default)
        if num_prompt_tokens + requested > max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, {requested} in the "
                "completion). Please reduce the length of the messages or completion.", "max_tokens")
        return requested

    def _check_token_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab_size = self.model_config.vocab_size
        for name, token_ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                                ("logit_bias", list(params.logit_bias or ()))):
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
                raise InvalidRequestError(f"{name} token ids must be in [0, {vocab_size})", name)


#: A pooling request's sampling parameters: never read (it samples nothing), one token so that its
#: bookkeeping (``OutputProcessor``) is a plain request's.
_POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)


def _check_n(params: SamplingParams) -> None:
    if params.n > MAX_N:
        raise InvalidRequestError(f"n must be <= {MAX_N}, got {params.n}", "n")


def _longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters of text one token of the vocabulary (added tokens included) stands for.

    Vocabulary strings are at least as long as the text they match: byte-level BPE spells each byte as
    one character, SentencePiece its byte-fallback tokens as ``<0xNN>``.
    """
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))
