"""``GET /metrics`` and the stat loggers an app attaches to its engine while it serves.

Each app has its own Prometheus registry (counters start at zero when the app
starts) and, unless ``log_stats_interval_s`` is 0, logs one stats line per
interval while the engine is busy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.metrics.loggers import LoggingStatLogger, StatLogger
from pagedserve.engine.metrics.prometheus import PrometheusStatLogger

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The ``pagedserve:*`` metrics, and vLLM's names for the gateway's gauges, in Prometheus' text format."""
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def _log_periodically(stat_logger: LoggingStatLogger, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        stat_logger.log()


@asynccontextmanager
async def engine_stats(app: FastAPI, engine: AsyncLLM, log_stats_interval_s: float) -> AsyncIterator[None]:
    """While inside: ``engine``'s stats feed ``app``'s /metrics and, when ``log_stats_interval_s`` > 0
    (seconds), a stats log line every that many seconds while the engine is busy."""
    cache_config = engine.config.cache_config  # num_blocks is measured by now
    lora_config = engine.config.lora_config
    app.state.metrics = PrometheusStatLogger(engine.model_name, engine.max_model_len, cache_config.block_size,
                                             cache_config.num_blocks, lora_config and lora_config.max_loras)
    stat_loggers: list[StatLogger] = [app.state.metrics]
    log_task = None
    if log_stats_interval_s > 0:
        stat_loggers.append(LoggingStatLogger())
        log_task = asyncio.create_task(_log_periodically(stat_loggers[-1], log_stats_interval_s))
    for stat_logger in stat_loggers:
        engine.add_stat_logger(stat_logger)
    try:
        yield
    finally:
        if log_task is not None:
            log_task.cancel()
            with suppress(asyncio.CancelledError):
                await log_task
        for stat_logger in stat_loggers:
            engine.remove_stat_logger(stat_logger)
