"""The Ray Serve application: ``num_replicas`` engine replicas behind one ingress.

::

    HTTP -> Ray Serve proxy -> Ingress (reads the body, pagedserve.server.replicas.ingress)
                                  -> handle + request router (pagedserve.server.replicas.router)
                                      -> EngineReplica: build_app()'s FastAPI app and its AsyncLLM

Each replica runs the app ``pagedserve serve`` runs (``pagedserve.server.app.build_app``), so the routes, their
answers and the API key check are the same; its lifespan creates the engine when the replica starts
and drains it when Ray Serve stops the replica. Ray Serve calls ``check_health`` every
``health_check_period_s``: an engine that died fails it, and Ray Serve replaces the replica, as it does
one whose process died.

``build_application`` is what ``pagedserve serve --num-replicas N`` runs; ``app_builder`` is the same
for ``serve run`` and ``serve deploy`` configs (``configs/ray/serve.yaml``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging.config
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from pagedserve.engine.config import EngineArgs
from pagedserve.server.app import ServerArgs, build_app
from pagedserve.server.logging_config import log_config
from pagedserve.server.replicas.forwarding import REPLICA_HEADER, ForwardedRequest, ResponseStart, run_asgi
from pagedserve.server.replicas.ingress import Ingress
from pagedserve.server.replicas.router import ROUTER_CLASSES
from pagedserve.server.replicas.settings import REPLICA_FIELDS, ReplicaSettings

APP_NAME = "pagedserve"
#: How long Ray Serve gives a stopping replica beyond the server's own drain (``shutdown_timeout``).
SHUTDOWN_GRACE_S = 5.0


def _log_to_stderr(log_format: str) -> None:
    """Our loggers write as ``pagedserve serve``'s do; Ray keeps each replica's stderr in its log folder.
    Only ``engine`` and ``server``: the root logger and Ray's own are Ray's."""
    config = log_config(log_format)
    del config["root"]
    config["loggers"] = {name: {"handlers": ["stderr"], "level": "INFO", "propagate": False}
                         for name in ("engine", "server")}
    logging.config.dictConfig(config)


@serve.deployment(name="engine")
class EngineReplica:
    """One engine and the OpenAI app around it; the ingress forwards requests to ``forward``.

    Args:
        engine_args: the engine to load.
        server_args: the app's settings (API key, CORS, body limit, drain timeout, stats log).

    Raises:
        ValueError, OSError: the engine cannot start (see ``AsyncLLM.load``); Ray Serve retries, then
            marks the deployment failed.
    """

    async def __init__(self, engine_args: EngineArgs, server_args: ServerArgs) -> None:
        _log_to_stderr(server_args.log_format)
        self._app = build_app(engine_args, server_args)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self._app.router.lifespan_context(self._app))
        self._name = serve.get_replica_context().replica_id.unique_id

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's response to ``request``: its ``ResponseStart`` (naming this replica), then its body."""
        async with contextlib.aclosing(run_asgi(self._app, request)) as response:
            async for item in response:
                yield item.with_header(REPLICA_HEADER, self._name) if isinstance(item, ResponseStart) else item

    def check_health(self) -> None:
        """Raises RuntimeError once the engine has stopped, so that Ray Serve replaces this replica."""
        engine = getattr(self._app.state, "engine", None)
        if engine is None or not engine.check_health():
            raise RuntimeError("the engine is not running")

    async def __del__(self) -> None:
        await self._lifespan.aclose()  # lets in-flight requests finish (shutdown_timeout), stops the engine


def _replica_gpus(engine_args: EngineArgs, settings: ReplicaSettings) -> float:
    """GPUs a replica reserves: the setting, else one per tensor-parallel rank where the engine runs on CUDA."""
    if settings.replica_num_gpus or engine_args.device == "cpu":
        return settings.replica_num_gpus
    per_engine = float(engine_args.tensor_parallel_size)
    if engine_args.device == "cuda":
        return per_engine
    import torch  # here: only for device auto, on the machine that deploys

    return per_engine if torch.cuda.is_available() else 0.0


def build_application(engine_args: EngineArgs, server_args: ServerArgs, settings: ReplicaSettings) -> Application:
    """The application to ``serve.run``: ``settings.num_replicas`` engine replicas and their router,
    behind one ingress. ``server_args.host`` and ``port`` are Ray Serve's HTTP options, not set here."""
    options: dict[str, Any] = {
        "num_replicas": settings.num_replicas,
        "max_ongoing_requests": settings.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": settings.replica_num_cpus,
                              "num_gpus": _replica_gpus(engine_args, settings)},
        "health_check_period_s": settings.health_check_period_s,
        "graceful_shutdown_timeout_s": server_args.shutdown_timeout + SHUTDOWN_GRACE_S,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[settings.request_router],
            request_router_kwargs={"imbalance_threshold": settings.router_imbalance_threshold}),
    }
    engine = EngineReplica.options(**options).bind(engine_args, server_args)
    # Enough for every replica's requests to be in flight at once through the one ingress replica.
    ingress = Ingress.options(max_ongoing_requests=settings.num_replicas * settings.max_ongoing_requests)
    return ingress.bind(engine, server_args.max_request_body_bytes)


def app_builder(args: Mapping[str, Any]) -> Application:
    """``build_application`` from a Ray Serve config's application ``args``: ``EngineArgs``,
    ``ServerArgs`` and ``ReplicaSettings`` keys, and ``config`` (a ``pagedserve serve --config`` file,
    which the other keys override). ``PAGEDSERVE_API_KEY`` is read as ``pagedserve serve`` reads it.

    Raises:
        ValueError: an unknown key (named) or an invalid setting.
    """
    # Imported here: the CLI imports this module's package lazily, and its settings logic is reused as is.
    from pagedserve.server.cli_args import resolve_settings, settings_fields

    settings = dict(args)
    config = settings.pop("config", None)
    unknown = sorted(set(settings) - set(settings_fields()) - REPLICA_FIELDS)
    if unknown:
        raise ValueError(f"unknown application args: {', '.join(unknown)}")
    replica = {name: settings.pop(name) for name in REPLICA_FIELDS & set(settings)}
    engine_args, server_args = resolve_settings(argparse.Namespace(config=config, model_tag=None, **settings))
    return build_application(engine_args, server_args, ReplicaSettings(**replica))

