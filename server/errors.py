"""Every way the server refuses a request, as OpenAI's error JSON.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status; on the routes of Anthropic's
Messages API (``anthropic_route``) Anthropic's ``{"type": "error", "error": {"type", "message"}}``. Bad
input is a 4xx naming the offending field, never a 500; engine failures are
429 (queue full) or 503 (engine down).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.engine.async_llm import AsyncLLM, QueueFullError, StreamBacklogError
from pagedserve.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from pagedserve.engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}
#: Anthropic's error type by status (https://docs.anthropic.com/en/api/errors); another 4xx is an
#: ``invalid_request_error``, another 5xx an ``api_error``.
_ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                          413: "request_too_large", 429: "rate_limit_error"}
_UNION_TAGS = frozenset({"str", "int", "float", "bool"})
#: Most characters of a client's value (a model name, an id, a field name) quoted in an error or a log line.
MAX_ECHOED_CHARS = 256
#: Most characters of an error's message: a backstop for any value quoted whole, so that no error body (nor
#: its log line) grows with the request.
MAX_ERROR_MESSAGE_CHARS = 4096


def shorten(text: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """``text``, cut to its first ``limit`` characters and a note of how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def anthropic_route(path: str) -> bool:
    """Whether ``path`` is a route of Anthropic's Messages API, whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for the OpenAPI spec (``OpenAIError.body`` writes it)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, for the OpenAPI spec (``OpenAIError.anthropic_body`` writes it)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class _ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: text quoting the client's input then always encodes,
    even a lone surrogate (``JSONResponse`` writes UTF-8, which has none: a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


class OpenAIError(Exception):
    """A request refused with an HTTP status and OpenAI's error body (Anthropic's on its routes).

    Args:
        status_code: the HTTP status (4xx, 5xx).
        message: what went wrong, for the client; cut to ``MAX_ERROR_MESSAGE_CHARS``.
        param: the request field at fault, if any (dotted path for nested fields); cut to ``MAX_ECHOED_CHARS``
            (a path may hold a client's dict key).
        code: a short machine-readable code, if any.
    """

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        message = shorten(message, MAX_ERROR_MESSAGE_CHARS)
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = None if param is None else shorten(param)
        self.code = code

    def body(self) -> dict[str, Any]:
        error_type = _ERROR_TYPES.get(self.status_code, "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The error in Anthropic's shape: a type for the status, and the message, which names the field (Anthropic's
        error has no ``param``)."""
        error_type = _ANTHROPIC_ERROR_TYPES.get(
            self.status_code, "api_error" if self.status_code >= 500 else "invalid_request_error")
        named = self.param is None or f"'{self.param}'" in self.message or self.message.startswith(self.param)
        message = self.message if named else f"{self.param}: {self.message}"
        return {"type": "error", "error": {"type": error_type, "message": message}}

    def to_json(self) -> str:
        return json.dumps(self.body())

    def response(self, headers: Mapping[str, str] | None = None, path: str = "") -> JSONResponse:
        """The error as a JSON response, in Anthropic's shape when ``path`` is one of its routes."""
        body = self.anthropic_body() if anthropic_route(path) else self.body()
        return _ASCIIJSONResponse(body, status_code=self.status_code, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param)


# --------------------------------------------------------------------------- checks shared by the endpoints


def model_not_found(requested: str, engine: AsyncLLM) -> OpenAIError:
    """OpenAI's 404 ``model_not_found``, naming the model this server serves and its adapters (the first few)."""
    adapters = [lora.lora_name for lora in engine.loras or ()]
    also = "" if not adapters else (f" and the LoRA adapters {', '.join(f'`{shorten(name)}`' for name in adapters[:8])}"
                                    f"{f' and {len(adapters) - 8} more (GET /v1/models)' if len(adapters) > 8 else ''}")
    return OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{shorten(requested)}` does not exist; this server "
                       f"serves `{engine.model_name}`{also}.", param="model", code="model_not_found")


def resolve_model(requested: str | None, engine: AsyncLLM) -> LoRARequest | None:
    """The adapter a request's ``model`` names (``--enable-lora``), or None for the served model's name or no name.

    Raises:
        OpenAIError: 404 for any other name.
    """
    if not requested or requested == engine.model_name:
        return None
    if engine.loras is not None and (lora := engine.loras.get(requested)) is not None:
        return lora
    raise model_not_found(requested, engine)


def rename_field(error: OpenAIError, names: Iterable[tuple[re.Pattern[str], str]]) -> OpenAIError:
    """``error`` naming the field as the client sent it to an API served through chat (the Responses
    API, Anthropic's Messages API), in ``param`` and in the message where it leads it or is quoted.

    Args:
        names: (pattern, replacement) pairs for ``re.sub`` on chat's ``param``; the first that matches
            renames it.
    """
    for pattern, name in names if error.param else ():
        param = pattern.sub(name, error.param, count=1)
        if param != error.param:
            message = error.message.replace(f"'{error.param}'", f"'{param}'")
            if message.startswith(f"{error.param} "):
                message = param + message[len(error.param):]
            return OpenAIError(error.status_code, message, param, error.code)
    return error


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Raises a 400 naming ``param`` when a token id is outside ``[0, vocab_size)``."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param} has token ids outside [0, {vocab_size}): {bad[:5]}", param)


@contextmanager
def engine_errors(client_names: Mapping[str, str] | None = None) -> Iterator[None]:
    """Translate what building or running a request raises into OpenAI errors.

    ``InvalidRequestError`` (invalid sampling parameters, a prompt the engine
    refuses) -> 400 naming its field; any other ``ValueError`` (a request id
    in use) -> 400; ``StreamBacklogError`` (a client that stopped reading its stream; only ever sent as the
    stream's last event) -> 408; ``QueueFullError`` -> 429; ``RequestFailedError`` (the engine failed this
    request alone) -> 500; ``EngineDeadError`` -> 503.

    Args:
        client_names: engine-side field (``InvalidRequestError.param``) -> the request field the client
            set it with, where they differ (chat's ``top_logprobs`` is ``logprobs``), so that the error
            names the latter.
    """
    try:
        yield
    except QueueFullError as exc:
        raise OpenAIError(HTTPStatus.TOO_MANY_REQUESTS, str(exc), code="queue_full") from exc
    except EngineDeadError as exc:
        raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="engine_dead") from exc
    except RequestFailedError as exc:
        raise OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), code="request_failed") from exc
    except StreamBacklogError as exc:
        raise OpenAIError(HTTPStatus.REQUEST_TIMEOUT, str(exc), code="client_too_slow") from exc
    except InvalidRequestError as exc:
        param = (client_names or {}).get(exc.param, exc.param)
        raise bad_request(exc.message if param is None else exc.message_naming(param), param) from exc
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


# --------------------------------------------------------------------------- handlers


def _param_path(loc: Iterable[int | str]) -> str:
    """``messages.0.role`` from pydantic's location, up to the first part that is not a field
    or an index (a union member's tag such as ``str``, a dict key such as ``not-a-token``)."""
    parts = []
    for part in loc:
        if not isinstance(part, int) and (not part.isidentifier() or part in _UNION_TAGS):
            break
        parts.append(str(part))
    return ".".join(parts)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = exc.errors()[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    path = request.url.path
    if error["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {error.get('ctx', {}).get('error', '')}"
                           ).response(path=path)
    param = _param_path(error["loc"][1:])  # [0] is "body"
    if not param:
        return bad_request(f"The request body is invalid: {message}").response(path=path)
    return bad_request(f"Invalid value for '{param}': {message}", param).response(path=path)


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    status = HTTPStatus(exc.status_code)
    message = exc.detail if isinstance(exc.detail, str) and exc.detail != status.phrase else (
        f"{status.phrase}: {request.method} {request.url.path}")
    code = status.phrase.lower().replace(" ", "_")
    return OpenAIError(exc.status_code, message, code=code).response(exc.headers, request.url.path)


def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response(path=request.url.path)


def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # exc_info=exc, not logger.exception: Starlette runs this sync handler in a thread, outside the
    # ``except`` block, where there is no current exception to log (the log said "NoneType: None").
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {exc!r}").response(
        path=request.url.path)


def add_exception_handlers(app: FastAPI) -> None:
    """Answer every error, including FastAPI's own 404/405/422, in OpenAI's shape (Anthropic's on its
    routes)."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(Exception, _unexpected_error)


# --------------------------------------------------------------------------- body size limit


class BodySizeLimitMiddleware:
    """Answer 413 when a request body exceeds ``max_body_bytes``.

    Checks the declared ``Content-Length`` first, then counts the bytes as they
    arrive (chunked uploads declare none). The body is read here in full and
    replayed to the app, which FastAPI would do anyway; after the replay the
    app's ``receive`` is the server's again, so disconnects still reach it.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        # A malformed Content-Length never gets here: the HTTP server rejects it.
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            more_body = message.get("more_body", False)
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"The request body exceeds the server's limit of {self.max_body_bytes} bytes.",
                            code="request_too_large")
        await error.response(path=scope["path"])(scope, receive, send)
