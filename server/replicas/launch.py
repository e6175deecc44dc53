"""``pagedserve serve --num-replicas N``: run the replicas application on Ray Serve until SIGINT/SIGTERM.

Ray starts a local cluster, or joins the one ``RAY_ADDRESS`` names (``ray start --head`` first, for
several machines); Ray Serve's proxy listens on ``--host``/``--port``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.engine_factory import resolve_model_config
from pagedserve.server.api_server import StartupError, bind
from pagedserve.server.app import ServerArgs
from pagedserve.server.replicas.settings import ReplicaSettings

logger = logging.getLogger(__name__)


class _Stop(BaseException):
    """SIGINT or SIGTERM arrived (``signum``); a BaseException, as KeyboardInterrupt, so that no ``except
    Exception`` on the way (Ray's, ours around serve.run) takes it for an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, _: object) -> None:
    # Later signals are ignored: the replicas are being stopped already.
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)
    raise _Stop(signum)


def serve_replicas(engine_args: EngineArgs, server_args: ServerArgs, settings: ReplicaSettings) -> int:
    """Deploy ``settings.num_replicas`` engine replicas and serve them until SIGINT/SIGTERM, then delete
    the application (each replica drains as ``pagedserve serve`` does) and leave the Ray cluster.

    Returns:
        0 after a stop by SIGINT or SIGTERM, which may come while the replicas start.

    Raises:
        StartupError: Ray Serve is not installed, the port cannot be bound, the model cannot be found or
            read, or the replicas cannot start (too little memory: Ray Serve's message, after its retries).
    """
    try:
        import ray
        from ray import serve

        from pagedserve.server.replicas.deployment import APP_NAME, build_application
    except ImportError as err:
        raise StartupError(f"--num-replicas needs Ray Serve ({err}): install the ray extra, e.g. "
                           "`.venv/bin/pip install -e \".[ray]\"` in the repository") from err
    bind(server_args.host, server_args.port).close()  # a port in use fails now, not in Ray's proxy
    try:
        # A bad model fails now, with its reason; and a GGUF is converted once, not by each replica at once.
        resolve_model_config(engine_args)
    except (ValueError, OSError) as err:
        raise StartupError(str(err)) from err
    try:
        ray.init()
    except KeyboardInterrupt:  # Ctrl-C while the cluster starts: stop what it started, as after it
        logger.info("interrupted: stopping the Ray cluster")
        ray.shutdown()
        return 0
    # After ray.init, which installs its own SIGTERM handler (an exit without cleaning up); raising here
    # also interrupts a deployment still starting.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_stop)
    try:
        serve.start(http_options={"host": server_args.host, "port": server_args.port})
        try:
            serve.run(build_application(engine_args, server_args, settings), name=APP_NAME, route_prefix="/")
        except Exception as err:  # Ray Serve reports a failed deployment as a plain RuntimeError
            raise StartupError(f"the replicas did not start: {err}") from err
        logger.info("listening on http://%s:%d: %d replicas, %s routing", server_args.host, server_args.port,
                    settings.num_replicas, settings.request_router)
        while True:
            time.sleep(3600)  # until a signal raises _Stop
    except _Stop as stop:
        logger.info("%s: stopping the replicas", stop)
    finally:
        with contextlib.suppress(Exception):  # nothing to delete when serve.start failed
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0
