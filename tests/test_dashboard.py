"""The dashboard's data (``docs/dashboard.md``): step records, their stream, the KV-cache snapshot,
through the real server; and the records' bookkeeping on a small engine with preemption.

The page itself is tested in a real browser by ``tests/test_dashboard_browser.py``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from pagedserve.engine.config import EngineArgs
from pagedserve.server.app import ServerArgs
from tests.conftest import Served

RECORD_FIELDS = {"step", "time", "duration_ms", "num_scheduled_tokens", "max_num_batched_tokens", "num_running",
                 "num_waiting", "kv_blocks", "requests", "preempted", "finished"}


def _complete(client: httpx.Client, prompt: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                    **body})
    assert response.status_code == 200, response.text
    return response.json()


def _records_of(records: list[dict[str, Any]], request_id: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(record, entry) for record in records for entry in record["requests"] if entry["id"] == request_id]


def test_a_request_s_life_is_in_the_step_records(client: httpx.Client) -> None:
    completion = _complete(client, "The dashboard shows " * 20, max_tokens=5)
    request_id = f"{completion['id']}-0"
    records = client.get("/v1/dashboard/steps/recent", params={"limit": 100}).json()
    assert all(RECORD_FIELDS <= record.keys() for record in records)
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    life = _records_of(records, request_id)
    assert life, "the request's steps are recorded"
    first_record, first = life[0]
    assert first["kind"] == "new" and first["phase"] == "prefill" and first["computed"] == first["cached_tokens"]
    assert first["arrival_time"] <= first_record["time"]
    assert first["prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert [entry["kind"] for _, entry in life[1:]] == ["cached"] * (len(life) - 1)
    # Every prompt token is computed once, then one decode step per output token but the last.
    assert sum(entry["tokens"] for _, entry in life) == first["prompt_tokens"] - first["cached_tokens"] + 5 - 1
    assert sum(entry["samples"] for _, entry in life) == 5
    finished = [f for record in records for f in record["finished"] if f["id"] == request_id]
    assert finished == [{"id": request_id, "reason": "length", "output_tokens": 5}]
    for record in records:
        assert record["num_scheduled_tokens"] == sum(entry["tokens"] for entry in record["requests"])
        assert record["num_scheduled_tokens"] <= record["max_num_batched_tokens"]
        blocks = record["kv_blocks"]
        assert blocks["used"] + blocks["cached_free"] + blocks["free"] == blocks["total"]
        assert set(record["duration_ms"]) == {"schedule", "forward", "sample", "update", "total"}


def test_the_stream_sends_the_backlog_then_new_steps(client: httpx.Client, served: Served) -> None:
    _complete(client, "Warm up the buffer.")
    last = client.get("/v1/dashboard/steps/recent", params={"limit": 1}).json()[-1]["step"]
    seen: list[dict[str, Any]] = []
    with httpx.Client(base_url=served.url, timeout=60) as streamer, \
            streamer.stream("GET", "/v1/dashboard/steps", params={"history": 1, "every_step": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        sender = threading.Thread(target=_complete, args=(client, "Now a new request.", 3))
        for line in lines:
            if not line.startswith("data: "):
                continue
            seen.append(json.loads(line[6:]))
            if len(seen) == 1:
                sender.start()
            if any(f["reason"] == "length" for f in seen[-1]["finished"]):
                break
        sender.join()
    # The backlog of one: the newest record when the stream began. That may be a step after ``last``: the
    # step after a finish that only tells the worker to drop the request can be recorded after the
    # completion's response, so a loaded machine sees it after reading ``last`` (seen once: 10 == 9).
    assert seen[0]["step"] >= last
    steps = [record["step"] for record in seen]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # every step, in order, with every_step


def test_a_rate_limited_stream_loses_no_finish(client: httpx.Client, served: Served) -> None:
    """At one record a second, the records in between are not sent, but their finishes are."""
    ids: list[str] = []

    def send() -> None:
        for i in range(3):
            ids.append(f"{_complete(client, f'Finish number {i}.', 2)['id']}-0")

    finished: set[str] = set()
    with httpx.Client(base_url=served.url, timeout=60) as streamer, \
            streamer.stream("GET", "/v1/dashboard/steps", params={"history": 0, "max_rate": 1}) as response:
        sender = threading.Thread(target=send)
        sender.start()
        for line in response.iter_lines():
            if line.startswith("data: "):
                finished |= {f["id"] for f in json.loads(line[6:])["finished"]}
            if len(ids) == 3 and set(ids) <= finished:
                break
        sender.join()
    assert set(ids) <= finished


def test_the_kv_cache_snapshot_shows_owners_and_cached_blocks(client: httpx.Client, served: Served) -> None:
    prompt = "A shared prefix that fills a few blocks of the cache. " * 6
    _complete(client, prompt)
    snapshot = client.get("/v1/dashboard/kv_cache").json()
    assert snapshot["num_blocks"] == len(snapshot["states"]) and snapshot["states"][0] == "N"
    assert set(snapshot["states"][1:]) <= {"U", "C", "F"}
    assert "C" in snapshot["states"]  # the finished prompt's full blocks stay cached for reuse
    assert not snapshot["owners"] and "U" not in snapshot["states"]  # nothing runs now
    record = client.get("/v1/dashboard/steps/recent", params={"limit": 1}).json()[-1]
    assert record["kv_blocks"]["cached_free"] == snapshot["states"].count("C")


def test_records_can_be_switched_off(serve_fresh_engine: Any) -> None:
    served = serve_fresh_engine(max_model_len=256, kv_cache_memory_bytes="16MiB", step_record_buffer_size=0)
    with httpx.Client(base_url=served.url, timeout=60) as client:
        _complete(client, "Hello")
        for path in ("/v1/dashboard/steps/recent", "/v1/dashboard/steps", "/v1/dashboard/kv_cache"):
            response = client.get(path)
            assert response.status_code == 404 and response.json()["error"]["code"] == "step_records_off"
        assert client.get("/dashboard").status_code == 200


def test_the_page_and_its_files_are_served_and_the_data_is_behind_the_key(
        client: httpx.Client, serve_app: Any) -> None:
    page = client.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for name in ("dashboard.js", "dashboard.css"):
        assert f"/dashboard/static/{name}" in page.text
        assert client.get(f"/dashboard/static/{name}").status_code == 200
    keyed = serve_app(ServerArgs(api_key="sesame"))
    with httpx.Client(base_url=keyed.url, timeout=60) as other:
        assert other.get("/dashboard").status_code == 200  # the page: no data in it
        assert other.get("/v1/dashboard/kv_cache").status_code == 401
        assert other.get("/v1/dashboard/kv_cache", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_preemptions_and_resumptions_are_recorded(serve_fresh_engine: Any) -> None:
    served = serve_fresh_engine(max_model_len=256, num_gpu_blocks_override=12, block_size=16, max_num_seqs=8,
                                step_record_buffer_size=4096)
    with httpx.Client(base_url=served.url, timeout=120) as client:
        threads = [threading.Thread(target=_complete, args=(client, f"Story number {i}: once upon a time", 48))
                   for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        records = client.get("/v1/dashboard/steps/recent", params={"limit": 4096}).json()
    preempted = {request_id for record in records for request_id in record["preempted"]}
    assert preempted, "a 12-block cache preempts six growing requests"
    resumed = [entry for record in records for entry in record["requests"] if entry["kind"] == "resumed"]
    assert preempted <= {entry["id"] for entry in resumed}
    # Resumed, a request recomputes its prompt and its output: a prefill, not a decode.
    assert all(entry["phase"] == "prefill" for entry in resumed if entry["tokens"] > 1)
    assert len({f["id"] for record in records for f in record["finished"]}) == 6


def test_the_records_cost_only_a_buffer_size_setting() -> None:
    with pytest.raises(ValueError, match="step_record_buffer_size"):
        EngineArgs(step_record_buffer_size=-1)


def test_a_stop_string_finish_is_recorded_as_a_stop(client: httpx.Client) -> None:
    completion = _complete(client, "Count: 1, 2, 3,", max_tokens=20, stop=[","], ignore_eos=True)
    assert completion["choices"][0]["finish_reason"] == "stop"
    request_id = f"{completion['id']}-0"
    # The frontend finds the stop string and aborts the request in the engine: a step or two later.
    for _ in range(50):
        records = client.get("/v1/dashboard/steps/recent", params={"limit": 50}).json()
        finished = [f for record in records for f in record["finished"] if f["id"] == request_id]
        if finished:
            break
        _complete(client, "Another step.", max_tokens=1)
    assert finished and finished[0]["reason"] == "stop" and finished[0]["output_tokens"] >= 1


def test_recent_pages_forward_from_since(client: httpx.Client) -> None:
    _complete(client, "Make a few steps.", max_tokens=4)
    last = client.get("/v1/dashboard/steps/recent", params={"limit": 4}).json()
    first_step = last[0]["step"]
    page = client.get("/v1/dashboard/steps/recent", params={"since": first_step - 1, "limit": 2}).json()
    assert [record["step"] for record in page] == [first_step, first_step + 1]


def test_a_closed_stream_leaves_no_follower(client: httpx.Client, served: Served) -> None:
    followers = served.engine.step_records._followers
    _complete(client, "So that the stream has a backlog to send.", max_tokens=2)
    # An earlier test's closed stream may still be listed until the server notices it gone: follow ours only.
    earlier = set(followers)
    with httpx.Client(base_url=served.url, timeout=60) as streamer, \
            streamer.stream("GET", "/v1/dashboard/steps", params={"history": 1}) as response:
        # Held in a variable: a line iterator that is dropped closes the connection (httpcore closes an
        # unfinished response when its iterator is closed), and the server would let the follower go.
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        ours = followers - earlier
        assert len(ours) == 1
    # The server sees the client gone (sse-starlette listens for the disconnect) and ends the stream.
    deadline = time.monotonic() + 60
    while ours & followers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours & followers
