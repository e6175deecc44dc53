"""pagedserve's OpenAI-compatible HTTP server: ``build_app`` for the app, ``pagedserve serve`` for the CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagedserve")
except PackageNotFoundError:  # a source checkout that was never pip-installed
    __version__ = "0.0.0+source"
