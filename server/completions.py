"""``POST /v1/completions``: prompts in, text out, whole or streamed.

Each prompt runs as one engine request with ``n`` completions; choice ``index``
is ``prompt_index * n + completion_index``, as in OpenAI's API. Logprobs use
the legacy completions shape (parallel ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset`` lists); vLLM's ``prompt_logprobs`` come in
each choice, in vLLM's shape.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from dataclasses import dataclass

from sse_starlette import EventSourceResponse
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.input_processor import ProcessedRequest, PromptType, run_off_loop
from pagedserve.engine.output_processor import RequestOutputKind
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedserve.server.errors import (
    bad_request,
    engine_errors,
    resolve_model,
)
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    PromptInput,
    PromptLogprobs,
    TokenTexts,
    UsageInfo,
    first_chunk_awaited,
    json_response,
    openai_finish_reason,
    prompt_logprobs,
    sse_response,
    unix_time,
)


def _split_prompts(prompt: PromptInput) -> list[PromptType]:
    """The prompts of the request: one text or one list of token ids each.

    Raises:
        OpenAIError: 400 when the request holds no prompt.
    """
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


@dataclass
class _PromptPart:
    """What the choices of one prompt share, converted once per prompt (not per choice).

    Attributes:
        echo_text: the prompt's text with ``echo``, else "".
        echo_logprobs: with ``echo`` and ``logprobs``, the prompt's tokens in the legacy shape (offsets from 0).
        echo_end: the text offset after the echoed prompt (0 without ``echo``).
        prompt_logprobs: with ``prompt_logprobs``, in vLLM's shape: one list, which each choice carries.
    """

    echo_text: str = ""
    echo_logprobs: CompletionLogProbs | None = None
    echo_end: int = 0
    prompt_logprobs: PromptLogprobs | None = None


def _legacy_logprobs(texts: TokenTexts, tokens: Iterable[tuple[int, TokenLogprobs | None]],
                     offset: int) -> tuple[CompletionLogProbs, int]:
    """``tokens`` (id, logprobs: None for the first prompt token, which has none) in the legacy shape,
    their ``text_offset`` running on from ``offset``; and the offset after them."""
    result = CompletionLogProbs()
    for token_id, lp in tokens:
        token = texts[token_id]
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        result.token_logprobs.append(None if lp is None else lp.logprobs[0])
        result.top_logprobs.append(None if lp is None else {
            texts[t]: v for t, v in zip(lp.token_ids, lp.logprobs, strict=True)})
    return result, offset


def _joined(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    """``first``'s tokens then ``second``'s, in new lists (``first`` is shared between choices)."""
    return CompletionLogProbs.model_construct(**{name: getattr(first, name) + getattr(second, name)
                                                 for name in CompletionLogProbs.model_fields})


class _ChoiceBuilder:
    """Turns engine outputs into choices: a whole completion, or one streamed delta.

    The first piece of each choice carries the echoed prompt (and, with
    ``logprobs``, the prompt's logprobs); ``text_offset`` runs on across pieces.
    The prompt's part is converted once per prompt, off the event loop when it has prompt logprobs
    (prompt length x (k + 1) entries), and shared by its ``n`` choices.
    """

    def __init__(self, request: CompletionRequest, prompts: list[ProcessedRequest], n: int,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self.request = request
        self.prompts = prompts
        self.n = n
        self.tokenizer = tokenizer
        self._texts = TokenTexts(tokenizer)  # of the generated tokens, decoded on the event loop
        self._prompt_parts: dict[int, _PromptPart] = {}  # by prompt index
        self._next_offset: dict[int, int] = {}  # choice index -> text offset of its next token

    async def choices(self, prompt_index: int, output: RequestOutput) -> list[CompletionChoice]:
        """The choices of ``output``, one per completion in it."""
        if prompt_index not in self._prompt_parts:  # its first output, which brings the prompt's logprobs
            entries = output.prompt_logprobs or []
            self._prompt_parts[prompt_index] = (await run_off_loop(self._prompt_part, prompt_index, entries)
                                                if entries else self._prompt_part(prompt_index, entries))
        return [self._choice(prompt_index, completion) for completion in output.outputs]

    def _prompt_part(self, prompt_index: int, entries: list[TokenLogprobs | None]) -> _PromptPart:
        part = _PromptPart()
        if self.request.prompt_logprobs is not None:
            part.prompt_logprobs = prompt_logprobs(self.tokenizer, entries)
        if self.request.echo:
            prompt = self.prompts[prompt_index]
            part.echo_text = self.tokenizer.decode(prompt.prompt_token_ids) if prompt.prompt is None else prompt.prompt
            if self.request.logprobs is not None:  # then the request asked for the prompt's logprobs too
                part.echo_logprobs, part.echo_end = _legacy_logprobs(
                    TokenTexts(self.tokenizer), zip(prompt.prompt_token_ids, entries, strict=False), 0)
        return part

    def _choice(self, prompt_index: int, completion: CompletionOutput) -> CompletionChoice:
        index = prompt_index * self.n + completion.index
        part = self._prompt_parts[prompt_index]
        first = index not in self._next_offset
        offset = part.echo_end if first else self._next_offset[index]
        generated = [(lp.token_ids[0], lp) for lp in completion.logprobs or []]
        logprobs, self._next_offset[index] = _legacy_logprobs(self._texts, generated, offset)
        if first and part.echo_logprobs is not None:
            logprobs = _joined(part.echo_logprobs, logprobs)
        choice = CompletionChoice(index=index, text=part.echo_text + completion.text if first else completion.text,
                                  logprobs=None if self.request.logprobs is None else logprobs,
                                  finish_reason=openai_finish_reason(completion.finish_reason),
                                  stop_reason=completion.stop_reason)
        # Assigned, not validated: the one list every choice of the prompt shares (never streamed).
        choice.prompt_logprobs = part.prompt_logprobs
        return choice


async def create_completion(request: CompletionRequest, engine: AsyncLLM) -> Response | EventSourceResponse:
    """Run a completions request: a ``CompletionResponse`` as JSON, or an SSE stream of chunks.

    Unset sampling fields take the model's defaults (``--generation-config``);
    its ``max_new_tokens`` caps ``max_tokens: null``, while a ``max_tokens`` left
    out is OpenAI's 16.

    Raises:
        OpenAIError: 400 for invalid or unsupported input, 404 for an unknown
            model, 429 when the queue is full, 503 when the engine is down.
    """
    lora = resolve_model(request.model, engine)
    request.check()
    raw_prompts = _split_prompts(request.prompt)
    # As in vLLM: echo with logprobs asks for the prompt's logprobs, to echo them.
    num_prompt_logprobs = request.prompt_logprobs
    if num_prompt_logprobs is None and request.echo:
        num_prompt_logprobs = request.logprobs
    structured_outputs, structured_param = request.structured_output()
    # A grammar fails at admission or while generating: either way the client hears its own field's name.
    client_names = {"structured_outputs": structured_param}
    with engine_errors(client_names):
        params = request.to_sampling_params(request.max_tokens, logprobs=request.logprobs,
                                            prompt_logprobs=num_prompt_logprobs,
                                            defaults=engine.default_sampling_params,
                                            structured_outputs=structured_outputs)
        # Every prompt is checked before any is queued.
        default_max_tokens = engine.default_sampling_params.get("max_tokens")
        # Each checked by length, then tokenized off the event loop when large.
        prompts = [await engine.processor.process_async(p, params, default_max_tokens, lora) for p in raw_prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    outputs = _merge([engine.generate(p, f"{request_id}-{i}", kind) for i, p in enumerate(prompts)])
    builder = _ChoiceBuilder(request, prompts, params.n, engine.tokenizer)
    response = CompletionResponse(id=request_id, created=unix_time(), model=request.model or engine.model_name,
                                  choices=[])
    num_prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    if request.stream:
        chunks = _chunks(response, request, num_prompt_tokens, builder, outputs, client_names)
        return sse_response(await first_chunk_awaited(chunks))
    num_output_tokens = 0
    with engine_errors(client_names):
        async with aclosing(outputs):
            async for prompt_index, output in outputs:
                response.choices.extend(await builder.choices(prompt_index, output))
                num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
    response.choices.sort(key=lambda choice: choice.index)
    response.usage = UsageInfo.of(num_prompt_tokens, num_output_tokens)
    # With prompt logprobs it can be tens of MB.
    return await json_response(response, off_loop=num_prompt_logprobs is not None)


async def _chunks(head: CompletionResponse, request: CompletionRequest, num_prompt_tokens: int,
                  builder: _ChoiceBuilder, outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                  client_names: dict[str, str]) -> AsyncGenerator[CompletionResponse, None]:
    """One chunk per choice that advanced (with that choice's usage so far under ``continuous_usage_stats``: its
    prompt's tokens and its own, as vLLM counts), then the usage chunk when asked for."""
    num_output_tokens = 0
    choice_tokens: dict[int, int] = {}  # by choice index
    with engine_errors(client_names):
        async with aclosing(outputs):
            async for prompt_index, output in outputs:
                choices = await builder.choices(prompt_index, output)
                for choice, completion in zip(choices, output.outputs, strict=True):
                    num_output_tokens += len(completion.token_ids)
                    choice_tokens[choice.index] = choice_tokens.get(choice.index, 0) + len(completion.token_ids)
                    has_logprobs = choice.logprobs is not None and choice.logprobs.tokens
                    if choice.text or has_logprobs or completion.finished:
                        update = {"choices": [choice]}
                        if request.continuous_usage:
                            update["usage"] = UsageInfo.of(len(builder.prompts[prompt_index].prompt_token_ids),
                                                           choice_tokens[choice.index])
                        yield head.model_copy(update=update)
    if request.include_usage:
        yield head.model_copy(update={"usage": UsageInfo.of(num_prompt_tokens, num_output_tokens)})


@dataclass
class _Finished:
    error: Exception | None


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]
                 ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave the prompts' output streams as they produce, tagging each output
    with its prompt's index. The first error of any stream is raised; closing the
    merged stream closes them all (which aborts their requests)."""
    # One output per stream at most: the others wait in the engine's streams, which bound what a consumer
    # that stopped reading holds (``max_stream_backlog_tokens``).
    queue: asyncio.Queue[tuple[int, RequestOutput | _Finished]] = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        error = None
        try:
            async with aclosing(stream):
                async for output in stream:
                    await queue.put((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            error = exc
        await queue.put((index, _Finished(error)))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if not isinstance(item, _Finished):
                yield index, item
                continue
            num_running -= 1
            if item.error is not None:
                raise item.error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
