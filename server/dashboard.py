"""The dashboard (``docs/dashboard.md``): the page, the step-record stream and the KV-cache snapshot.

``GET /dashboard`` serves ``server/static/dashboard.html`` (its scripts under ``/dashboard/static/``,
all from the package: nothing from the internet). The data routes are under ``/v1/``, so behind the
API key like the rest of the API: ``/v1/dashboard/steps`` streams step records as server-sent events,
``/v1/dashboard/steps/recent`` returns the last ones, ``/v1/dashboard/kv_cache`` the cache block by
block. With ``step_record_buffer_size`` 0 the data routes answer 404. They are left out of the
OpenAPI spec (the stream never ends, which spec-driven clients and fuzzers cannot handle);
``docs/dashboard.md`` documents them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.step_records import StepRecordBuffer
from pagedserve.server.errors import OpenAIError, engine_errors

STATIC_DIR = Path(__file__).parent / "static"
#: Records a browser gets per second by default: enough for the timeline, cheap to draw.
DEFAULT_MAX_RATE = 10.0
#: How often an idle stream checks that the engine is still alive, in seconds.
ENGINE_CHECK_S = 1.0

router = APIRouter()


def static_files() -> StaticFiles:
    """The page's scripts and styles, mounted at ``/dashboard/static``."""
    return StaticFiles(directory=STATIC_DIR)


def _step_records(request: Request) -> StepRecordBuffer:
    records = request.app.state.engine.step_records
    if records is None:
        raise OpenAIError(HTTPStatus.NOT_FOUND, "step records are off (step_record_buffer_size is 0)",
                          code="step_records_off")
    return records


StepRecords = Annotated[StepRecordBuffer, Depends(_step_records)]


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> FileResponse:
    return FileResponse(STATIC_DIR / "dashboard.html")


@router.get("/v1/dashboard/steps/recent", include_in_schema=False)
async def recent_steps(records: StepRecords, limit: Annotated[int, Query(ge=0, le=100_000)] = 256,
                       since: int | None = None) -> list[dict[str, Any]]:
    """Step records, oldest first (``docs/dashboard.md``): the first ``limit`` after step ``since`` when
    it is given (so a client pages forward), else the last ``limit``."""
    return records.recent(limit, since)


@router.get("/v1/dashboard/steps", include_in_schema=False)
async def follow_steps(records: StepRecords, request: Request,
                       history: Annotated[int, Query(ge=0, le=100_000)] = 256, since: int | None = None,
                       max_rate: Annotated[float, Query(ge=0.1, le=1000)] = DEFAULT_MAX_RATE,
                       every_step: bool = False) -> EventSourceResponse:
    """Server-sent events, one step record each: the buffered ones (at most ``history``, after step
    ``since``), then each new step. Unless ``every_step``, at most ``max_rate`` records a second are
    sent: a record that comes too soon waits and is replaced by the next one, which carries its
    preemptions and finishes, so a client counting them misses none (unless it falls more than
    ``StepRecordBuffer.MAX_FOLLOWER_LAG`` records behind). The stream ends when the engine dies."""
    engine: AsyncLLM = request.app.state.engine

    async def events() -> AsyncIterator[str]:
        with records.subscription() as queue:
            backlog = records.recent(history, since)
            last_step = backlog[-1]["step"] if backlog else (-1 if since is None else since)
            for record in backlog:
                # A send that fits the socket's buffer does not wait: without this, the whole backlog would be
                # written in one go, and many followers at once would hold the event loop for seconds.
                await asyncio.sleep(0)
                yield records.to_json(record)
            pending: dict[str, Any] | None = None  # not sent yet, carrying what skipped records held
            next_send = 0.0
            while True:
                timeout = ENGINE_CHECK_S if pending is None else max(0.0, next_send - time.monotonic())
                try:
                    record = await asyncio.wait_for(queue.get(), min(timeout, ENGINE_CHECK_S))
                except TimeoutError:
                    if engine.errored:
                        return  # no more steps will come
                    record = None
                if record is not None and record["step"] > last_step:
                    pending = record if pending is None else _carry(pending, record)
                if pending is not None and (every_step or time.monotonic() >= next_send):
                    yield records.to_json(pending)
                    last_step, pending = pending["step"], None
                    next_send = time.monotonic() + 1.0 / max_rate

    return EventSourceResponse(events(), sep="\n")


def _carry(skipped: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the preemptions and finishes of ``skipped``, an earlier record not sent."""
    return {**record, "preempted": skipped["preempted"] + record["preempted"],
            "finished": skipped["finished"] + record["finished"]}


@router.get("/v1/dashboard/kv_cache", include_in_schema=False)
async def kv_cache(request: Request, _: StepRecords) -> dict[str, Any]:
    """The KV cache block by block, taken between two steps (``docs/dashboard.md``)."""
    engine: AsyncLLM = request.app.state.engine
    with engine_errors():
        return await engine.kv_cache_snapshot()
