"""The engine process's transport, measured: what one step's result costs to send to the server process.

The engine core sends each step's outputs to the frontend (``pagedserve.engine.core_client``), so the
transport's cost is paid once per step on both sides. Candidates, each a child process echoing what it
receives back to the parent:

- ``pipe+pickle`` (what pagedserve uses): ``multiprocessing.Pipe``'s ``send``/``recv``, which pickle (the
  dataclasses as they are);
- ``pipe+msgpack``: the same pipe's ``send_bytes``/``recv_bytes`` with msgpack, the dataclasses flattened to
  tuples and rebuilt on the other side (msgpack carries no classes), when msgpack is installed (Ray brings it);
- ``zmq+pickle`` (vLLM's choice, with msgspec): a PAIR socket over IPC, when pyzmq is installed.

Messages: a step of 1, 16 and 64 decoding requests (one token each, no logprobs), and one of 16 requests
with 5 top logprobs per token. For each the median round trip over ``--iterations`` is reported, with the
parent's encode + decode time alone (what the server's event loop pays).

    python -m benchmarks.engine_transport --iterations 2000
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import astuple
from typing import Any

from pagedserve.engine.core.scheduler import SchedulerStats
from pagedserve.engine.outputs import EngineCoreOutput, TokenLogprobs


def step_message(num_requests: int, num_logprobs: int = 0) -> tuple:
    """What the engine process sends after one decode step (``_ProcSink.on_step``)."""
    outputs = []
    for i in range(num_requests):
        top = range(num_logprobs + 1)
        logprobs = [TokenLogprobs([17 + j for j in top], [-0.5 * j for j in top], 1)] if num_logprobs else None
        outputs.append(EngineCoreOutput(request_id=f"cmpl-{i:032x}-0", new_token_ids=[1000 + i], num_cached_tokens=64,
                                        new_logprobs=logprobs, first_scheduled_time=12345.678))
    stats = SchedulerStats(num_running_reqs=num_requests, num_waiting_reqs=0, kv_cache_usage=0.25,
                           prefix_cache_queries=10_000, prefix_cache_hits=4_000, num_preemptions=0,
                           num_scheduled_tokens=100_000)
    return ("step", outputs, stats, num_requests, None)


def _pickle(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # what multiprocessing's send does


def _flatten(message: tuple) -> bytes:
    import msgpack

    kind, outputs, stats, num_applied, record = message
    rows = [(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason, o.num_cached_tokens,
             [astuple(lp) for lp in o.new_logprobs] if o.new_logprobs else None, None, o.first_scheduled_time,
             o.error, o.error_param) for o in outputs]
    return msgpack.packb((kind, rows, astuple(stats), num_applied, record))


def _unflatten(data: bytes) -> tuple:
    import msgpack

    kind, rows, stats, num_applied, record = msgpack.unpackb(data)
    outputs = [EngineCoreOutput(request_id=r[0], new_token_ids=r[1], finish_reason=r[2], stop_reason=r[3],
                                num_cached_tokens=r[4],
                                new_logprobs=[TokenLogprobs(*lp) for lp in r[5]] if r[5] else None,
                                first_scheduled_time=r[7], error=r[8], error_param=r[9]) for r in rows]
    return kind, outputs, SchedulerStats(*stats), num_applied, record


def _echo_pipe(conn: Any) -> None:
    while (data := conn.recv_bytes()) != b"":
        conn.send_bytes(data)


def _echo_zmq(address: str) -> None:
    import zmq
    socket = zmq.Context().socket(zmq.PAIR)
    socket.connect(address)
    while (data := socket.recv()) != b"":
        socket.send(data)


def _time_round_trips(send: Callable[[Any], None], receive: Callable[[], Any], message: Any,
                      iterations: int) -> float:
    """Median seconds of one send + receive of ``message``."""
    for _ in range(50):
        send(message)
        receive()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        send(message)
        receive()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _codec_s(encode: Callable[[Any], bytes], decode: Callable[[bytes], Any], message: Any, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        decode(encode(message))
    return (time.perf_counter() - start) / iterations


def measure(iterations: int) -> list[dict[str, Any]]:
    messages = {"1 request": step_message(1), "16 requests": step_message(16), "64 requests": step_message(64),
                "16 requests, 5 logprobs": step_message(16, 5)}
    context = mp.get_context("spawn")
    rows = []
    # The child echoes bytes: both ends' codec work is the parent's, measured the same way for each format.
    codecs = [("pipe+pickle", _pickle, pickle.loads)]
    if importlib.util.find_spec("msgpack") is not None:
        codecs.append(("pipe+msgpack", _flatten, _unflatten))
    for name, encode, decode in codecs:
        parent, child = context.Pipe()
        process = context.Process(target=_echo_pipe, args=(child,), daemon=True)
        process.start()
        for label, message in messages.items():
            round_trip = _time_round_trips(lambda m, conn=parent, encode=encode: conn.send_bytes(encode(m)),
                                           lambda conn=parent, decode=decode: decode(conn.recv_bytes()), message,
                                           iterations)
            rows.append({"transport": name, "message": label, "round_trip_us": 1e6 * round_trip,
                         "encode_decode_us": 1e6 * _codec_s(encode, decode, message, iterations)})
        parent.send_bytes(b"")
        process.join(10)
    try:
        import zmq
    except ImportError:
        return rows
    address = f"ipc://{tempfile.mkdtemp()}/engine"
    socket = zmq.Context().socket(zmq.PAIR)
    socket.bind(address)
    process = context.Process(target=_echo_zmq, args=(address,), daemon=True)
    process.start()
    for label, message in messages.items():
        round_trip = _time_round_trips(lambda m: socket.send(_pickle(m)), lambda: pickle.loads(socket.recv()),
                                       message, iterations)
        rows.append({"transport": "zmq+pickle", "message": label, "round_trip_us": 1e6 * round_trip,
                     "encode_decode_us": 1e6 * _codec_s(_pickle, pickle.loads, message, iterations)})
    socket.send(b"")
    process.join(10)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args(argv)
    print("| transport | message | round trip p50 us | encode + decode us |\n|---|---|---|---|")
    for row in measure(args.iterations):
        print(f"| {row['transport']} | {row['message']} | {row['round_trip_us']:.1f} | {row['encode_decode_us']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
