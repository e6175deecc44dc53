"""The naive server people write first: FastAPI around ``model.generate``.

One request at a time (an asyncio lock), no batching, no KV cache reuse across
requests, text streamed through ``TextIteratorStreamer`` (which releases text
at word boundaries, so a chunk may hold several tokens). It is the floor our
engine must beat, served with the same SmolLM2 GGUF dequantized to fp32.

    python -m benchmarks.baselines.naive_server --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)

from benchmarks.model_files import default_gguf_path

MODEL_NAME = "SmolLM2-135M-Instruct"


class _Request(BaseModel):
    """Fields shared by both endpoints; unknown fields (n_predict, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False


class CompletionRequest(_Request):
    """POST /v1/completions body."""

    prompt: str | list[int]


class ChatMessage(BaseModel):
    """One chat turn."""

    role: str
    content: str


class ChatRequest(_Request):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage]


@dataclass
class _Generation:
    """One ``generate`` call running in a worker thread."""

    streamer: TextIteratorStreamer
    done: Future  # resolves to the number of generated tokens
    cancel: threading.Event


class _Cancelled(StoppingCriteria):
    """Stops ``generate`` once the client has gone away."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> bool:
        return self.event.is_set()


class NaiveEngine:
    """The model plus the lock that makes requests run one after another."""

    def __init__(self) -> None:
        path = default_gguf_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        self.max_len = int(self.model.config.max_position_embeddings)
        self.lock = asyncio.Lock()

    def _start(self, input_ids: list[int], request: _Request, max_new_tokens: int) -> _Generation:
        """Launch ``generate`` in a thread; text arrives through the streamer."""
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancel = threading.Event()
        sampling: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if request.temperature > 0:
            sampling = {"do_sample": True, "temperature": request.temperature,
                        "top_p": request.top_p, "top_k": 0}
        if request.ignore_eos:
            # min_new_tokens masks EOS until max_new_tokens is reached.
            sampling["min_new_tokens"] = max_new_tokens
        done: Future = Future()

        def run() -> None:
            try:
                with torch.inference_mode():
                    out = self.model.generate(
                        input_ids=torch.tensor([input_ids]),
                        attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
                        max_new_tokens=max_new_tokens, streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]),
                        pad_token_id=self.tokenizer.eos_token_id, **sampling)
                done.set_result(out.shape[1] - len(input_ids))
            except BaseException as exc:  # the streamer must end or the reader waits forever
                streamer.end()
                done.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return _Generation(streamer, done, cancel)

    def max_new_tokens(self, num_prompt_tokens: int, request: _Request) -> int:
        """Tokens the request may generate: ``max_tokens`` capped by the context window.

        Raises:
            ValueError: when the prompt leaves no room in the context window.
        """
        room = self.max_len - num_prompt_tokens
        if room <= 0:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens exceeds the {self.max_len}-token context")
        return min(request.max_tokens or room, room)

    async def generate(self, input_ids: list[int], request: _Request, max_new_tokens: int,
                       usage: dict[str, int]) -> AsyncIterator[str]:
        """Yield text pieces once the lock is ours; fills ``usage`` (token counts) when done."""
        async with self.lock:
            generation = self._start(input_ids, request, max_new_tokens)
            pieces = iter(generation.streamer)
            try:
                while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                    if piece:
                        yield piece
                num_generated = await asyncio.wrap_future(generation.done)
            finally:
                generation.cancel.set()
                # Hold the lock until the thread is really finished with the model.
                await asyncio.wrap_future(generation.done)
        usage |= {"prompt_tokens": len(input_ids), "completion_tokens": num_generated,
                  "total_tokens": len(input_ids) + num_generated}


def _chunk(kind: str, request_id: str, model: str, piece: str | None, finish_reason: str | None) -> dict:
    """One OpenAI streaming chunk; ``piece`` None means an empty final delta."""
    if kind == "chat":
        delta = {"content": piece} if piece is not None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def create_app(engine: NaiveEngine) -> FastAPI:
    """The HTTP routes around ``engine``."""
    app = FastAPI(title="naive transformers server")

    async def respond(kind: str, input_ids: list[int], request: _Request) -> Any:
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        model = request.model or MODEL_NAME
        max_new_tokens = engine.max_new_tokens(len(input_ids), request)
        usage: dict[str, int] = {}

        def finish_reason() -> str:
            return "length" if usage["completion_tokens"] >= max_new_tokens else "stop"

        if not request.stream:
            pieces = engine.generate(input_ids, request, max_new_tokens, usage)
            text = "".join([piece async for piece in pieces])
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if kind == "chat"
                      else {"index": 0, "text": text, "logprobs": None})
            return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": int(time.time()), "model": model,
                    "choices": [choice | {"finish_reason": finish_reason()}], "usage": usage}

        async def events() -> AsyncIterator[str]:
            if kind == "chat":
                first = _chunk(kind, request_id, model, "", None)
                first["choices"][0]["delta"]["role"] = "assistant"
                yield f"data: {json.dumps(first)}\n\n"
            async for piece in engine.generate(input_ids, request, max_new_tokens, usage):
                yield f"data: {json.dumps(_chunk(kind, request_id, model, piece, None))}\n\n"
            yield f"data: {json.dumps(_chunk(kind, request_id, model, None, finish_reason()))}\n\n"
            if (request.stream_options or {}).get("include_usage"):
                final = {"id": request_id, "object": _chunk(kind, request_id, model, None, None)["object"],
                         "created": int(time.time()), "model": model, "choices": [], "usage": usage}
                yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "naive_server"}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> Any:
        ids = (request.prompt if isinstance(request.prompt, list)
               else engine.tokenizer.encode(request.prompt, add_special_tokens=False))
        return await respond("completions", ids, request)

    @app.post("/v1/chat/completions")
    async def chat(request: ChatRequest) -> Any:
        text = engine.tokenizer.apply_chat_template(
            [m.model_dump() for m in request.messages], add_generation_prompt=True, tokenize=False)
        return await respond("chat", engine.tokenizer.encode(text, add_special_tokens=False), request)

    @app.exception_handler(ValueError)
    async def bad_request(_: Any, exc: ValueError) -> JSONResponse:
        error = {"message": str(exc), "type": "BadRequestError"}
        return JSONResponse(status_code=400, content={"error": error})

    return app


def main(argv: list[str] | None = None) -> None:
    """Load the model and serve until interrupted."""
    parser = argparse.ArgumentParser(description="Naive one-request-at-a-time transformers server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    uvicorn.run(create_app(NaiveEngine()), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
