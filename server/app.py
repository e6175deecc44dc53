"""The FastAPI application: routes, access control, and the engine's lifetime.

``build_app(engine_args, server_args)`` returns an app whose lifespan creates
the ``AsyncLLM`` at startup and shuts it down gracefully at exit; pass
``engine=`` instead to serve an engine someone else owns (tests, several apps
on one engine).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve import __version__
from pagedserve.engine.async_llm import AsyncLLM, LoadedClient
from pagedserve.engine.config import EngineArgs, parse_size, setting
from pagedserve.server.chat import create_chat_completion, tokenize_chat
from pagedserve.server.completions import create_completion
from pagedserve.server.dashboard import router as dashboard_router
from pagedserve.server.dashboard import static_files as dashboard_static_files
from pagedserve.server.embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingResponse,
    create_embedding,
    create_pooling,
)
from pagedserve.server.errors import (
    AnthropicErrorResponse,
    BodySizeLimitMiddleware,
    ErrorResponse,
    OpenAIError,
    add_exception_handlers,
    anthropic_route,
    bad_request,
    check_token_ids,
    engine_errors,
    resolve_model,
)
from pagedserve.server.logging_config import LOG_FORMATS
from pagedserve.server.messages import count_message_tokens, create_message
from pagedserve.server.messages_protocol import Message, MessagesPrompt, MessagesRequest, MessageTokensCount
from pagedserve.server.metrics_route import engine_stats
from pagedserve.server.metrics_route import router as metrics_router
from pagedserve.server.models import load_lora_adapter, model_card, model_cards, unload_lora_adapter
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    check_fields,
)
from pagedserve.server.responses import ResponseStore, create_response, response_not_found, retrieve_response
from pagedserve.server.responses_protocol import DeletedResponse, ResponsesRequest
from pagedserve.server.responses_protocol import Response as ResponsesResponse
from pagedserve.server.tool_calling import TOOL_PARSER_CHOICES

logger = logging.getLogger(__name__)


@dataclass
class ServerArgs:
    """The HTTP server's settings (the engine's are ``EngineArgs``)."""

    host: str = setting("127.0.0.1", "Address to listen on; 0.0.0.0 for every interface")
    port: int = setting(8000, "TCP port to listen on")
    api_key: str | None = setting(
        None, "Require 'Authorization: Bearer <key>' (or 'x-api-key: <key>') on /v1/*, /tokenize, /detokenize and "
        "/pooling; empty = open (env PAGEDSERVE_API_KEY)")
    allowed_origins: list[str] = setting(
        [], "Origins allowed to call the API from a browser (CORS), '*' for any; empty = CORS off")
    max_request_body_bytes: int | str = setting("16MiB", "Largest request body accepted (HTTP 413 above)",
                                                "bytes")
    shutdown_timeout: float = setting(
        30.0, "On SIGINT/SIGTERM, how long in-flight requests may run before they are aborted", "seconds")
    log_format: str = setting("text", "Log lines as readable text or as JSON objects (ours and uvicorn's)",
                              choices=LOG_FORMATS)
    access_log: bool = setting(False, "Log one line per HTTP request")
    log_stats_interval_s: float = setting(
        5.0, "While the engine is busy, log throughput, queue, KV cache and prefix-cache stats this often; "
        "0 = off", "seconds")
    disable_fastapi_docs: bool = setting(
        False, "Serve no /docs, /redoc nor /openapi.json; they stay open otherwise, api_key or not, as in "
        "vLLM (they describe the API, not its data)")
    tool_call_parser: str = setting(
        "auto", "How the model writes tool calls, for chat requests with tools; auto = the format its chat "
        "template shows, else hermes (<tool_call> JSON </tool_call>)", choices=TOOL_PARSER_CHOICES)

    def __post_init__(self) -> None:
        self.max_request_body_bytes = parse_size(self.max_request_body_bytes)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_stats_interval_s < 0:
            raise ValueError(f"log_stats_interval_s must be >= 0, got {self.log_stats_interval_s}")
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {TOOL_PARSER_CHOICES}, got {self.tool_call_parser!r}")


class APIKeyMiddleware:
    """Answer 401 on the API routes unless the request carries the key, as ``Authorization: Bearer <key>``
    (the scheme in any case, as RFC 9110 has it) or as Anthropic's clients send it, ``x-api-key: <key>``;
    400 when it carries more than one of either header.

    ``/health``, ``/version``, ``/metrics`` and the docs stay open for probes, scrapers and readers.
    CORS preflights carry no credentials: the CORS middleware, outside this one, answers them.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    @staticmethod
    def _protected(path: str) -> bool:
        return path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/pooling")

    def _authorized(self, bearer: bytes | None, api_key: bytes | None) -> bool:
        """Whether ``bearer`` (the Authorization header's value: ``Bearer``, one or more spaces, the key) or
        ``api_key`` (x-api-key's) holds the key."""
        # The key in constant time, so that response timing does not reveal how much of a guess was right.
        if api_key is not None and hmac.compare_digest(api_key, self.expected):
            return True
        scheme, _, key = (bearer or b"").partition(b" ")
        return hmac.compare_digest(key.lstrip(b" "), self.expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._protected(scope["path"]):
            path = scope["path"]
            given = {name: [value for key, value in scope["headers"] if key == name]
                     for name in (b"authorization", b"x-api-key")}
            for name, values in given.items():
                if len(values) > 1:
                    # Proxies and frameworks disagree on which one counts: refuse rather than guess.
                    error = OpenAIError(HTTPStatus.BAD_REQUEST, f"Send one {name.decode()} header, not "
                                        f"{len(values)}.", code="duplicate_authorization")
                    await error.response(path=path)(scope, receive, send)
                    return
            bearer, api_key = (values[0] if values else None for values in given.values())
            if not self._authorized(bearer, api_key):
                error = OpenAIError(HTTPStatus.UNAUTHORIZED, "Invalid or missing API key: send "
                                    "'Authorization: Bearer <key>' or 'x-api-key: <key>'.", code="invalid_api_key")
                await error.response(path=path)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _errors(*statuses: int, body: type = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route answers, each with OpenAI's error body (or ``body``)."""
    return {status: {"model": body, "description": HTTPStatus(status).phrase} for status in statuses}


#: Every body a POST route reads can be refused as invalid (400) or too large (413).
_BODY_ERRORS = (HTTPStatus.BAD_REQUEST, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
#: What a generation route answers besides its own: an unknown model, a full queue, an engine down.
_GENERATION_STATUSES = (*_BODY_ERRORS, HTTPStatus.NOT_FOUND, HTTPStatus.TOO_MANY_REQUESTS,
                        HTTPStatus.SERVICE_UNAVAILABLE)
_GENERATION_ERRORS = _errors(*_GENERATION_STATUSES)


def _generation_responses(response: type, description: str) -> dict[int | str, dict[str, Any]]:
    """The 200 of a generation route: ``response`` as JSON, or with ``stream`` a server-sent event
    stream of its chunks, then ``data: [DONE]``; and its errors."""
    # One event as OpenAPI tools parse a stream (schemathesis validates each one against it): an object
    # of the event's fields, not the stream's text.
    stream = {"schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
                         "description": "Server-sent events: 'data: <chunk JSON>' each, then 'data: [DONE]'; an "
                         "error after the first chunk is 'data: {\"error\": ...}'."}}
    return {200: {"model": response, "description": description, "content": {"text/event-stream": stream}},
            **_GENERATION_ERRORS}


def _engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


Engine = Annotated[AsyncLLM, Depends(_engine)]
router = APIRouter()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, handler: Coroutine[Any, Any, Any]) -> Any:
    """Run ``handler``, cancelling it if the client goes away first.

    Starlette does not cancel a handler when its client disconnects; cancelling
    closes the engine's output stream, which aborts the request and frees its
    KV blocks. (Once a stream has started, sse-starlette watches the connection.)
    """
    work = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return work.result()


@router.post("/v1/completions", response_model=None, responses=_generation_responses(
    CompletionResponse, "The completion, or with stream a stream of CompletionResponse chunks"))
async def completions(body: CompletionRequest, request: Request, engine: Engine) -> Any:
    return await _cancel_on_disconnect(request, create_completion(body, engine))


@router.post("/v1/chat/completions", response_model=None, responses=_generation_responses(
    ChatCompletionResponse, "The chat completion, or with stream a stream of ChatCompletionChunk"))
async def chat_completions(body: ChatCompletionRequest, request: Request, engine: Engine) -> Any:
    return await _cancel_on_disconnect(request, create_chat_completion(body, engine,
                                                                       request.app.state.tool_call_parser))


#: One server-sent event of a streamed response: its type, and its JSON with the same ``type``.
_RESPONSES_STREAM = {"schema": {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string", "contentMediaType": "application/json"}},
    "description": "Server-sent events, each 'event: <type>' and 'data: <event JSON>'; the last is "
                   "response.completed, response.incomplete or response.failed"}}


@router.post("/v1/responses", response_model=None, responses={
    200: {"model": ResponsesResponse, "description": "The response, or with stream its typed events",
          "content": {"text/event-stream": _RESPONSES_STREAM}}, **_GENERATION_ERRORS})
async def responses(body: ResponsesRequest, request: Request, engine: Engine) -> Any:
    return await _cancel_on_disconnect(request, create_response(body, engine, ResponseStore.of(request.app),
                                                                request.app.state.tool_call_parser))


@router.get("/v1/responses/{response_id}", responses=_errors(HTTPStatus.NOT_FOUND))
async def get_response(response_id: str, request: Request) -> ResponsesResponse:
    """A stored response (``store``, the default); 404 once it is deleted, expired or evicted."""
    return retrieve_response(ResponseStore.of(request.app), response_id)


@router.delete("/v1/responses/{response_id}", responses=_errors(HTTPStatus.NOT_FOUND))
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    if not ResponseStore.of(request.app).delete(response_id):
        raise response_not_found(response_id)
    return DeletedResponse(id=response_id)


@router.post("/v1/embeddings", responses=_errors(*_GENERATION_STATUSES))
async def embeddings(body: EmbeddingRequest, request: Request, engine: Engine) -> EmbeddingResponse:
    """One vector per input, from a server started with ``--runner pooling`` (``pagedserve.server.embeddings``)."""
    return await _cancel_on_disconnect(request, create_embedding(body, engine))


@router.post("/pooling", responses=_errors(*_GENERATION_STATUSES))
async def pooling(body: EmbeddingRequest, request: Request, engine: Engine) -> PoolingResponse:
    """vLLM's pooling route: the vectors of ``/v1/embeddings`` in vLLM's shape."""
    return await _cancel_on_disconnect(request, create_pooling(body, engine))


#: One server-sent event of a streamed message: its type, and its JSON with the same ``type``.
_MESSAGES_STREAM = {"schema": {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string", "contentMediaType": "application/json"}},
    "description": "Server-sent events, each 'event: <type>' and 'data: <event JSON>': message_start, each content "
                   "block's content_block_start, content_block_delta and content_block_stop, then message_delta and "
                   "message_stop; or an error event"}}


@router.post("/v1/messages", response_model=None, responses={
    200: {"model": Message, "description": "The message, or with stream its events",
          "content": {"text/event-stream": _MESSAGES_STREAM}},
    **_errors(*_GENERATION_STATUSES, body=AnthropicErrorResponse)})
async def messages(body: MessagesRequest, request: Request, engine: Engine) -> Any:
    """Anthropic's Messages API (``pagedserve.server.messages``); errors in Anthropic's shape."""
    return await _cancel_on_disconnect(request, create_message(body, engine, request.app.state.tool_call_parser))


@router.post("/v1/messages/count_tokens", responses=_errors(*_BODY_ERRORS, HTTPStatus.NOT_FOUND,
                                                           body=AnthropicErrorResponse))
async def count_tokens(body: MessagesPrompt, request: Request, engine: Engine) -> MessageTokensCount:
    """The tokens of a Messages API request's prompt (its ``usage.input_tokens``)."""
    return await count_message_tokens(body, engine, request.app.state.tool_call_parser)


@router.get("/v1/models")
async def models(engine: Engine) -> ModelList:
    """The served model and its LoRA adapters (``pagedserve.server.models``)."""
    return ModelList(data=model_cards(engine))


# ``:path``: a hub id has a slash (``org/name``), which the openai SDK sends as %2F.
@router.get("/v1/models/{model_id:path}", responses=_errors(HTTPStatus.NOT_FOUND))
async def retrieve_model(model_id: str, engine: Engine) -> ModelCard:
    """OpenAI's retrieve-model: the served model's or an adapter's card; 404 ``model_not_found`` for any other id."""
    return model_card(model_id, engine)


# vLLM answers these two with a line of text; their errors are JSON like every route's (a route's
# response_class would document its errors as text too).
_TEXT_OK = {200: {"description": "Success: a line of text", "content": {"text/plain": {"schema": {"type": "string"}}}}}


@router.post("/v1/load_lora_adapter", response_class=Response, responses={**_TEXT_OK, **_errors(*_BODY_ERRORS)})
async def load_adapter(body: LoadLoRAAdapterRequest, engine: Engine) -> PlainTextResponse:
    """vLLM's: serve a PEFT adapter folder under a name (``--enable-lora``, runtime updating allowed)."""
    return PlainTextResponse(await load_lora_adapter(body, engine))


@router.post("/v1/unload_lora_adapter", response_class=Response,
             responses={**_TEXT_OK, **_errors(*_BODY_ERRORS, HTTPStatus.NOT_FOUND)})
async def unload_adapter(body: UnloadLoRAAdapterRequest, engine: Engine) -> PlainTextResponse:
    """vLLM's: stop serving an adapter; its requests in flight finish."""
    return PlainTextResponse(await unload_lora_adapter(body, engine))


@router.get("/health", response_class=Response, responses={
    200: {"description": "The engine is running; the body is empty", "content": None},
    **_errors(HTTPStatus.SERVICE_UNAVAILABLE)})
async def health(request: Request) -> Response:
    """200 once the engine has started (model loaded, KV cache allocated, thread running) and
    while its thread runs and accepts requests; 503 before, after a crash and during shutdown."""
    engine: AsyncLLM | None = getattr(request.app.state, "engine", None)
    if engine is not None and engine.check_health():
        return Response(status_code=HTTPStatus.OK)
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "The engine is not running.",
                       code="engine_dead").response()


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.post("/tokenize", responses=_errors(*_BODY_ERRORS, HTTPStatus.NOT_FOUND))
async def tokenize(body: TokenizeRequest, request: Request, engine: Engine) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages (and tools) rendered as a chat request renders them."""
    resolve_model(body.model, engine)  # an adapter's tokenizer is its base model's
    check_fields(body)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of 'prompt' and 'messages'.")
    # Large inputs are refused by length or tokenized off the event loop, as in the generation routes.
    if body.messages is not None:
        tokens = await tokenize_chat(body, engine, request.app.state.tool_call_parser)
    else:
        with engine_errors():
            tokens = await engine.processor.tokenize_async(body.prompt)
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len)


@router.post("/detokenize", responses=_errors(*_BODY_ERRORS, HTTPStatus.NOT_FOUND))
async def detokenize(body: DetokenizeRequest, engine: Engine) -> DetokenizeResponse:
    """The text of token ids: at most ``max_model_len`` of them (the longest sequence the server holds), each in
    the vocabulary; else a 400 naming ``tokens``."""
    resolve_model(body.model, engine)  # an adapter's tokenizer is its base model's
    check_fields(body)
    if len(body.tokens) > engine.max_model_len:
        raise bad_request(f"tokens has {len(body.tokens)} ids; at most max_model_len ({engine.max_model_len}) "
                          "are decoded at once", "tokens")
    check_token_ids(body.tokens, len(engine.tokenizer), "tokens")
    return DetokenizeResponse(prompt=await engine.processor.detokenize_async(body.tokens))


def _install_openapi(app: FastAPI, api_key_set: bool) -> None:
    """Make the spec say what the server answers: no 422 (validation errors are 400s, see
    ``pagedserve.server.errors``), a 401 on the protected routes when an API key is set, and /metrics as
    Prometheus text."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, operations in schema["paths"].items():
                body = "AnthropicErrorResponse" if anthropic_route(path) else "ErrorResponse"
                unauthorized = {"description": "Unauthorized", "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{body}"}}}}
                for operation in operations.values():
                    operation["responses"].pop("422", None)
                    if api_key_set and APIKeyMiddleware._protected(path):
                        operation["responses"]["401"] = unauthorized
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            metrics = schema["paths"].get("/metrics", {}).get("get")
            if metrics is not None:
                metrics["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(engine_args: EngineArgs | None = None, server_args: ServerArgs | None = None,
              engine: AsyncLLM | None = None, loaded: LoadedClient | None = None,
              on_engine_death: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The OpenAI-compatible app.

    Args:
        engine_args: the engine to create at startup (and shut down at exit);
            None = ``EngineArgs()`` defaults.
        server_args: access control, CORS, body limit, shutdown timeout, stats
            log interval; None = ``ServerArgs()`` defaults.
        engine: an engine that is already running, served as is and left
            running at exit (its owner shuts it down).
        loaded: an engine core and input processor (``AsyncLLM.load``) to
            run at startup instead of loading them from ``engine_args`` (the
            CLI loads them before the server listens, so that start-up errors
            stop it at once).
        on_engine_death: called with the error, on the event loop, when the
            engine thread dies (the CLI stops the server, and the process exits
            non-zero so that an orchestrator restarts it).

    Raises:
        ValueError: when more than one of ``engine_args``, ``engine`` and ``loaded`` is given.
    """
    if sum(given is not None for given in (engine_args, engine, loaded)) > 1:
        raise ValueError("give one of engine_args, engine and loaded")
    server_args = server_args or ServerArgs()

    async def create_engine() -> AsyncLLM:
        if loaded is not None:
            return AsyncLLM(*loaded, asyncio.get_running_loop())
        return engine or await AsyncLLM.create(engine_args or EngineArgs())

    async def watch(running: AsyncLLM) -> None:
        error = await running.wait_until_dead()
        logger.error("the engine died (%r): every in-flight request got an error and /health answers 503", error)
        if on_engine_death is not None:
            on_engine_death(error)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        running = await create_engine()
        watcher = asyncio.create_task(watch(running))
        # Stats stay attached through the shutdown, which lets in-flight requests finish.
        async with engine_stats(app, running, server_args.log_stats_interval_s):
            app.state.engine = running  # /health answers 200 from here on
            try:
                yield
            finally:
                watcher.cancel()
                if engine is None:
                    await running.shutdown(server_args.shutdown_timeout)

    middleware = []
    if server_args.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=server_args.allowed_origins,
                                     allow_methods=["*"], allow_headers=["*"]))
    if server_args.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=server_args.api_key))
    middleware.append(Middleware(BodySizeLimitMiddleware, max_body_bytes=server_args.max_request_body_bytes))
    docs: dict[str, Any] = {}
    if server_args.disable_fastapi_docs:
        docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan, middleware=middleware, **docs)
    app.state.tool_call_parser = server_args.tool_call_parser
    add_exception_handlers(app)
    app.include_router(router)
    app.include_router(metrics_router)
    app.include_router(dashboard_router)
    app.mount("/dashboard/static", dashboard_static_files(), name="dashboard-static")
    _install_openapi(app, bool(server_args.api_key))
    return app
