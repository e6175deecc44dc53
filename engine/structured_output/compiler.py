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
import atexit
import heapq
import itertools
import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: JSON's whitespace, fixed: one space after ``:`` and ``,``, none elsewhere. Bounded on purpose: with
#: free whitespace a small model can emit newlines until ``max_tokens`` (a known failure of grammars
#: that allow ``[ \t\n]*`` between tokens). A schema whose ``x-guidance`` asks for other whitespace is refused.
JSON_FORMAT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Most characters of a request's grammar source: a JSON schema's text, a regex, a grammar, the choices as a
#: JSON list; for tools, the grammar holding every tool's parameters. Schemas within OpenAI's own limits
#: (120,000 characters of names and enum values) and 128 tools of 2 KB fit; it bounds what a compile costs (at
#: most seconds, on 2 cores) and how deep it recurses (``COMPILE_STACK_BYTES``).
MAX_GRAMMAR_CHARS = 512 * 1024
#: Most strings in a ``choice``: 1,999, the most llguidance's parser generates from (a row of one item per
#: choice and one more, at most ``max_items_in_row``, 2,000): a longer list fails at the first token anyway,
#: after its compile (100,000 took 7 s, and then broke llguidance's limit of 65,525 grammar symbols).
MAX_CHOICES = llguidance.LLParserLimits().max_items_in_row - 1
#: Most object ``properties`` declared in a request's JSON schemas (tools' parameters together): OpenAI's limit.
#: llguidance's compile time grows with the square of one object's optional properties (4,000 take 2 s).
MAX_SCHEMA_PROPERTIES = 5_000
#: Compiled grammars kept (least recently used dropped first), by count and by estimated size; the most
#: recent one is always kept, so that an engine sharing the frontend's compiler finds the grammar it just compiled.
MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_BYTES = 256 * 1024**2
#: A compiled grammar's memory, estimated from its text: measured at up to 60 bytes per character once compiled
#: (choices, objects of many properties; a Lark grammar or a regex about 16), 80 once used (the server's RSS
#: grew 14.7 MB per distinct list of 10,000 choices), plus about 50 KB each.
GRAMMAR_BYTES_PER_CHAR, GRAMMAR_BASE_BYTES = 80, 64 * 1024
#: Threads compiling grammars (compilation drops the GIL). The first compiles any grammar, the others only
#: grammars of at most ``SMALL_GRAMMAR_CHARS`` (a compile of a few hundred ms at most): however many large
#: grammars are queued, a request's small schema waits for one small compile at most.
NUM_COMPILE_THREADS = 2
SMALL_GRAMMAR_CHARS = 16 * 1024
#: Queued compiles run earliest deadline first, a deadline being the time the job was queued plus this many
#: seconds per character of its grammar: smaller grammars go first, and a large one is not starved by a steady
#: stream of small ones (those queued long enough after it have later deadlines). About llguidance's compile
#: time per character: 66,000 alternatives (414 K characters) took 6 s.
AGING_S_PER_CHAR = 1e-5
#: Stack of each compile thread. llguidance recurses once per link of a chain of rules or ``$ref`` s: on a
#: thread's usual 8 MiB stack, 3,000 Lark rules or 1,000 ``$ref`` s overflow it and kill the process. The
#: worst chains of ``MAX_GRAMMAR_CHARS`` measured need 64-128 MiB. Address space, not memory: only the
#: pages a compile touches are.
COMPILE_STACK_BYTES = 512 * 1024**2
#: Where llguidance's error text stops being about the request: a panic's backtrace (native frames and
#: build paths), the parser's state dump.
_DIAGNOSTICS = re.compile(r"\n\s*<(?:backtrace|state)>")
#: ``threading.stack_size`` is process-wide: held while the compile threads start with theirs.
_STACK_SIZE_LOCK = threading.Lock()
#: What each kind of constraint is called in errors.
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice list",
               "grammar": "grammar"}
#: llguidance's JSON options that change whitespace (``JsonCompileOptions``).
_WHITESPACE_OPTIONS = frozenset({"whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator"})


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; the same constraint always gives the same text (the cache key).

    Raises:
        InvalidRequestError: (``structured_outputs``) more than ``MAX_CHOICES`` choices, a source of more than
            ``MAX_GRAMMAR_CHARS`` characters, a schema of more than ``MAX_SCHEMA_PROPERTIES`` properties, asking
            for its own JSON whitespace (``x-guidance``) or nested deeper than llguidance's JSON parser goes
            (128 levels), a grammar that is neither Lark nor GBNF.
    """
    if params.choice is not None and len(params.choice) > MAX_CHOICES:
        raise InvalidRequestError(f"{len(params.choice):,} choices were given; at most {MAX_CHOICES:,} are "
                                  "compiled", "structured_outputs")
    source = _source(params)
    _check_size(f"the {_KIND_NAMES[params.kind]} is", len(source))
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(source)
    if params.choice is not None:
        return llguidance.grammar_from("choice", source)
    if params.grammar is not None:
        try:
            return llguidance.grammar_from("grammar", source)
        except Exception as exc:  # noqa: BLE001 - the GBNF converter raises whatever its parser hits
            raise InvalidRequestError(f"invalid grammar: {exc}", "structured_outputs") from exc
    schema = {"type": "object"} if params.json_object else params.json
    _check_properties([schema])
    _check_whitespace(schema)
    try:  # property order is kept: it is the order the output will have
        return llguidance.LLMatcher.grammar_from_json_schema(source, overrides=JSON_FORMAT)
    except ValueError as exc:  # the only one: llguidance's JSON parser, "recursion limit exceeded at line 1 column 9"
        raise InvalidRequestError(f"invalid JSON schema for structured output: it is nested too deeply ({exc}; "
                                  "llguidance reads JSON at most 128 levels deep)", "structured_outputs") from exc


def _source(params: StructuredOutputsParams) -> str:
    """What the constraint's grammar is made from, as text: a schema's or the choices' JSON, a regex, a grammar."""
    if params.json is not None or params.json_object:
        return json.dumps({"type": "object"} if params.json_object else params.json, ensure_ascii=False)
    if params.choice is not None:
        return json.dumps(list(params.choice), ensure_ascii=False)
    return params.regex if params.regex is not None else params.grammar


def _check_size(subject: str, num_chars: int) -> None:
    """Refuse a source over ``MAX_GRAMMAR_CHARS``; ``subject`` says what it is (``"the regex is"``)."""
    if num_chars > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{subject} {num_chars:,} characters long; at most {MAX_GRAMMAR_CHARS:,} are "
                                  "compiled", "structured_outputs")


def _check_properties(schemas: Sequence[dict[str, Any]]) -> None:
    """Refuse JSON schemas that together declare more than ``MAX_SCHEMA_PROPERTIES`` object properties."""
    count = _count_properties(schemas)
    if count > MAX_SCHEMA_PROPERTIES:
        raise InvalidRequestError(f"{count:,} object properties are declared in the JSON schema; at most "
                                  f"{MAX_SCHEMA_PROPERTIES:,} are compiled", "structured_outputs")


def _check_whitespace(schema: dict[str, Any]) -> None:
    """Refuse a schema whose ``x-guidance`` asks for other JSON whitespace than ``JSON_FORMAT``, which would
    override it unseen."""
    own = schema.get("x-guidance")
    asked = [key for key, value in own.items() if key in _WHITESPACE_OPTIONS and value != JSON_FORMAT.get(key)
             ] if isinstance(own, dict) else []
    if asked:
        raise InvalidRequestError(f"the JSON schema's x-guidance sets {', '.join(asked)}, but JSON whitespace is "
                                  "fixed (', ' and ': ', nothing else): remove it", "structured_outputs")


def _count_properties(values: Iterable[Any]) -> int:
    """How many ``properties`` entries the JSON values hold, at any depth (iterative: no recursion limit)."""
    count, pending = 0, list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            properties = value.get("properties")
            count += len(properties) if isinstance(properties, dict) else 0
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return count


def client_message(error: str) -> str:
    """llguidance's error text up to its diagnostics (a panic's backtrace, a parser state dump), which are
    logged instead: they name build paths and native frames, nothing the client can act on."""
    cut = _DIAGNOSTICS.search(error)
    if cut is None:
        return error
    logger.info("llguidance error, in full: %s", error)
    return error[:cut.start()].rstrip()


def _json_schema_errors(schemas: Sequence[dict[str, Any]]) -> list[str]:
    errors = []
    for schema in schemas:
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_text(StructuredOutputsParams(json=schema)))
        except InvalidRequestError as exc:
            error = exc.message
        errors.append(client_message(error))
    return errors


class _CompileThreads:
    """``NUM_COMPILE_THREADS`` threads with ``COMPILE_STACK_BYTES`` stacks that run jobs earliest deadline
    first (``AGING_S_PER_CHAR``). The first takes any job, the others only jobs of at most
    ``SMALL_GRAMMAR_CHARS``: large grammars never hold every thread, so a request's small schema waits for one
    small compile at most. A job cancelled before it starts (``Future.cancel``) never runs."""

    def __init__(self) -> None:
        # Heaps of (deadline, order, future, job), small jobs and large ones; ``order`` breaks ties first in,
        # first out.
        self._small: list[tuple[float, int, Future[Any], Callable[[], Any]]] = []
        self._large: list[tuple[float, int, Future[Any], Callable[[], Any]]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                # The first takes any size: a grammar's text outgrows its source, which the limit is on.
                self._threads = [threading.Thread(target=self._work, name=f"grammar-{i}", daemon=True,
                                                  args=(i == 0,))
                                 for i in range(NUM_COMPILE_THREADS)]
                for thread in self._threads:
                    thread.start()
            finally:
                threading.stack_size(previous)
        _LIVE_THREADS.add(self)

    @property
    def num_queued(self) -> int:
        """Jobs waiting for a thread (cancelled ones included until a thread skips them)."""
        return len(self._small) + len(self._large)

    def submit(self, size: int, job: Callable[[], _T]) -> Future[_T]:
        """Run ``job`` on a thread when its deadline (now plus ``size`` characters of grammar times
        ``AGING_S_PER_CHAR``) is the earliest queued; after ``shutdown``, never (the future is cancelled)."""
        future: Future[_T] = Future()
        with self._changed:
            if self._closed:
                future.cancel()
            else:
                heap = self._small if size <= SMALL_GRAMMAR_CHARS else self._large
                heapq.heappush(heap, (time.monotonic() + size * AGING_S_PER_CHAR, next(self._order), future, job))
                self._changed.notify_all()
        return future

    def _next_heap(self, any_size: bool) -> list[tuple[float, int, Future[Any], Callable[[], Any]]] | None:
        """The heap whose top a thread runs next: the earliest deadline of the sizes it takes; None if none."""
        heaps = [heap for heap in ((self._small, self._large) if any_size else (self._small,)) if heap]
        return min(heaps, key=lambda heap: heap[0][:2]) if heaps else None

    def _work(self, any_size: bool) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or self._next_heap(any_size) is not None)
                if self._closed:
                    return
                _, _, future, job = heapq.heappop(self._next_heap(any_size))
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = False) -> None:
        """Cancel the queued jobs and stop the threads once their running jobs end; ``wait``: for those jobs."""
        with self._changed:
            self._closed = True
            for _, _, future, _ in self._small + self._large:
                future.cancel()
            self._small.clear()
            self._large.clear()
            self._changed.notify_all()
        for thread in self._threads if wait else ():
            thread.join()


#: Every ``_CompileThreads`` not yet collected, stopped at exit before the interpreter finalizes: a daemon
#: thread still compiling then would be stopped when it next takes the GIL, unwinding through llguidance's
#: native frames (``ThreadPoolExecutor`` joins its threads at exit for the same reason).
_LIVE_THREADS: weakref.WeakSet[_CompileThreads] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for threads in list(_LIVE_THREADS):
        threads.shutdown(wait=True)


@dataclass
class _Entry:
    """A cached grammar: its compilation and who waits on it."""

    future: Future[llguidance.LLMatcher]
    size: int  # estimated bytes of the compiled grammar
    waiters: int = 0  # ``check_async`` callers awaiting it: the last to leave cancels it if it has not started
    kept: bool = False  # given to a caller that does not leave (the engine, a blocking ``check``): never cancelled


class GrammarCompiler:
    """Builds llguidance matchers for constraints on ``NUM_COMPILE_THREADS`` threads, caching them.

    Thread-safe: the frontend (event loop, ``LLM``) and the engine thread share one. A compile cannot be
    stopped once it runs, so sources are capped (``grammar_text``), and a compile still queued when every
    client waiting on it has gone is cancelled.

    Args:
        tokenizer: the model's (fast) tokenizer; wrapped for llguidance on first use (about 0.6 s).
        vocab_size: the model's vocabulary (the logits' width), at least the tokenizer's.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._threads = _CompileThreads()
        # The threads hold their _CompileThreads, never this compiler: an offline LLM dropped without a
        # shutdown stops them when it is collected, instead of leaving two idle threads per engine.
        weakref.finalize(self, self._threads.shutdown)
        self._lock = threading.Lock()  # guards the cache, its entries and the counts
        self._tokenizer_lock = threading.Lock()  # held while the llguidance tokenizer is built (0.6 s)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        #: Estimated bytes of the cached grammars (``GRAMMAR_BYTES_PER_CHAR``), at most ``MAX_CACHED_GRAMMAR_BYTES``
        #: unless the one most recent grammar is larger.
        self.cached_bytes = 0
        #: Grammars compiled; compiles cancelled before they started, every client waiting on them gone.
        self.num_compiled = 0
        self.num_cancelled = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance reads it, built on first use."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    @property
    def num_queued(self) -> int:
        """Jobs (compiles, schema checks) waiting for a compile thread."""
        return self._threads.num_queued

    def compile(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """A future of the constraint's matcher in its start state: a template, never advanced;
        callers ``deep_copy`` it. It raises ``InvalidRequestError`` for a grammar llguidance refuses.
        Its compilation is never cancelled for want of waiters (see ``check_async``).

        Raises:
            InvalidRequestError: a grammar refused before compiling (see ``grammar_text``).
        """
        text = grammar_text(params)
        with self._lock:
            entry = self._entry(text, params.kind)
            entry.kept = True
            return entry.future

    def _entry(self, text: str, kind: str) -> _Entry:
        """The cache's entry for ``text``, its compilation queued if new (``self._lock`` held)."""
        entry = self._cache.get(text)
        if entry is not None and not entry.future.cancelled():
            self._cache.move_to_end(text)
            return entry
        if entry is not None:
            self._drop(text)
        entry = _Entry(self._threads.submit(len(text), lambda: self._build(text, kind)),
                       GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * len(text))
        self._cache[text] = entry
        self.cached_bytes += entry.size
        while len(self._cache) > 1 and (len(self._cache) > MAX_CACHED_GRAMMARS
                                        or self.cached_bytes > MAX_CACHED_GRAMMAR_BYTES):
            self._drop(next(iter(self._cache)))
        return entry

    def _drop(self, text: str) -> None:
        self.cached_bytes -= self._cache.pop(text).size

    def _build(self, text: str, kind: str) -> llguidance.LLMatcher:
        with self._lock:
            self.num_compiled += 1
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {_KIND_NAMES[kind]} for structured output: "
                                      f"{client_message(matcher.get_error())}", "structured_outputs")
        return matcher

    def check(self, params: StructuredOutputsParams | None) -> None:
        """Compile ``params`` (blocking) so that a bad constraint fails here; None passes.

        Raises:
            InvalidRequestError: (``structured_outputs``) with llguidance's message.
        """
        if params is not None:
            self.compile(params).result()

    async def check_async(self, params: StructuredOutputsParams | None) -> None:
        """``check`` without blocking the event loop: compiled on a compile thread, the result cached.

        Cancelling the caller (a client that disconnects) leaves a compilation that has started running for
        the others and the cache; one still queued is cancelled when no other caller waits on it.

        Raises:
            InvalidRequestError: as ``check``.
        """
        if params is None:
            return
        text = grammar_text(params)
        with self._lock:
            entry = self._entry(text, params.kind)
            entry.waiters += 1
        try:
            await asyncio.shield(asyncio.wrap_future(entry.future))
        finally:
            self._leave(text, entry)

    def _leave(self, text: str, entry: _Entry) -> None:
        with self._lock:
            entry.waiters -= 1
            if entry.waiters or entry.kept or not entry.future.cancel():
                return
            self.num_cancelled += 1
            if self._cache.get(text) is entry:
                self._drop(text)

    async def json_schema_errors_async(self, schemas: Sequence[dict[str, Any]]) -> list[str]:
        """Why llguidance cannot enforce each of ``schemas`` (``""`` for each it can), checked as structured
        output compiles them, without a tokenizer, on a compile thread: off the event loop, and on a stack deep
        enough for deeply nested schemas. The check is cancelled with its caller if it has not started.

        Raises:
            InvalidRequestError: (``structured_outputs``) schemas of more than ``MAX_GRAMMAR_CHARS`` characters
                or ``MAX_SCHEMA_PROPERTIES`` properties together.
        """
        size = sum(len(json.dumps(schema, ensure_ascii=False)) for schema in schemas)
        _check_size("the JSON schemas are together", size)
        _check_properties(schemas)
        future = self._threads.submit(size, lambda: _json_schema_errors(schemas))
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        finally:
            future.cancel()  # does nothing once it has started

    def shutdown(self) -> None:
        self._threads.shutdown()
