"""``POST /v1/embeddings`` (OpenAI's) and ``POST /pooling`` (vLLM's): one vector per input, from a server started with
``--runner pooling`` (``pagedserve.engine.pooling_params``).

Each input is one engine request: a prompt that runs once through the same scheduler as generation (in chunks when
long, batched with the others), whose final hidden states the pooler turns into a vector; its KV blocks are freed
when it finishes. ``encoding_format`` ``base64`` sends each vector as its float32 little-endian bytes, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from contextlib import aclosing
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import StrictInt, ValidationError, field_validator

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.output_processor import RequestOutputKind
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.server.errors import engine_errors, resolve_model
from pagedserve.server.protocol import (
    UNSUPPORTED_FIELDS,
    OpenAIBaseModel,
    PromptInput,
    RequestBody,
    Text,
    check_fields,
    unix_time,
)

#: Most inputs in one request: OpenAI's limit.
MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    """``POST /v1/embeddings``; also ``/pooling``'s body. ``input``: a string, a list of strings, a list of token
    ids or a list of token-id lists."""

    unsupported_fields: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        "truncate_prompt_tokens": UNSUPPORTED_FIELDS["truncate_prompt_tokens"],
        "add_special_tokens": ("tokenizing without the special tokens", (True,))}

    model: Text | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: Text | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: Any) -> PromptInput:
        try:
            inputs = handler(value)
        except ValidationError:
            raise ValueError("input must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists") from None
        if isinstance(inputs, list) and not inputs:
            raise ValueError("input must hold at least one item")
        if isinstance(inputs, list) and len(inputs) > MAX_INPUTS and not isinstance(inputs[0], int):
            raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
        return inputs

    @field_validator("dimensions")
    @classmethod
    def _positive(cls, dimensions: int | None) -> int | None:
        if dimensions is not None and dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {dimensions}")
        return dimensions

    def prompts(self) -> list[str | list[int]]:
        """The inputs, one per vector."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


class Embedding(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of float32 little-endian bytes


class PoolingData(OpenAIBaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage


def _encoded(vector: Any, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype(np.float32).tobytes()).decode()
    return vector.tolist()


async def _pooled(engine: AsyncLLM, request: EmbeddingRequest) -> tuple[list[RequestOutput], int]:
    """Run every input of ``request``: their outputs, in input order, and their tokens in all.

    Raises:
        OpenAIError: 400 (naming the field) for an input or ``dimensions`` the engine refuses, or a generate
            runner; 404 for another model; 429 when the queue is full; 503 when the engine is down.
    """
    resolve_model(request.model, engine)  # a pooling server serves no adapters: any other name is a 404
    check_fields(request, request.unsupported_fields)
    params = PoolingParams(dimensions=request.dimensions)
    prompts = request.prompts()
    with engine_errors():
        processed = [await engine.processor.process_pooling_async(prompt, params) for prompt in prompts]
        base = f"embd-{uuid.uuid4().hex}"
        runs = [asyncio.ensure_future(_run(engine, item, f"{base}-{i}")) for i, item in enumerate(processed)]
        try:
            outputs = await asyncio.gather(*runs)
        finally:
            for run in runs:  # one failed (a full queue): the others are aborted, their blocks freed
                run.cancel()
    return outputs, sum(len(item.prompt_token_ids) for item in processed)


async def _run(engine: AsyncLLM, request: Any, request_id: str) -> RequestOutput:
    outputs = engine.generate(request, request_id, RequestOutputKind.FINAL_ONLY)
    async with aclosing(outputs):
        async for output in outputs:  # FINAL_ONLY: one output
            return output
    raise RuntimeError(f"request {request_id} ended with no output")


async def create_embedding(request: EmbeddingRequest, engine: AsyncLLM) -> EmbeddingResponse:
    """``POST /v1/embeddings``. Raises: OpenAIError: as ``_pooled``."""
    outputs, num_tokens = await _pooled(engine, request)
    return EmbeddingResponse(
        id=f"embd-{uuid.uuid4().hex}", created=unix_time(), model=engine.model_name,
        data=[Embedding(index=i, embedding=_encoded(o.pooling_output, request.encoding_format))
              for i, o in enumerate(outputs)],
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


async def create_pooling(request: EmbeddingRequest, engine: AsyncLLM) -> PoolingResponse:
    """vLLM's ``POST /pooling``: the same vectors as ``/v1/embeddings``, in vLLM's pooling shape."""
    embedded = await create_embedding(request, engine)
    return PoolingResponse(id=f"pool-{embedded.id.removeprefix('embd-')}", created=embedded.created,
                           model=embedded.model, usage=embedded.usage,
                           data=[PoolingData(index=item.index, data=item.embedding) for item in embedded.data])

