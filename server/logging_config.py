"""Logging for ``pagedserve serve``: one format for our loggers and uvicorn's.

``log_config(format)`` is a ``logging.config.dictConfig`` mapping, handed to
uvicorn (which applies it at start-up) so that engine, server, uvicorn and
access-log lines all go to stderr in the same format: ``text`` (one readable
line) or ``json`` (one JSON object per line, for log collectors).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``
    and, when an exception is attached, ``exception`` (its traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class UvicornNames(logging.Filter):
    """Name uvicorn's general records ``uvicorn``: it logs them (start-up, shutdown, "Uvicorn running
    on ...") through a logger called ``uvicorn.error``, which reads as an error to people and log
    collectors alike."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def log_config(log_format: str, level: str = "INFO") -> dict[str, Any]:
    """A ``dictConfig`` mapping: every logger, uvicorn's included, writes to stderr in ``log_format``.

    Raises:
        ValueError: when ``log_format`` is not one of ``LOG_FORMATS``.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    formatter = {"()": JsonFormatter} if log_format == "json" else {"format": TEXT_FORMAT}
    # uvicorn's loggers hand their records to the root's handler instead of keeping their own.
    uvicorn_logger = {"handlers": [], "level": level, "propagate": True}
    return {
        "version": 1,
        "disable_existing_loggers": False,  # pagedserve.* loggers exist before this runs
        "formatters": {"default": formatter},
        "filters": {"uvicorn_names": {"()": UvicornNames}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "default", "filters": ["uvicorn_names"],
                                "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {name: dict(uvicorn_logger) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }
