"""Step records: what the scheduler decided at each engine step, compactly, for the dashboard.

One record per step (``make_step_record``), a JSON-ready dict whose fields ``docs/dashboard.md``
lists: the step's phase durations, its requests (kind, phase, tokens, blocks, prefix-cache hits),
preemptions, finishes, the token budget, the queues and the KV blocks. It holds ids and counts, no
prompt text. Built on the engine thread, the request entries right after ``schedule()``, the rest
after ``update_from_output``, from state the scheduler keeps anyway: O(scheduled requests) per step,
no scan of the KV cache. ``kv_cache_snapshot`` is the
block-by-block view, taken on request (it scans every block).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.outputs import EngineCoreOutput
from pagedserve.engine.request import Request

#: ``kv_cache_snapshot``'s one character per block.
NULL_BLOCK, USED_BLOCK, CACHED_FREE_BLOCK, FREE_BLOCK = "N", "U", "C", "F"


def scheduled_requests(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> list[tuple[Request, dict[str, Any]]]:
    """Each scheduled request with its record entry, taken right after ``schedule()`` (its
    ``num_computed_tokens`` already advanced past this step's tokens)."""
    new_ids = {new.req_id for new in scheduler_output.scheduled_new_reqs}
    resumed_ids = scheduler_output.scheduled_cached_reqs.resumed_req_ids
    kv = scheduler.kv_cache_manager
    entries = []
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        computed = request.num_computed_tokens - num_tokens
        kind = "new" if req_id in new_ids else "resumed" if req_id in resumed_ids else "cached"
        # A resumed request recomputes its output tokens too: all but the last are prefill again.
        phase = "prefill" if computed < max(request.num_prompt_tokens, request.num_tokens - 1) else "decode"
        entry = {"id": req_id, "kind": kind, "phase": phase,
                 "tokens": num_tokens, "computed": computed, "prompt_tokens": request.num_prompt_tokens,
                 "blocks": kv.num_blocks_of(req_id), "cached_tokens": max(request.num_cached_tokens, 0),
                 "samples": request.num_computed_tokens >= request.num_tokens}
        if kind == "new":
            entry["arrival_time"] = request.arrival_time
        entries.append((request, entry))
    return entries


def make_step_record(step: int, durations_s: dict[str, float], scheduler: Scheduler,
                     scheduler_output: SchedulerOutput, requests: list[tuple[Request, dict[str, Any]]],
                     outputs: list[EngineCoreOutput], aborted: list[tuple[str, str, int]]) -> dict[str, Any]:
    """The record of one step (``docs/dashboard.md``).

    Args:
        step: the step's index, from 0.
        durations_s: seconds spent in ``schedule``, ``forward``, ``sample`` and ``update``.
        scheduler: after ``update_from_output``.
        scheduler_output: the step's plan.
        requests: ``scheduled_requests`` of the step.
        outputs: what ``update_from_output`` returned.
        aborted: requests finished from outside a step since the previous record: ``(id, reason,
            output tokens)``; reason ``stop`` for a stop string the frontend found, else ``abort``.
    """
    output_tokens = {request.request_id: request.num_output_tokens for request, _ in requests}
    new_tokens = {output.request_id: len(output.new_token_ids) for output in outputs}
    for _, entry in requests:
        entry["new_tokens"] = new_tokens.get(entry["id"], 0)
    finished = [{"id": output.request_id, "reason": output.finish_reason.value,
                 "output_tokens": output_tokens.get(output.request_id, 0)}
                for output in outputs if output.finished]
    finished += [{"id": request_id, "reason": reason, "output_tokens": num_output_tokens}
                 for request_id, reason, num_output_tokens in aborted]
    return {
        "step": step,
        "time": time.time(),
        "duration_ms": {name: round(seconds * 1e3, 3) for name, seconds in durations_s.items()},
        "num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
        "max_num_batched_tokens": scheduler.config.max_num_batched_tokens,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "kv_blocks": scheduler.kv_cache_manager.block_pool.block_counts()._asdict(),
        "requests": [entry for _, entry in requests],
        "preempted": sorted(scheduler_output.preempted_req_ids),
        "finished": finished,
    }


def kv_cache_snapshot(scheduler: Scheduler, step: int) -> dict[str, Any]:
    """Every KV block's state, owners and sharing (``docs/dashboard.md``); scans the whole pool."""
    kv = scheduler.kv_cache_manager
    blocks = kv.block_pool.block_states()
    states = [NULL_BLOCK] + [USED_BLOCK if ref_cnt > 0 else CACHED_FREE_BLOCK if cached else FREE_BLOCK
                             for ref_cnt, cached in blocks[1:]]
    shared = {str(block_id): ref_cnt for block_id, (ref_cnt, _) in enumerate(blocks) if block_id and ref_cnt > 1}
    return {"step": step, "block_size": kv.block_size, "num_blocks": len(blocks),
            "states": "".join(states), "owners": kv.block_ids_by_request(), "shared": shared}


class StepRecordBuffer:
    """The last ``size`` step records, and the queues of the clients following new ones.

    Lives on the event loop: the engine thread hands each record over with its step's outputs.

    Args:
        size: records kept (``step_record_buffer_size``, >= 1).
    """

    #: Records a follower may fall behind by before the oldest it has not read are dropped.
    MAX_FOLLOWER_LAG = 4096

    def __init__(self, size: int) -> None:
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self._followers: set[asyncio.Queue[dict[str, Any]]] = set()
        # step -> [buffered record, its JSON text once a follower asked for it]
        self._json: dict[int, list[Any]] = {}

    def append(self, record: dict[str, Any]) -> None:
        if len(self.records) == self.records.maxlen:
            self._json.pop(self.records[0]["step"], None)
        self.records.append(record)
        self._json[record["step"]] = [record, None]
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()  # a client that does not keep up loses its oldest records
            queue.put_nowait(record)

    def to_json(self, record: dict[str, Any]) -> str:
        """``record`` as JSON text, made once per buffered record however many followers send it (a hundred
        followers of a full buffer would otherwise serialize it a hundred times on the event loop)."""
        cached = self._json.get(record["step"])
        if cached is None or cached[0] is not record:  # not buffered (any more), or a follower's merged record
            return json.dumps(record)
        if cached[1] is None:
            cached[1] = json.dumps(record)
        return cached[1]

    def recent(self, limit: int, since: int | None = None) -> list[dict[str, Any]]:
        """Records, oldest first: the first ``limit`` after step ``since``, or without ``since`` the last
        ``limit``."""
        if limit <= 0:
            return []
        if since is None:
            return list(self.records)[-limit:]
        return [record for record in self.records if record["step"] > since][:limit]

    @contextlib.contextmanager
    def subscription(self) -> Iterator[asyncio.Queue[dict[str, Any]]]:
        """A queue that receives every record appended while the ``with`` block runs."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=self.MAX_FOLLOWER_LAG)
        self._followers.add(queue)
        try:
            yield queue
        finally:
            self._followers.discard(queue)
