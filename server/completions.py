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
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from sse_starlette import EventSourceResponse
from transformers import PreTrainedTokenizerBase

from engine.async_llm import AsyncLLM
from engine.input_processor import ProcessedRequest, PromptType
from engine.output_processor import RequestOutputKind
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from server.errors import (
    bad_request,
    check_model,
    engine_errors,
)
from server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    PromptInput,
    UsageInfo,
    first_chunk_awaited,
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


class _ChoiceBuilder:
    """Turns engine outputs into choices: a whole completion, or one streamed delta.

    The first piece of each choice carries the echoed prompt (and, with
    ``logprobs``, the prompt's logprobs); ``text_offset`` runs on across pieces.
    """

    def __init__(self, request: CompletionRequest, prompts: list[ProcessedRequest], n: int,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self.request = request
        self.prompts = prompts
        self.n = n
        self.tokenizer = tokenizer
        self._prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}  # by prompt index
        self._next_offset: dict[int, int] = {}  # choice index -> text offset of its next token

    def choices(self, prompt_index: int, output: RequestOutput) -> list[CompletionChoice]:
        # Delta mode sends the prompt's logprobs once, but each of its n choices echoes them.
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = output.prompt_logprobs
        return [self._choice(prompt_index, completion) for completion in output.outputs]

    def _choice(self, prompt_index: int, completion: CompletionOutput) -> CompletionChoice:
        index = prompt_index * self.n + completion.index
        text = completion.text
        tokens: list[tuple[int, TokenLogprobs | None]] = []
        if index not in self._next_offset:
            self._next_offset[index] = 0
            if self.request.echo:
                prompt = self.prompts[prompt_index]
                prompt_text = self.tokenizer.decode(prompt.prompt_token_ids) if prompt.prompt is None else prompt.prompt
                text = prompt_text + text
                echoed_logprobs = self._prompt_logprobs.get(prompt_index, [])  # empty when not asked for
                tokens.extend(zip(prompt.prompt_token_ids, echoed_logprobs, strict=False))
        tokens.extend((lp.token_ids[0], lp) for lp in completion.logprobs or [])
        logprobs = None if self.request.logprobs is None else self._logprobs(index, tokens)
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=openai_finish_reason(completion.finish_reason))
        if self.request.prompt_logprobs is not None:  # never streamed: this is the whole choice
            choice.prompt_logprobs = prompt_logprobs(self.tokenizer, self._prompt_logprobs[prompt_index])
        return choice

    def _logprobs(self, index: int, tokens: list[tuple[int, TokenLogprobs | None]]) -> CompletionLogProbs:
        """Logprobs of ``tokens`` (None for the first prompt token, which has none)."""
        result = CompletionLogProbs()
        offset = self._next_offset[index]
        for token_id, lp in tokens:
            token = self.tokenizer.decode([token_id])
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            result.token_logprobs.append(None if lp is None else lp.logprobs[0])
            result.top_logprobs.append(None if lp is None else {
                self.tokenizer.decode([t]): v for t, v in zip(lp.token_ids, lp.logprobs, strict=True)})
        self._next_offset[index] = offset
        return result


async def create_completion(request: CompletionRequest,
                            engine: AsyncLLM) -> CompletionResponse | EventSourceResponse:
    """Run a completions request: a ``CompletionResponse``, or an SSE stream of chunks.

    Unset sampling fields take the model's defaults (``--generation-config``);
    its ``max_new_tokens`` caps ``max_tokens: null``, while a ``max_tokens`` left
    out is OpenAI's 16.

    Raises:
        OpenAIError: 400 for invalid or unsupported input, 404 for an unknown
            model, 429 when the queue is full, 503 when the engine is down.
    """
    check_model(request.model, engine.model_name)
    request.check()
    raw_prompts = _split_prompts(request.prompt)
    # As in vLLM: echo with logprobs asks for the prompt's logprobs, to echo them.
    num_prompt_logprobs = request.prompt_logprobs
    if num_prompt_logprobs is None and request.echo:
        num_prompt_logprobs = request.logprobs
    structured_outputs, structured_param = request.structured_output()
    with engine_errors({"structured_outputs": structured_param}):
        params = request.to_sampling_params(request.max_tokens, logprobs=request.logprobs,
                                            prompt_logprobs=num_prompt_logprobs,
                                            defaults=engine.default_sampling_params,
                                            structured_outputs=structured_outputs)
        # Every prompt is checked before any is queued.
        default_max_tokens = engine.default_sampling_params.get("max_tokens")
        # Each checked by length, then tokenized off the event loop when large.
        prompts = [await engine.processor.process_async(p, params, default_max_tokens) for p in raw_prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    outputs = _merge([engine.generate(p, f"{request_id}-{i}", kind) for i, p in enumerate(prompts)])
    builder = _ChoiceBuilder(request, prompts, params.n, engine.tokenizer)
    response = CompletionResponse(id=request_id, created=unix_time(), model=engine.model_name, choices=[])
    num_prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    if request.stream:
        chunks = _chunks(response, request.include_usage, num_prompt_tokens, builder, outputs)
        return sse_response(await first_chunk_awaited(chunks))
    num_output_tokens = 0
    with engine_errors():
        async with aclosing(outputs):
            async for prompt_index, output in outputs:
                response.choices.extend(builder.choices(prompt_index, output))
                num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
    response.choices.sort(key=lambda choice: choice.index)
    response.usage = UsageInfo.of(num_prompt_tokens, num_output_tokens)
    return response


async def _chunks(head: CompletionResponse, include_usage: bool, num_prompt_tokens: int,
                  builder: _ChoiceBuilder, outputs: AsyncGenerator[tuple[int, RequestOutput], None]
                  ) -> AsyncGenerator[CompletionResponse, None]:
    """One chunk per choice that advanced, then the usage chunk when asked for."""
    num_output_tokens = 0
    with engine_errors():
        async with aclosing(outputs):
            async for prompt_index, output in outputs:
                choices = builder.choices(prompt_index, output)
                for choice, completion in zip(choices, output.outputs, strict=True):
                    num_output_tokens += len(completion.token_ids)
                    has_logprobs = choice.logprobs is not None and choice.logprobs.tokens
                    if choice.text or has_logprobs or completion.finished:
                        yield head.model_copy(update={"choices": [choice]})
    if include_usage:
        yield head.model_copy(update={"usage": UsageInfo.of(num_prompt_tokens, num_output_tokens)})


@dataclass
class _Finished:
    error: Exception | None


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]
                 ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave the prompts' output streams as they produce, tagging each output
    with its prompt's index. The first error of any stream is raised; closing the
    merged stream closes them all (which aborts their requests)."""
    queue: asyncio.Queue[tuple[int, RequestOutput | _Finished]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        error = None
        try:
            async with aclosing(stream):
                async for output in stream:
                    queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            error = exc
        queue.put_nowait((index, _Finished(error)))

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
