"""``POST /v1/chat/completions``: messages rendered with the model's chat template, replies whole or streamed.

Logprobs use the chat shape: ``content[{token, logprob, bytes, top_logprobs[]}]``;
vLLM's ``prompt_logprobs`` come at the top of the response, in vLLM's shape.
A stream opens with one ``{"role": "assistant", "content": ""}`` delta per choice
(then, with vLLM's ``echo``, one delta per choice with the echoed content).
With ``tools``, the reply is split into ``content`` and ``tool_calls`` by the model's tool parser
(``pagedserve.server.tool_calling``), whole or delta by delta. With ``--reasoning-parser``, the thinking
before the answer goes to ``reasoning_content`` and ``reasoning`` (``pagedserve.engine.reasoning``) and the
tool parser reads what follows it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from sse_starlette import EventSourceResponse
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.input_processor import run_off_loop
from pagedserve.engine.output_processor import RequestOutputKind
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedserve.engine.reasoning import ReasoningFormat, ReasoningStream, reasoning_format, split_reasoning
from pagedserve.engine.sampling_params import StructuredOutputsParams
from pagedserve.server.errors import (
    bad_request,
    engine_errors,
    resolve_model,
)
from pagedserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatStreamChoice,
    DeltaMessage,
    TokenizeRequest,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    first_chunk_awaited,
    json_response,
    openai_finish_reason,
    prompt_logprobs,
    sse_response,
    unix_time,
)
from pagedserve.server.tool_calling import ToolParser, ToolPlan, plan_tools, tool_parser_class
from pagedserve.server.tool_calling.output import StreamedReply, reply_message
from pagedserve.server.tool_calling.output import finish_reason as tool_finish_reason
from pagedserve.server.tool_calling.prompt import render_inputs


def _check_supported(request: ChatCompletionRequest) -> None:
    """Raises a 400 for what this server does not have (yet) or cannot make sense of, naming the field."""
    request.check()
    if request.top_logprobs is not None and request.top_logprobs < 0:
        raise bad_request(f"top_logprobs must be >= 0, got {request.top_logprobs}", "top_logprobs")
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")


def _echoed_content(request: ChatCompletionRequest) -> str:
    """What vLLM's ``echo`` puts before the reply: the last message's content when that message has
    the reply's role (``assistant``, or the last message's own without ``add_generation_prompt``)."""
    if not request.echo:
        return ""
    last = request.messages[-1]
    role = "assistant" if request.add_generation_prompt else last.role
    return last.text() if last.role == role else ""


def _logprobs(tokenizer: PreTrainedTokenizerBase, entries: list[TokenLogprobs]) -> ChatLogProbs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    return ChatLogProbs(content=[
        TokenLogprob(**top(lp.token_ids[0], lp.logprobs[0]).model_dump(),
                     top_logprobs=[top(t, v) for t, v in zip(lp.token_ids[1:], lp.logprobs[1:], strict=True)])
        for lp in entries])


async def create_chat_completion(request: ChatCompletionRequest, engine: AsyncLLM,
                                 tool_call_parser: str = "auto") -> Response | EventSourceResponse:
    """Run a chat request: a ``ChatCompletionResponse`` as JSON, or an SSE stream of chunks (``run_chat``'s).

    Raises:
        OpenAIError: as ``run_chat``.
    """
    result = await run_chat(request, engine, tool_call_parser)
    if isinstance(result, ChatCompletionResponse):  # with prompt logprobs it can be tens of MB
        return await json_response(result, off_loop=result.prompt_logprobs is not None)
    return sse_response(result)


async def run_chat(request: ChatCompletionRequest, engine: AsyncLLM, tool_call_parser: str = "auto"
                   ) -> ChatCompletionResponse | AsyncGenerator[ChatCompletionChunk, None]:
    """Run a chat request: a ``ChatCompletionResponse``, or (``stream``) its chunks, the first one already
    produced, so that a request the engine refuses raises here, before any response starts; an error
    after that is raised by the generator. Closing the generator aborts the request.

    ``tool_call_parser`` (``--tool-call-parser``) names the tool-call format, ``auto`` = the model's.

    Unset sampling fields take the model's defaults (``--generation-config``).
    Without ``max_completion_tokens`` / ``max_tokens`` the reply may use all the
    context the prompt leaves, up to the model's ``max_new_tokens`` if it has one.

    Raises:
        OpenAIError: 400 for invalid or unsupported input, 404 for an unknown
            model, 429 when the queue is full, 503 when the engine is down.
    """
    lora = resolve_model(request.model, engine)
    _check_supported(request)
    # Errors name the field the client set: chat's names for SamplingParams' max_tokens and logprobs.
    max_tokens_param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
    structured_outputs, structured_param = request.structured_output()
    plan = await plan_tools(request, structured_outputs, structured_param, engine.processor.grammars)
    tool_format = tool_parser_class(tool_call_parser, str(engine.tokenizer.chat_template or ""))
    parser = tool_format if plan is not None and plan.active else None
    if parser is not None:  # the reply is held to the call format (and the answer schema, if any)
        structured_outputs, structured_param = StructuredOutputsParams(grammar=parser.grammar(plan)), "tools"
    client_names = {"max_tokens": max_tokens_param, "logprobs": "top_logprobs", "structured_outputs": structured_param}
    requested = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    with engine_errors(client_names):
        params = request.to_sampling_params(requested, logprobs, request.prompt_logprobs,
                                            engine.default_sampling_params, structured_outputs)
        token_ids = await _prompt_token_ids(request, plan, tool_format, engine)
        await engine.processor.check_params_async(params)  # compiled off the loop; process() finds it cached
        prompt = engine.processor.process(token_ids, params, engine.default_sampling_params.get("max_tokens"), lora)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    outputs = engine.generate(prompt, request_id, kind)
    reasoning = engine.config.model_config.reasoning_parser
    stream = _ChatStream(request, engine.tokenizer, len(token_ids), params.n, client_names,
                         ChatCompletionChunk(id=request_id, created=unix_time(),
                                             model=request.model or engine.model_name, choices=[]), parser,
                         reasoning_format(reasoning) if reasoning is not None else None)
    if request.stream:
        return await first_chunk_awaited(stream.chunks(outputs))
    with engine_errors(client_names):
        async with aclosing(outputs):
            async for output in outputs:  # FINAL_ONLY: one output, once every choice is done
                final = output
    response = ChatCompletionResponse(
        id=request_id, created=stream.head.created, model=stream.head.model,
        choices=[stream.whole_choice(c) for c in final.outputs],
        usage=UsageInfo.of(len(token_ids), sum(len(c.token_ids) for c in final.outputs)))
    if request.prompt_logprobs is not None:  # prompt length x (k + 1) entries: converted off the event loop
        response.prompt_logprobs = await run_off_loop(prompt_logprobs, engine.tokenizer, final.prompt_logprobs or [])
    return response


async def tokenize_chat(request: ChatCompletionRequest | TokenizeRequest, engine: AsyncLLM,
                        tool_call_parser: str = "auto") -> list[int]:
    """The prompt token ids of a chat request's messages and tools, as ``run_chat`` renders them.

    Raises:
        OpenAIError: 400 for tools or messages that cannot be rendered, or a conversation too long for the model.
    """
    tool_format = tool_parser_class(tool_call_parser, str(engine.tokenizer.chat_template or ""))
    plan = await plan_tools(request, None, None, engine.processor.grammars)
    with engine_errors():
        return await _prompt_token_ids(request, plan, tool_format, engine)


async def _prompt_token_ids(request: ChatCompletionRequest | TokenizeRequest, plan: ToolPlan | None,
                            tool_format: type[ToolParser], engine: AsyncLLM) -> list[int]:
    """The messages (and, as ``plan`` has it, the tools) rendered by the model's chat template: checked by length,
    then rendered off the event loop when large, so that other clients never wait on it.

    Raises:
        InvalidRequestError: as ``InputProcessor.render_chat_async``; ``continue_final_message`` with
            ``add_generation_prompt``.
    """
    if request.continue_final_message and request.add_generation_prompt:
        raise InvalidRequestError("continue_final_message continues the last message, so add_generation_prompt "
                                  "(which starts a new one) must be false", "continue_final_message")
    messages, tools = render_inputs(request.messages, plan, tool_format, engine.tokenizer)
    return await engine.processor.render_chat_async(messages, request.add_generation_prompt, tools,
                                                    request.chat_template_kwargs, request.continue_final_message)


class _ChatStream:
    """The chunks of one streamed chat request, all sharing ``head``'s id and timestamp."""

    def __init__(self, request: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase,
                 num_prompt_tokens: int, n: int, client_names: dict[str, str], head: ChatCompletionChunk,
                 tool_parser: type[ToolParser] | None = None, reasoning: ReasoningFormat | None = None) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self.client_names = client_names
        self.head = head
        self.echo = _echoed_content(request)
        self.tool_parser = tool_parser
        # One tool parser (and reasoning splitter) per choice: each reply is parsed on its own.
        self.replies = {index: StreamedReply(tool_parser()) for index in range(n)} if tool_parser else None
        self.reasoning = reasoning
        self.reasoners = {index: ReasoningStream(reasoning) for index in range(n)} if reasoning else None

    def logprobs(self, completion: CompletionOutput) -> ChatLogProbs | None:
        return _logprobs(self.tokenizer, completion.logprobs or []) if self.request.logprobs else None

    def whole_choice(self, completion: CompletionOutput) -> ChatChoice:
        """A finished choice of a whole (not streamed) response."""
        reason = openai_finish_reason(completion.finish_reason)
        reasoning, text = None, completion.text
        if self.reasoning is not None:
            reasoning, text = split_reasoning(self.reasoning, completion.text)
            text = text or ""
        if self.tool_parser is None:
            message = AssistantMessage(content=self.echo + text)
        else:
            message, made_calls = reply_message(self.tool_parser(), text, self.echo)
            reason = tool_finish_reason(reason, made_calls)
        if self.reasoning is not None and not message.content:
            message.content = None  # a reply that is all reasoning has no content (null), as in vLLM
        message.reasoning_content = message.reasoning = reasoning
        return ChatChoice(index=completion.index, message=message, logprobs=self.logprobs(completion),
                          finish_reason=reason, stop_reason=completion.stop_reason)

    def _split(self, completion: CompletionOutput) -> tuple[str, str]:
        """A choice's new text as ``(reasoning, answer)``; all answer without a reasoning format."""
        if self.reasoners is None:
            return "", completion.text
        reasoner = self.reasoners[completion.index]
        reasoning, text = reasoner.feed(completion.text)
        if completion.finished:
            held_reasoning, held_text = reasoner.finish()
            reasoning, text = reasoning + held_reasoning, text + held_text
        return reasoning, text

    def _chunk(self, choice: ChatStreamChoice, num_output_tokens: int) -> ChatCompletionChunk:
        """A chunk of one choice, with its usage so far (``num_output_tokens``: the choice's own, as vLLM counts)
        under ``continuous_usage_stats``."""
        update = {"choices": [choice]}
        if self.request.continuous_usage:
            update["usage"] = UsageInfo.of(self.num_prompt_tokens, num_output_tokens)
        return self.head.model_copy(update=update)

    async def chunks(self, outputs: AsyncGenerator[RequestOutput, None]
                     ) -> AsyncGenerator[ChatCompletionChunk, None]:
        """The role chunks once the engine answers (and the echo chunks), a chunk per choice
        that advanced, then the usage chunk when asked for."""
        num_output_tokens = 0
        choice_tokens: dict[int, int] = {}  # by choice index
        started = False
        with engine_errors(self.client_names):
            async with aclosing(outputs):
                async for output in outputs:
                    if not started:
                        started = True
                        for index in range(self.n):
                            delta = DeltaMessage(role="assistant", content="")
                            yield self._chunk(ChatStreamChoice(index=index, delta=delta), 0)
                        if self.echo:
                            for index in range(self.n):
                                delta = DeltaMessage(content=self.echo)
                                yield self._chunk(ChatStreamChoice(index=index, delta=delta), 0)
                    for completion in output.outputs:
                        num_output_tokens += len(completion.token_ids)
                        choice_tokens[completion.index] = choice_tokens.get(completion.index, 0) + len(
                            completion.token_ids)
                        logprobs = self.logprobs(completion)
                        reasoning, text = self._split(completion)
                        content, tool_calls = text or None, None
                        reason = openai_finish_reason(completion.finish_reason)
                        if self.replies is not None:
                            reply = self.replies[completion.index]
                            content, tool_calls = reply.delta(text, completion.finished)
                            reason = tool_finish_reason(reason, reply.made_calls)
                        if (content or tool_calls or reasoning or (logprobs and logprobs.content)
                                or completion.finished):
                            delta = DeltaMessage(content=content, tool_calls=tool_calls,
                                                 reasoning_content=reasoning or None, reasoning=reasoning or None)
                            yield self._chunk(ChatStreamChoice(index=completion.index, delta=delta,
                                                               logprobs=logprobs, finish_reason=reason,
                                                               stop_reason=completion.stop_reason),
                                              choice_tokens[completion.index])
        if self.request.include_usage:
            usage = UsageInfo.of(self.num_prompt_tokens, num_output_tokens)
            yield self.head.model_copy(update={"usage": usage})
