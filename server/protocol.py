"""Request and response bodies of the HTTP API, in OpenAI's shapes (plus vLLM's extra sampling fields).

Nothing a client sends is dropped unseen (``check_fields``): a field that would
change the output but is not implemented (tools, structured output, ...) is
refused with a 400 naming it, from one table, ``UNSUPPORTED_FIELDS``. Any other
unknown field is accepted, as OpenAI-compatible servers do so that clients
written for other servers (e.g. llama.cpp's ``n_predict``) still work, and
logged once per field name, as vLLM does.

Types are strict (``StrictInt``, ``StrictBool``, ``Text``, ``Number``): no string
or bool is coerced into a number, nor a number into a bool; a float field takes
an int. Floats must be finite (JSON has no infinity, but ``1e400`` parses to
one). Strings may not hold lone surrogates (``"\\ud800"``), anywhere in the body,
field names included (``check_text``). Sampling values are range-checked by
``SamplingParams``, not here, so that there is one set of rules whichever
frontend builds the request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from sse_starlette import EventSourceResponse
from starlette.responses import Response
from typing_extensions import TypedDict

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.input_processor import run_off_loop
from pagedserve.engine.outputs import FinishReason, TokenLogprobs
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.server.errors import OpenAIError, bad_request, shorten

logger = logging.getLogger(__name__)

_Chunk = TypeVar("_Chunk")

#: A float request field: finite, an int accepted, a bool or a string refused.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
#: A string request field (lone surrogates are refused for the whole body by ``check_text``).
Text = StrictStr


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept, in ``model_extra``, so that ``check_fields`` can refuse or log them.
    model_config = ConfigDict(extra="allow")


_TEXT_OR_NESTED = frozenset((str, list, dict))


def _surrogate_path(value: Any) -> str | None:
    """The dotted path (list indexes included) of the first string in ``value``, key or value, that
    cannot be encoded as UTF-8 (a lone surrogate), "" when ``value`` is that string; None when every
    one can. Numbers are passed over without building their path, so that a body of millions of token
    ids does not hold the event loop."""
    if isinstance(value, str):
        return None if _encodes(value) else ""
    if isinstance(value, list) and _TEXT_OR_NESTED.isdisjoint(map(type, value)):
        return None  # numbers only: a C-speed check (a parsed body holds the exact JSON types)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and not _encodes(key):
            return _path_name(key)
        if isinstance(item, (str, list, dict)) and (found := _surrogate_path(item)) is not None:
            return f"{_path_name(key)}.{found}" if found else _path_name(key)
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _path_name(key: str | int) -> str:
    """``key`` as a path part, escaped so that the path itself (quoted in an error) is valid text."""
    return key.encode(errors="backslashreplace").decode() if isinstance(key, str) else str(key)


class RequestBody(OpenAIBaseModel):
    """A request body: refused whole with a 400 naming the field when a string in it is not valid
    Unicode text, before any field is read (``json.loads`` lets ``"\\ud800"`` through, and such a string
    fails later, in the tokenizer or in the UTF-8 of an error message that quotes it: a 500)."""

    @model_validator(mode="before")
    @classmethod
    def check_text(cls, data: Any) -> Any:
        path = _surrogate_path(data)
        if path is not None:
            # Not a ValueError: pydantic's error would drop the path below this model's fields.
            where = f"'{path}'" if path else "the request body"
            raise bad_request(f"Invalid value for {where}: strings must be valid Unicode text "
                              "(a lone UTF-16 surrogate such as \\ud800 is not)", path or None)
        return data


# --------------------------------------------------------------------------- fields not served

#: Fields that would change the output but are not implemented: name -> (what it asks for, the values
#: that ask for nothing). A request setting one to anything else (null asks for nothing too) gets a 400
#: naming it, never an answer made without it.
UNSUPPORTED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    # OpenAI's
    "functions": ("function calling (deprecated by OpenAI; use tools)", ()),
    "function_call": ("function calling", ("none",)),
    "reasoning_effort": ("reasoning effort", ()),
    "audio": ("audio output", ()),
    "modalities": ("output other than text", (["text"],)),
    "web_search_options": ("web search", ()),
    "suffix": ("fill in the middle", ()),
    # vLLM's
    "guided_whitespace_pattern": ("a JSON whitespace pattern; JSON whitespace is fixed", ()),
    "use_beam_search": ("beam search", (False,)),
    "length_penalty": ("beam search", (1.0,)),
    "allowed_token_ids": ("sampling from given tokens only", ()),
    "bad_words": ("banned words", ([],)),
    "logits_processors": ("custom logits processors", ()),
    "truncate_prompt_tokens": ("prompt truncation", ()),
    "chat_template": ("a chat template of the request's own", ()),
    "documents": ("documents for the chat template", ()),
    "spaces_between_special_tokens": ("no spaces between special tokens", (True,)),
    "return_tokens_as_token_ids": ("tokens written as token ids", (False,)),
}

_logged_unknown_fields: set[str] = set()
#: Field names logged at most (each cut to ``MAX_ECHOED_CHARS``): a client sending made-up names must not grow
#: memory or the log forever.
_MAX_LOGGED_UNKNOWN_FIELDS = 1000


def _unknown_fields(model: BaseModel, prefix: str = "") -> Iterator[str]:
    """The names of the fields of ``model`` and its nested models that no model declares, dotted
    from the top (``messages.name``, list indexes left out)."""
    for name in model.model_extra or {}:
        yield prefix + name
    for name in model.model_fields_set:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                yield from _unknown_fields(item, f"{prefix}{name}.")


def check_fields(request: BaseModel,
                 unsupported: dict[str, tuple[str, tuple[Any, ...]]] = UNSUPPORTED_FIELDS) -> None:
    """Refuse the fields of ``unsupported`` (a table shaped as ``UNSUPPORTED_FIELDS``) that ask for
    something; log the other unknown ones, each field name once per process (clients repeat them on
    every request), cut to ``MAX_ECHOED_CHARS``, and no more than ``_MAX_LOGGED_UNKNOWN_FIELDS`` names.

    Raises:
        OpenAIError: 400 naming the first unsupported field set.
    """
    for name, value in (request.model_extra or {}).items():
        if name in unsupported and value is not None and value not in unsupported[name][1]:
            asks_for, harmless = unsupported[name]
            alternative = f" or set it to {json.dumps(harmless[0])}" if harmless else ""
            raise bad_request(f"'{name}' is not supported yet ({asks_for}): remove it from the "
                              f"request{alternative}.", name)
    room = _MAX_LOGGED_UNKNOWN_FIELDS - len(_logged_unknown_fields)
    if room <= 0:
        return
    unknown = {shorten(name) for name in _unknown_fields(request) if name not in unsupported}
    new = sorted(unknown - _logged_unknown_fields)[:room]
    if new:
        logger.warning("The following fields were present in the request but ignored: %s", new)
        _logged_unknown_fields.update(new)


# --------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False
    #: vLLM's extension (guidellm sends it): with ``include_usage``, usage so far in every chunk too.
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(OpenAIBaseModel):
    """OpenAI's ``response_format.json_schema``."""

    name: Text
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint. Unknown keys are refused (each would change
    the output)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None


class SamplingRequest(RequestBody):
    """The fields completions and chat share: the model, streaming and sampling.

    A field left out or sent as ``null`` takes the model's default (``--generation-config``),
    else ``SamplingParams``'.
    """

    model: Text | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    n: StrictInt | None = None
    best_of: StrictInt | None = None  # accepted when equal to n: the engine returns every completion it makes
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[int, Number] | None = None  # JSON keys are strings; pydantic turns them into ints
    # vLLM's extra sampling fields.
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    prompt_logprobs: StrictInt | None = None  # top logprobs per prompt token, in vLLM's shape; not streamed
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (``include_usage`` and ``continuous_usage_stats``, as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    #: The fields this endpoint refuses (``check_fields``).
    unsupported_fields: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = UNSUPPORTED_FIELDS

    def check(self) -> None:
        """Refuse what neither endpoint serves, naming the field the client set.

        Raises:
            OpenAIError: 400 for an unsupported field (``check_fields``),
                ``best_of`` other than ``n``, ``stream_options`` without ``stream``, or
                ``prompt_logprobs`` with ``stream`` (as vLLM does: they arrive with the last token).
        """
        check_fields(self, self.unsupported_fields)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request(f"best_of other than n is not supported: got best_of {self.best_of}, "
                              f"n {self.n or 1}", "best_of")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")

    def structured_output(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field that set it (for errors); ``(None, None)`` when free.

        Raises:
            OpenAIError: 400 when more than one field sets a constraint, or ``response_format`` is
                ``json_schema`` without a schema.
        """
        given: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif self.response_format.json_schema is None or self.response_format.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  "response_format.json_schema")
            else:
                given.append(("response_format.json_schema.schema",
                              {"json": self.response_format.json_schema.schema_}))
        if self.structured_outputs is not None:
            fields = {k.rstrip("_"): v for k, v in self.structured_outputs if v is not None}
            # Named down to the constraint when there is one: its compile errors are about it.
            given.append((f"structured_outputs.{next(iter(fields))}" if len(fields) == 1 else "structured_outputs",
                          fields))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None, None
        if len(given) > 1:
            raise bad_request(f"only one structured output constraint may be given; got {given[0][0]} and "
                              f"{given[1][0]}", given[1][0])
        param, fields = given[0]
        try:
            return StructuredOutputsParams(**fields), param
        except InvalidRequestError as exc:
            raise bad_request(exc.message, param) from exc

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                           defaults: dict[str, Any] | None = None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's parameters for this request.

        Args:
            max_tokens: most output tokens per completion, as the client set it; None = all the context
                the prompt leaves, at most the model's default (the ``InputProcessor`` resolves it).
            logprobs: top logprobs per output token; None = no logprobs.
            prompt_logprobs: top logprobs per prompt token; None = none.
            defaults: the model's values for the fields the request leaves unset
                (``AsyncLLM.default_sampling_params``); its ``max_tokens`` is the ``InputProcessor``'s business.
            structured_outputs: the output's constraint (``structured_output()``, or a tool grammar).

        Raises:
            InvalidRequestError: a value out of range, naming the field.
        """
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        model_defaults = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              structured_outputs=structured_outputs, **(model_defaults | given))


_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output",
)

PromptInput = Text | list[Text] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    unsupported_fields: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = UNSUPPORTED_FIELDS | {
        "tools": ("tool calling; use /v1/chat/completions", ()),
        "tool_choice": ("tool calling; use /v1/chat/completions", ("none",)),
    }

    prompt: PromptInput
    max_tokens: StrictInt | None = 16  # OpenAI's default; null = up to the context length
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> PromptInput:
        # Without this, pydantic reports one error per member of the union.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists") from None


class TextContentPart(OpenAIBaseModel):
    type: Text
    text: Text | None = None


MessageContent = Text | list[TextContentPart] | None


class FunctionCall(OpenAIBaseModel):
    """A call the model made: the function's name and its arguments as a JSON text."""

    name: Text
    arguments: Text


class ToolCall(OpenAIBaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool message answers this call

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: MessageContent) -> MessageContent:
        for part in content if isinstance(content, list) else ():
            if part.type != "text" or part.text is None:
                raise ValueError(f"only content parts of type 'text' with a 'text' field are supported, "
                                 f"got type {part.type!r}")
        return content

    @model_validator(mode="after")
    def _tool_fields_fit_role(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role 'tool' needs the 'tool_call_id' of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages have 'tool_calls', not {self.role} messages")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM does."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: ``role`` and ``content`` (as text), and where set an
    assistant's ``tool_calls`` (``{"id", "type", "function": {"name", "arguments"}}``, the arguments a dict
    when they are a JSON object, as templates expect), a tool message's ``tool_call_id`` and ``name``."""
    rendered: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": _json_object(call.function.arguments)}}
                for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        rendered.append(message)
    return rendered


def _json_object(text: str) -> dict[str, Any] | str:
    """``text`` parsed when it is a JSON object, else as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(OpenAIBaseModel):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no arguments
    strict: StrictBool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: Text


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this tool."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``, with vLLM's ``echo`` and ``add_generation_prompt``."""

    messages: list[ChatMessage]
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None  # None = "auto" with tools, "none" without
    parallel_tool_calls: StrictBool = True
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    # vLLM's: the reply starts with the last message's content when that message has the reply's role.
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    # vLLM's: the reply continues the last message (a prefill), whose end-of-turn tokens the prompt leaves out.
    continue_final_message: StrictBool = False
    # vLLM's: variables of the chat template (Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(RequestBody):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``; with messages, ``tools`` and
    ``tool_choice`` render as a chat request's do, so the count is the chat prompt's."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: Text | None = None
    tokens: list[StrictInt]


# --------------------------------------------------------------------------- responses


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's ``finish_reason`` for the engine's: ``stop`` and ``length`` pass, an abort
    (only at shutdown) is ``null`` as in vLLM, since OpenAI has no word for it."""
    return None if reason == FinishReason.ABORT.value else reason


def unix_time() -> int:
    """Seconds since the epoch, the type of OpenAI's ``created`` fields."""
    return int(time.time())


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogProbs(OpenAIBaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class Choice(OpenAIBaseModel):
    """What every choice has, whole or streamed; vLLM's ``stop_reason`` is the stop string or stop token id
    that ended the choice (null for end of sequence, length, or a choice not finished yet)."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ResponseHead(OpenAIBaseModel):
    """What every response and streamed chunk has."""

    id: str
    created: int
    model: str


class PromptLogprob(TypedDict):
    """vLLM's logprob of one token at one prompt position.

    A plain dict, not a model: a prompt's logprobs hold prompt length x (k + 1) of them, which dicts
    build and serialize ~20x and ~2x faster.
    """

    logprob: float
    rank: int  # in the distribution at that position, 1 = most likely
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt position, token id -> its logprob (None for the first
#: position, which has none); the prompt's own token and the top ``prompt_logprobs`` ones.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class TokenTexts(dict[int, str]):
    """Token id -> ``tokenizer.decode([id])``, each id decoded once: logprobs name the same tokens many
    times over (a prompt's top-k candidates repeat from position to position)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id])
        return text


def prompt_logprobs(tokenizer: Any, entries: list[TokenLogprobs | None]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` from the engine's (``tokenizer`` decodes the tokens).

    Costs ~1 µs per entry (prompt length x (k + 1)): callers convert once per prompt, off the event
    loop when large, and share the result between the choices that carry it.
    """
    texts = TokenTexts(tokenizer)

    def position(lp: TokenLogprobs) -> dict[int, PromptLogprob]:
        ranks = [lp.rank, *range(1, len(lp.token_ids))]  # the prompt's token first, then the top k
        result: dict[int, PromptLogprob] = {}
        for token_id, logprob, rank in zip(lp.token_ids, lp.logprobs, ranks, strict=True):
            if token_id not in result:
                result[token_id] = {"logprob": logprob, "rank": rank, "decoded_token": texts[token_id]}
        return result

    return [None if lp is None else position(lp) for lp in entries]


async def json_response(body: BaseModel, off_loop: bool = False) -> Response:
    """``body`` as a JSON response, written by pydantic's serializer.

    FastAPI would walk a returned model in Python (``jsonable_encoder``) and then ``json.dumps`` it:
    ~10x slower, which a response of prompt logprobs (tens of MB) turns into seconds.

    Args:
        off_loop: serialize with ``run_off_loop``, for a body that may be large (prompt logprobs).
    """
    def serialize() -> Response:
        return Response(body.model_dump_json(by_alias=True), media_type="application/json")

    return await run_off_loop(serialize) if off_loop else serialize()


class WithPromptLogprobs(OpenAIBaseModel):
    """vLLM's ``prompt_logprobs`` field, in the JSON only when the request asked for them."""

    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        value = data.pop("prompt_logprobs", None)
        if value is not None:
            data["prompt_logprobs"] = value  # last, after what every response has
        return data


class CompletionChoice(Choice, WithPromptLogprobs):
    text: str
    logprobs: CompletionLogProbs | None = None


class CompletionResponse(ResponseHead):
    """A whole completion, or (``object`` unchanged, as OpenAI does) one streamed chunk of it."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogProbs(OpenAIBaseModel):
    content: list[TokenLogprob]


class AssistantMessage(OpenAIBaseModel):
    """The reply: ``content`` is null when the reply is only tool calls; ``tool_calls`` is left out when
    there are none, as OpenAI does."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda calls: calls is None)
    # With --reasoning-parser: the thinking before the answer, under vLLM's older and newer names.
    reasoning_content: str | None = Field(default=None, exclude_if=lambda text: text is None)
    reasoning: str | None = Field(default=None, exclude_if=lambda text: text is None)


class ChatChoice(Choice):
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionResponse(ResponseHead, WithPromptLogprobs):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(OpenAIBaseModel):
    """A piece of a streamed tool call: the first carries ``id``, ``type`` and ``function.name``;
    the next ones pieces of ``function.arguments``, which concatenate to its JSON text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends {"role": ..., "content": ""} first, then {"content": ...}, then {}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(Choice):
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionChunk(ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "pagedserve"
    max_model_len: int
    root: str | None = None  # where it was loaded from (vLLM's)
    parent: str | None = None  # an adapter's base model; None for the base model


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's ``POST /v1/load_lora_adapter``."""

    lora_name: str = Field(max_length=256)
    lora_path: str = Field(max_length=4096)
    base_model_name: str | None = Field(default=None, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: str = Field(max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name decides


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# --------------------------------------------------------------------------- streaming


async def first_chunk_awaited(chunks: AsyncGenerator[_Chunk, None]) -> AsyncGenerator[_Chunk, None]:
    """``chunks``, once its first chunk has been produced: what the first chunk raises is raised here
    (``chunks`` is closed then), so that a request the engine refuses gets its HTTP status before any
    response starts (the chunk generators produce nothing before the engine's first output).
    Closing the result closes ``chunks``, which aborts its requests in the engine."""
    try:
        first = await anext(chunks)
    except BaseException:
        await chunks.aclose()
        raise

    async def all_chunks() -> AsyncGenerator[_Chunk, None]:
        async with aclosing(chunks):
            yield first
            async for chunk in chunks:
                yield chunk

    return all_chunks()


def sse_response(chunks: AsyncGenerator[BaseModel, None]) -> EventSourceResponse:
    """Stream ``chunks`` (from ``first_chunk_awaited``) as server-sent events: ``data: {json}`` each, then
    ``data: [DONE]``.

    An ``OpenAIError`` raised once the status is sent becomes a ``data: {"error": ...}`` event before
    ``[DONE]``, as vLLM does. When the client disconnects, sse-starlette cancels the stream and
    ``chunks`` is closed, which aborts its requests in the engine.
    """
    async def events() -> AsyncIterator[str]:
        async with aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield chunk.model_dump_json()
            except OpenAIError as error:
                yield error.to_json()
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n")
