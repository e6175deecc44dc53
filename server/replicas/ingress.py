"""The ingress deployment: takes every HTTP request from Ray Serve's proxy and forwards it to an
engine replica through a handle, whose request router picks the replica by the prompt.

Two deployments rather than one because a router sees only what a handle call carries: requests that
come straight from the proxy carry the URL and headers, and their body is read later, on the replica.
Ray Serve LLM splits its OpenAI ingress from its engine servers for the same reason.

What the client gets is what the replica's app answered, headers included, plus ``x-pagedserve-replica``
naming the replica: a server-sent event stream chunk by chunk, any other body once whole. When the
replica fails (its process died, Ray Serve is replacing it) the request ends with an error rather
than hanging: a 503 in OpenAI's shape (``code: replica_unavailable``) before the response has started,
and a last error event (then ``data: [DONE]`` on chat and completions) once a stream has.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from http import HTTPStatus
from typing import Any

from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.server.errors import BodySizeLimitMiddleware, OpenAIError, bad_request
from pagedserve.server.replicas.forwarding import REPLICA_HEADER, ForwardedRequest, ResponseStart, app_path

logger = logging.getLogger(__name__)

#: Stored responses remembered per ingress replica (the replicas keep 1,000 each by default).
MAX_RESPONSE_OWNERS = 100_000
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[0-9a-f]+)"')
_RESPONSES_PATH = "/v1/responses"
#: Routes that change one replica's state where every replica's should change: refused (give adapters at start).
_ONE_REPLICA_ONLY = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class ResponseOwners:
    """Which replica stored which response (the Responses API's ``store``), so that
    ``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id`` reach it: each replica keeps its
    own store. The least recently used of ``max_size`` ids are forgotten."""

    def __init__(self, max_size: int = MAX_RESPONSE_OWNERS) -> None:
        self.max_size = max_size
        self._owners: OrderedDict[str, str] = OrderedDict()

    def owner(self, scope: Scope, body: bytes) -> str | None:
        """The replica holding the response a request reads or continues, None when none or unknown."""
        path = app_path(scope)
        response_id = None
        if path.startswith(_RESPONSES_PATH + "/"):
            response_id = path.removeprefix(_RESPONSES_PATH + "/")
        elif path == _RESPONSES_PATH and scope["method"] == "POST" and b"previous_response_id" in body:
            try:
                response_id = json.loads(body).get("previous_response_id")
            except (ValueError, AttributeError, RecursionError):
                return None  # the replica answers it with a 400
        if not isinstance(response_id, str) or response_id not in self._owners:
            return None
        self._owners.move_to_end(response_id)
        return self._owners[response_id]

    def learn(self, scope: Scope, start: ResponseStart, chunk: bytes) -> None:
        """Remember the response a ``POST /v1/responses`` created, from its body or its first event."""
        if app_path(scope) != _RESPONSES_PATH or scope["method"] != "POST" or start.status != HTTPStatus.OK:
            return
        found = _RESPONSE_ID.search(chunk)
        replica = next((value.decode() for name, value in start.headers if name == REPLICA_HEADER.encode()), None)
        if found and replica:
            self._owners[found.group(1).decode()] = replica
            while len(self._owners) > self.max_size:
                self._owners.popitem(last=False)


def _failure(error: BaseException) -> OpenAIError:
    if isinstance(error, RayTaskError):  # the replica's code raised: the app's handlers answer the rest
        # The cause's type only: its message may hold internals a client should not see (the replica logs it).
        return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                           f"The replica failed the request ({type(error.cause).__name__})", code="replica_error")
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, f"The replica serving the request is unavailable "
                       f"({type(error).__name__}); Ray Serve replaces failed replicas: retry.",
                       code="replica_unavailable")


def _stream_error(path: str, error: OpenAIError, events_sent: int) -> bytes:
    """The last events of a stream cut by ``error``: the Responses API's ``error`` event, or chat's and
    completions' ``data: {"error": ...}`` and ``data: [DONE]`` (as the server ends a failed stream)."""
    if path == _RESPONSES_PATH:
        event = {"type": "error", "code": error.code, "message": error.message, "param": None,
                 "sequence_number": events_sent}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    return f"data: {error.to_json()}\n\ndata: [DONE]\n\n".encode()


async def _answer_lifespan(receive: Receive, send: Send) -> None:
    """ASGI lifespan: nothing to start or stop here (the engines live in the replicas)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """Forwards each HTTP request to an engine replica (``EngineReplica.forward``).

    Args:
        engine: a handle to the engine deployment, with its request router.
        max_body_bytes: largest request body read (413 above), as the replicas' own limit.
    """

    def __init__(self, engine: DeploymentHandle, max_body_bytes: int) -> None:
        self._engine = engine.options(stream=True)
        self._max_body_bytes = max_body_bytes
        self._owners = ResponseOwners()

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # The body is read whole before forwarding: bound it here, before it is in memory.
        return BodySizeLimitMiddleware(self._forward, self._max_body_bytes)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets: the app has none
        message = await receive()  # BodySizeLimitMiddleware replays the whole body as one message
        if message["type"] == "http.disconnect":
            return
        body = message.get("body", b"")
        if app_path(scope) in _ONE_REPLICA_ONLY:
            error = bad_request("adapters cannot be loaded or unloaded at run time with --num-replicas (the request "
                                "would reach one replica): give them at start with --lora-modules")
            await error.response()(scope, receive, send)
            return
        replies = self._engine.forward.remote(ForwardedRequest.from_scope(scope, body, self._owners.owner(scope, body)))
        try:
            await self._respond(scope, receive, send, replies)
        except BaseException:  # cancelled (the client went away) or a send failed: stop the replica's work too
            replies.cancel()
            raise

    async def _respond(self, scope: Scope, receive: Receive, send: Send, replies: Any) -> None:
        """Send the client what the replica answers (``replies``), or an error when the replica fails."""
        try:
            start: ResponseStart = await replies.__anext__()
            body = b"" if start.is_stream else b"".join([chunk async for chunk in replies])
        except Exception as error:
            logger.warning("%s %s failed on its replica: %r", scope["method"], scope["path"], error)
            await _failure(error).response()(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": start.status, "headers": start.headers})
        if start.is_stream:
            await self._pass_stream(scope, send, start, replies)
        else:
            self._owners.learn(scope, start, body)
            await send({"type": "http.response.body", "body": body})

    async def _pass_stream(self, scope: Scope, send: Send, start: ResponseStart, replies: Any) -> None:
        events = 0
        try:
            async for chunk in replies:
                if events == 0:
                    self._owners.learn(scope, start, chunk)
                events += chunk.count(b"\n\n")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as error:
            logger.warning("the stream of %s %s broke on its replica: %r", scope["method"], scope["path"], error)
            await send({"type": "http.response.body", "body": _stream_error(app_path(scope), _failure(error), events),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})
