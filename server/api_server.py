"""Run one server: bind its port, load the engine, serve with uvicorn until SIGINT/SIGTERM, then drain.

``serve`` is ``pagedserve serve`` without ``--num-replicas`` (``pagedserve.server.replicas.launch`` runs
the replicas on Ray Serve instead).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus

from pagedserve.engine import envs
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.errors import EngineDeadError
from pagedserve.server.app import ServerArgs, build_app
from pagedserve.server.connections import GuardedH11Protocol
from pagedserve.server.logging_config import log_config

#: After the drain timeout, how long the requests still running have to send their error and close.
CUT_GRACE_S = 5.0
logger = logging.getLogger(__name__)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, ending the requests still running at the drain deadline with an error.

    uvicorn cancels them instead, which cuts a stream mid-body: the client cannot tell it from a finish.
    Here the engine stops first (``AsyncLLM.shutdown``), so every open stream sends an error event
    (``"the server shut down"``) and ``data: [DONE]``, and a request not yet answered gets a 503;
    uvicorn's own timeout, ``CUT_GRACE_S`` later, is left for requests stuck elsewhere.
    """

    def __init__(self, config: uvicorn.Config, app: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._app = app
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cut = asyncio.create_task(self._end_requests_after_drain())
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def _end_requests_after_drain(self) -> None:
        await asyncio.sleep(self.drain_timeout_s)
        engine: AsyncLLM | None = getattr(self._app.state, "engine", None)
        if engine is not None:
            logger.info("the drain timeout (%.0f s) has passed: ending the requests still running",
                        self.drain_timeout_s)
            # The app's lifespan shuts it down again after uvicorn, which waits for the engine to stop.
            await engine.shutdown(0)


class StartupError(Exception):
    """Why the server cannot start, in one line for the operator (exit code 2)."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it once the model is loaded), so that a port
    in use is found before the model loads and nothing answers until the server is ready.

    Raises:
        StartupError: the address cannot be bound (in use, not local, no permission).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError as err:
        raise StartupError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    return sock


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, then let in-flight requests finish (up to
    ``shutdown_timeout``), end the rest with an error (an SSE error event and ``[DONE]`` for a stream)
    and stop the engine. Slow clients are cut off (``pagedserve.server.connections``).

    Returns:
        The process's exit code: 0 after a stop, 1 when the engine died (the server stops at once,
        so that Docker's restart policy or Kubernetes restarts it).

    Raises:
        StartupError: the port cannot be bound or the engine cannot start (bad model, no CUDA, a KV
            cache too small), before anything listens.
    """
    sock = bind(server_args.host, server_args.port)
    try:
        # The engine core in a process of its own: it shares no interpreter with the HTTP server, and a fault
        # that kills it (a segfault, the OOM killer) fails the requests in flight instead of the server. A
        # thread instead only when asked, to compare the two.
        engine_process = envs.PAGEDSERVE_ENABLE_MULTIPROCESSING
        if not engine_process:
            logger.info("the engine core runs on a thread of this process (PAGEDSERVE_ENABLE_MULTIPROCESSING=0)")
        loaded = AsyncLLM.load(engine_args, engine_process=engine_process,
                               log_config=log_config(server_args.log_format))
    except (ValueError, OSError, EngineDeadError) as err:
        sock.close()
        raise StartupError(str(err)) from err
    died: list[BaseException] = []

    def stop_on_engine_death(error: BaseException) -> None:
        died.append(error)
        server.should_exit = True

    # sse-starlette ends every stream as soon as uvicorn is told to exit; let them
    # finish instead, within uvicorn's graceful-shutdown timeout.
    AppStatus.disable_automatic_graceful_drain()
    app = build_app(server_args=server_args, loaded=loaded, on_engine_death=stop_on_engine_death)
    # uvicorn applies the logging config at start-up; the CLI applied the same one before loading the model.
    config = uvicorn.Config(app, timeout_graceful_shutdown=server_args.shutdown_timeout + CUT_GRACE_S,
                            log_config=log_config(server_args.log_format), access_log=server_args.access_log,
                            http=GuardedH11Protocol)
    server = _DrainingServer(config, app, server_args.shutdown_timeout)
    # uvicorn names the address only when it binds the socket itself.
    logger.info("listening on http://%s:%d once the application has started", *sock.getsockname()[:2])
    server.run(sockets=[sock])
    if died:
        logger.error("exiting with status 1 because the engine died")
        return 1
    return 0
