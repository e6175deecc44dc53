"""The ``pagedserve`` command (also ``python -m pagedserve``).

``pagedserve serve [MODEL] [--config FILE.yaml] [--FLAG VALUE ...]`` runs the
server; ``pagedserve bench serve ...`` load-tests a running one.

Every ``EngineArgs`` and ``ServerArgs`` field is both a flag (``--max-model-len``)
and a key of the YAML file (``max_model_len:``); flags and help are generated
from the dataclass fields and their metadata (help, unit, choices). Precedence,
highest first: flags, the YAML file, ``PAGEDSERVE_API_KEY`` (for ``api_key``),
the dataclass defaults. ``--num-replicas N`` (above 1) runs N engines on Ray Serve instead, behind one
address, with the other ``ReplicaSettings`` flags (``pagedserve.server.replicas``, docs/replicas.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import logging.config
import socket
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

import uvicorn
import yaml
from sse_starlette.sse import AppStatus

from pagedserve.engine import envs
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.errors import EngineDeadError
from pagedserve.server.app import ServerArgs, build_app
from pagedserve.server.config_table import SETTINGS_CLASSES, shown_default
from pagedserve.server.connections import GuardedH11Protocol
from pagedserve.server.logging_config import log_config
from pagedserve.server.replicas.settings import REPLICA_FIELDS, ReplicaSettings

#: After the drain timeout, how long the requests still running have to send their error and close.
CUT_GRACE_S = 5.0
logger = logging.getLogger(__name__)


def _members(hint: Any) -> tuple[Any, ...]:
    """The types a field accepts: ``int | None`` -> ``(int, NoneType)``."""
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _settings_fields() -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every settable name -> (its dataclass field, its resolved type)."""
    fields = {}
    for cls in SETTINGS_CLASSES:
        hints = typing.get_type_hints(cls)
        fields |= {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}
    return fields


def _flag_help(f: dataclasses.Field) -> str:
    unit = f.metadata.get("unit")
    text = f"{f.metadata['help']} " + (f"[{unit}] " if unit else "") + f"(default: {shown_default(f)})"
    return text.replace("%", "%%")  # argparse formats help with %


def _flag_options(hint: Any, f: dataclasses.Field) -> dict[str, Any]:
    """``argparse.add_argument`` options for a field of type ``hint``."""
    accepted = [t for t in _members(hint) if t is not types.NoneType]
    if bool in accepted:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(accepted[0]) is list:
        return {"nargs": "*", "type": typing.get_args(accepted[0])[0]}
    # Sizes (int | str) stay text: the dataclass parses "2GiB" as well as "2147483648".
    kind = str if str in accepted else accepted[0]
    choices = f.metadata.get("choices")
    if choices:
        # argparse shows them as {a,b,c}; None (unset, the default) is no value a flag can spell.
        return {"type": kind, "choices": [c for c in choices if c is not None]}
    return {"type": kind, "metavar": (f.metadata.get("unit") or f.name).upper()}


def _add_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    """A flag for each field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        # SUPPRESS leaves unset flags out of the namespace, so the YAML file can fill them.
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
                           help=_flag_help(f), **_flag_options(hints[f.name], f))


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for title, cls in zip(("engine", "server"), SETTINGS_CLASSES, strict=True):
        _add_flags(parser.add_argument_group(f"{title} settings (also YAML keys)"), cls)
    _add_flags(parser.add_argument_group("replica settings (Ray Serve, docs/replicas.md; flags only)"),
               ReplicaSettings)


def _accepts(kind: Any, value: Any) -> bool:
    """Whether a YAML value has type ``kind`` (bools are not numbers here, ints are floats)."""
    if kind is types.NoneType:
        return value is None
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(_accepts(typing.get_args(kind)[0], v) for v in value)
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML file of settings: a mapping of ``EngineArgs`` / ``ServerArgs`` field names.

    Raises:
        ValueError: the file is not a mapping, has unknown keys (all named) or
            a value of the wrong type.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as file:
        data = yaml.safe_load(file)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    fields = _settings_fields()
    unknown = sorted(str(key) for key in data if key not in fields)
    if unknown:
        raise ValueError(f"{path}: unknown keys {', '.join(unknown)}; known keys: {', '.join(fields)}")
    for key, value in data.items():
        hint = fields[key][1]
        if not any(_accepts(kind, value) for kind in _members(hint)):
            raise ValueError(f"{path}: {key} must be of type {hint}, got {value!r}")
    return data


def resolve_settings(args: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    """Merge defaults, the environment (``PAGEDSERVE_API_KEY``), the ``--config`` file and flags (highest wins).

    Raises:
        ValueError: a bad config file or an invalid setting (naming it).
        OSError: the config file cannot be read.
    """
    settings: dict[str, Any] = {}
    if envs.PAGEDSERVE_API_KEY is not None:
        settings["api_key"] = envs.PAGEDSERVE_API_KEY
    if args.config:
        settings |= load_config_file(args.config)
    fields = _settings_fields()
    settings |= {name: value for name, value in vars(args).items() if name in fields}
    if args.model_tag is not None:
        if "model" in vars(args) and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        settings["model"] = args.model_tag
    engine_names = {f.name for f in dataclasses.fields(EngineArgs)}
    return (EngineArgs(**{k: v for k, v in settings.items() if k in engine_names}),
            ServerArgs(**{k: v for k, v in settings.items() if k not in engine_names}))


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


def _bind(host: str, port: int) -> socket.socket:
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
    sock = _bind(server_args.host, server_args.port)
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


def _startup_failed(err: Exception) -> int:
    print(f"pagedserve serve: error: {err}", file=sys.stderr)
    return 2


def _run_serve(args: argparse.Namespace) -> int:
    """``pagedserve serve``: a start-up error is one line on stderr and exit code 2; errors while
    serving are not caught here."""
    try:
        engine_args, server_args = resolve_settings(args)
        replicas = ReplicaSettings(**{name: value for name, value in vars(args).items() if name in REPLICA_FIELDS})
    except (ValueError, OSError) as err:
        return _startup_failed(err)
    logging.config.dictConfig(log_config(server_args.log_format))
    try:
        if replicas.num_replicas > 1:
            from pagedserve.server.replicas.launch import serve_replicas  # imports ray: the ray extra

            return serve_replicas(engine_args, server_args, replicas)
        return serve(engine_args, server_args)
    except StartupError as err:
        return _startup_failed(err)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedserve`` parser; ``serve`` sets ``run(args) -> exit code``, ``bench serve`` parses its own options."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM server.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser(
        "serve", help="run the OpenAI-compatible server",
        description="Run the OpenAI-compatible server. Settings: flags > --config YAML > "
                    "PAGEDSERVE_API_KEY > defaults.")
    serve_parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                              help="model to serve (same as --model)")
    serve_parser.add_argument("--config", metavar="FILE.yaml", default=None,
                              help="YAML file of settings, keyed by the flag names with underscores")
    _add_settings_flags(serve_parser)
    serve_parser.set_defaults(run=_run_serve)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    # Its options are the load generator's own (``pagedserve bench serve --help``): it is imported only when
    # this subcommand runs, so that ``serve`` loads no benchmark code.
    bench.add_parser("serve", help="load-test a running server", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pagedserve`` console script; returns the exit code."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from pagedserve.server.bench import serve

        return serve.main(rest, prog="pagedserve bench serve")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)
