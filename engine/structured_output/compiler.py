"""Compile ``StructuredOutputsParams`` into llguidance matchers, off the engine thread, cached by grammar text.

Why llguidance (rather than xgrammar): it has no dependencies beyond its own wheel, builds a grammar
in about a millisecond (a JSON schema's lexer is derived lazily, token by token, instead of being
precompiled against the whole vocabulary), computes a mask in tens of microseconds on a CPU, refuses
the JSON-schema keywords it cannot enforce instead of ignoring them, and takes Lark, GBNF, regexes,
choices and JSON schemas, mixed in one grammar (``%json`` inside Lark), which tool calling needs.
It is what vLLM's ``guidance`` backend uses.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams

#: JSON's whitespace, fixed: one space after ``:`` and ``,``, none elsewhere. Bounded on purpose: with
#: free whitespace a small model can emit newlines until ``max_tokens`` (a known failure of grammars
#: that allow ``[ \t\n]*`` between tokens). Applied over the schema's own ``x-guidance`` options.
JSON_FORMAT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Compiled grammars kept (least recently used dropped first); each is a few hundred KB at most.
MAX_CACHED_GRAMMARS = 256
#: Threads compiling grammars: compilation drops the GIL, and two keep one slow grammar from
#: holding up every other request's.
NUM_COMPILE_THREADS = 2


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; the same constraint always gives the same text (the cache key).

    Raises:
        InvalidRequestError: (``structured_outputs``) a grammar that is neither Lark nor GBNF.
    """
    if params.json is not None or params.json_object:
        schema = {"type": "object"} if params.json_object else params.json
        # Property order is kept: it is the order the output will have.
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema, ensure_ascii=False),
                                                             overrides=JSON_FORMAT)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(params.choice), ensure_ascii=False))
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except Exception as exc:  # noqa: BLE001 - the GBNF converter raises whatever its parser hits
        raise InvalidRequestError(f"invalid grammar: {exc}", "structured_outputs") from exc


def json_schema_error(schema: dict[str, Any]) -> str:
    """Why llguidance cannot enforce ``schema`` (a JSON schema, as structured output compiles it);
    ``""`` when it can. Checks without a tokenizer, in a millisecond or so."""
    return llguidance.LLMatcher.validate_grammar(grammar_text(StructuredOutputsParams(json=schema)))


class GrammarCompiler:
    """Builds llguidance matchers for constraints on ``NUM_COMPILE_THREADS`` threads, caching them.

    Thread-safe: the frontend (event loop, ``LLM``) and the engine thread share one.

    Args:
        tokenizer: the model's (fast) tokenizer; wrapped for llguidance on first use (about 0.6 s).
        vocab_size: the model's vocabulary (the logits' width), at least the tokenizer's.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=NUM_COMPILE_THREADS, thread_name_prefix="grammar")
        self._lock = threading.Lock()  # guards the cache
        self._tokenizer_lock = threading.Lock()  # held while the llguidance tokenizer is built (0.6 s)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance reads it, built on first use."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """A future of the constraint's matcher in its start state: a template, never advanced;
        callers ``deep_copy`` it. It raises ``InvalidRequestError`` for a grammar llguidance refuses.

        Raises:
            InvalidRequestError: a grammar refused before compiling (see ``grammar_text``).
        """
        text = grammar_text(params)
        with self._lock:
            future = self._cache.get(text)
            if future is not None and not future.cancelled():  # cancelled only by shutdown()
                self._cache.move_to_end(text)
                return future
            future = self._pool.submit(self._build, text, params.kind)
            self._cache[text] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return future

    def _build(self, text: str, kind: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            what = "JSON schema" if kind in ("json", "json_object") else kind
            raise InvalidRequestError(f"invalid {what} for structured output: {matcher.get_error()}",
                                      "structured_outputs")
        return matcher

    def check(self, params: StructuredOutputsParams | None) -> None:
        """Compile ``params`` (blocking) so that a bad constraint fails here; None passes.

        Raises:
            InvalidRequestError: (``structured_outputs``) with llguidance's message.
        """
        if params is not None:
            self.compile(params).result()

    async def check_async(self, params: StructuredOutputsParams | None) -> None:
        """``check`` without blocking the event loop: compiled on the pool, the result cached for the engine.

        Cancelling the caller (a client that disconnects) leaves the compilation, which other requests
        and the cache share, running.
        """
        if params is not None:
            await asyncio.shield(asyncio.wrap_future(self.compile(params)))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
