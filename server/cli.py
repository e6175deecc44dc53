"""The ``pagedserve`` command (also ``python -m pagedserve``).

``pagedserve serve [MODEL] [--config FILE.yaml] [--FLAG VALUE ...]`` runs the
server (``pagedserve.server.api_server``), with the settings of
``pagedserve.server.cli_args``; ``pagedserve bench serve ...`` load-tests a
running one. ``--num-replicas N`` (above 1) runs N engines on Ray Serve instead,
behind one address, with the other ``ReplicaSettings`` flags
(``pagedserve.server.replicas``, docs/replicas.md).
"""

from __future__ import annotations

import argparse
import logging.config
import sys
from collections.abc import Sequence

from pagedserve.server.api_server import StartupError, serve
from pagedserve.server.cli_args import add_settings_flags, resolve_settings
from pagedserve.server.logging_config import log_config
from pagedserve.server.replicas.settings import REPLICA_FIELDS, ReplicaSettings


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
    add_settings_flags(serve_parser)
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
        from pagedserve.server.bench import serve as bench_serve

        return bench_serve.main(rest, prog="pagedserve bench serve")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)
