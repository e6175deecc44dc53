"""An HTTP request carried from the ingress to an engine replica, and its response carried back.

The ingress reads the request whole (Ray Serve's proxy hands a router only the URL and headers, not
the body) and sends a ``ForwardedRequest``: the ASGI scope's plain fields, the body, and the prompt's
text for the router. The replica runs its FastAPI app on it in-process (``run_asgi``) and yields a
``ResponseStart``, then the body's chunks as the app sends them, so that streams stay streams.
This module imports no ray: the replica and the ingress both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.types import ASGIApp, Message

#: Request header that pins a request to a replica (its id, as the response header gives it); response
#: header naming the replica that answered.
REPLICA_HEADER = "x-pagedserve-replica"
#: Request header that has the prefix router route a request round robin instead (``round_robin``), so
#: that benchmarks and tests compare both policies on the same replicas.
ROUTER_HEADER = "x-pagedserve-router"
#: The scope fields an app reads; the rest (the proxy's own state, extensions) stays behind.
_SCOPE_FIELDS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
                 "query_string", "headers", "client", "server")
#: POST routes whose prompt decides the routing, and the body fields that make up the prompt.
_PROMPT_ROUTES = {"/v1/completions": ("prompt",), "/v1/chat/completions": ("tools", "messages"),
                  "/v1/responses": ("tools", "instructions", "input")}
#: Characters of a prompt the router looks at: a longer shared prefix is already a whole-cache match.
MAX_ROUTING_CHARS = 16_384


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the ingress received it.

    Attributes:
        scope: the ASGI scope's plain fields (``_SCOPE_FIELDS``).
        body: the request body, whole.
        routing_text: the prompt as text (``routing_text``), None for requests without one.
        replica: the id of a replica to send it to (``REPLICA_HEADER``), None to let the router choose.
        router: the routing policy the request asks for (``ROUTER_HEADER``), None for the deployment's.
    """

    scope: dict[str, Any]
    body: bytes
    routing_text: str | None = None
    replica: str | None = None
    router: str | None = None

    @classmethod
    def from_scope(cls, scope: dict[str, Any], body: bytes, replica: str | None = None) -> ForwardedRequest:
        """The request of ``scope`` with ``body``, pinned to the replica its ``REPLICA_HEADER`` names, else to
        ``replica`` (the one holding what it reads, see ``ResponseOwners``), else to none."""
        kept = {name: scope[name] for name in _SCOPE_FIELDS if name in scope}
        kept["headers"] = [(bytes(name), bytes(value)) for name, value in scope.get("headers", [])]
        kept["client"] = tuple(kept["client"]) if kept.get("client") else None
        text = routing_text(app_path(scope), body) if scope.get("method") == "POST" else None
        return cls(kept, body, text, header(scope, REPLICA_HEADER) or replica, header(scope, ROUTER_HEADER))


@dataclass(frozen=True)
class ResponseStart:
    """The status and headers of a response (ASGI's ``http.response.start``)."""

    status: int
    headers: list[tuple[bytes, bytes]]

    @property
    def is_stream(self) -> bool:
        """A server-sent event stream, passed on chunk by chunk (any other body is sent whole)."""
        return any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                   for name, value in self.headers)

    def with_header(self, name: str, value: str) -> ResponseStart:
        return replace(self, headers=[*self.headers, (name.encode("latin-1"), value.encode("latin-1"))])


def app_path(scope: dict[str, Any]) -> str:
    """The request's path within the app: without the application's route prefix (ASGI's ``root_path``)."""
    return scope["path"].removeprefix(scope.get("root_path", ""))


def header(scope: dict[str, Any], name: str) -> str | None:
    """The first value of a request header (``name`` in lower case), None when absent."""
    wanted = name.encode("latin-1")
    return next((value.decode("latin-1") for key, value in scope.get("headers", []) if key.lower() == wanted),
                None)


def _text(value: Any) -> str:
    """Any JSON value of a prompt as text, with the same text for the same value: strings as they are,
    message contents and their text parts in order, token ids comma-separated, anything else
    (tools) as compact JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return f"{value},"  # token ids: 1,23, and 12,3, differ
    if isinstance(value, list):
        return "".join(_text(item) for item in value)
    if isinstance(value, dict) and ("content" in value or "text" in value):
        return f"{value.get('role', '')}:{_text(value.get('content', value.get('text')))}\n"
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def routing_text(path: str, body: bytes) -> str | None:
    """The prompt of a generation request as text, for prefix matching, in the order the model reads it
    (tools and instructions go before the messages in chat templates), cut at ``MAX_ROUTING_CHARS``.

    Returns:
        None for other routes and for bodies that are not a JSON object (the replica answers those
        with a 400): they are routed by load alone.
    """
    fields = _PROMPT_ROUTES.get(path)
    if fields is None:
        return None
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            return None
        text = "".join(_text(data[name]) for name in fields if data.get(name) is not None)
    except (ValueError, RecursionError):  # a body nested too deep for the parser is the replica's 400
        return None
    return text[:MAX_ROUTING_CHARS] or None


async def run_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on ``request`` in this process: yields the ``ResponseStart``, then each non-empty chunk
    of the body as the app sends it, and ends with the response.

    Closing the iterator early (the client went away) tells the app that the client disconnected and
    then cancels it, which aborts its engine requests.

    Raises:
        Exception: what the app raised before it finished its response.
    """
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body: list[Message] = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> Message:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    task = asyncio.create_task(app(dict(request.scope), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    finished = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    finished = True
                    break
        if not finished:
            task.result()  # raises what the app raised
            raise RuntimeError(f"the app ended without finishing its response to {request.scope.get('path')}")
    finally:
        gone.set()
        if not finished:
            task.cancel()
        # Once the response is whole, what the app raises is its own to log (its error handlers do).
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
