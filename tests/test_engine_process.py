"""``pagedserve serve`` runs its engine core in a child process: what clients and orchestrators see when that
process dies (``kill -9``, a segfault), and that messages and errors cross it whole."""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
from pathlib import Path

import httpx

from pagedserve.engine.core_client import picklable_error
from pagedserve.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from tests.conftest import cli_server, engine_step_fault, sse_payloads

ARGS = ("--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB")
#: The issue's bound: an orchestrator restarts a server whose engine died within this (s).
EXIT_WITHIN_S = 10
STREAM = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}

def engine_pid(log: Path, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := re.search(r"engine core running in process (\d+)", log.read_text()):
            return int(match.group(1))
        time.sleep(0.1)
    raise AssertionError(f"no engine process in the log:\n{log.read_text()}")


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_engine_core_runs_in_a_child_process_and_serves(tmp_path: Path) -> None:
    with cli_server(tmp_path, *ARGS) as (url, process):
        pid = engine_pid(tmp_path / "server.log")
        assert pid != process.pid and parent_pid(pid) == process.pid
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200 and "Paris" in response.json()["choices"][0]["text"]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    deadline = time.monotonic() + 30  # the child stops with its parent: its pipe closes
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


def test_with_multiprocessing_off_the_engine_core_runs_in_the_server_s_process(tmp_path: Path) -> None:
    with cli_server(tmp_path, *ARGS, env={"PAGEDSERVE_ENABLE_MULTIPROCESSING": "0"}) as (url, process):
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200 and "Paris" in response.json()["choices"][0]["text"]
        children = [pid for task in Path(f"/proc/{process.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        assert children == []
        log = (tmp_path / "server.log").read_text()
        assert "engine core runs on a thread of this process" in log and "engine core running in process" not in log


def test_a_signal_for_the_server_s_process_group_does_not_kill_the_engine(tmp_path: Path) -> None:
    """Ctrl-C in a terminal reaches the whole foreground process group: the engine must outlive it, so that
    the server can drain its requests and then stop the engine."""
    with cli_server(tmp_path, *ARGS) as (url, _):
        pid = engine_pid(tmp_path / "server.log")
        assert os.getpgid(pid) == pid  # a group of its own
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_kill_9_of_the_engine_ends_the_stream_with_an_error_and_the_server_exits_1(tmp_path: Path) -> None:
    with cli_server(tmp_path, *ARGS) as (url, process):
        pid = engine_pid(tmp_path / "server.log")
        with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(pid, signal.SIGKILL)
            events = sse_payloads([first, *lines])
        killed = time.monotonic()
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert "engine process died (killed by signal 9)" in events[-2]["error"]["message"]
        assert process.wait(timeout=EXIT_WITHIN_S) == 1
        assert time.monotonic() - killed < EXIT_WITHIN_S


def test_a_segfault_in_the_engine_fails_the_request_with_503_and_the_server_exits_1(tmp_path: Path) -> None:
    # From the third step on, the engine process reads address 0: a segfault in native code, as a kernel's would
    # be. The server's own process never steps, so only the engine process faults.
    segfault = engine_step_fault(tmp_path, 3, "ctypes.string_at(0)")
    with cli_server(tmp_path, *ARGS, env=segfault) as (url, process):
        body = {"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_dead"
        assert "killed by signal 11" in response.json()["error"]["message"]
        assert process.wait(timeout=EXIT_WITHIN_S) == 1
    assert "exiting with status 1 because the engine died" in (tmp_path / "server.log").read_text()


def test_errors_cross_the_process_boundary_whole() -> None:
    for error in (InvalidRequestError("grammar too large", "structured_outputs"),
                  RequestFailedError("cmpl-1", "ValueError('bad row')"), EngineDeadError("gone")):
        copy = pickle.loads(pickle.dumps(picklable_error(error)))
        assert type(copy) is type(error) and str(copy) == str(error) and vars(copy) == vars(error)

    class Unpicklable(ValueError):  # a refusal the engine raised: it must stay a 400 on the other side
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    copy = pickle.loads(pickle.dumps(picklable_error(Unpicklable(1, 2))))
    assert type(copy) is ValueError and str(copy) == "Unpicklable: 1/2"


def test_async_scheduling_serves_what_the_synchronous_engine_serves(tmp_path: Path, client: httpx.Client) -> None:
    """``--async-scheduling`` reaches the engine process, and clients get the synchronous engine's answers
    (the session's server): greedy choices, logprobs, a stop string in a stream, a grammar."""
    requests = [
        {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": 2},
        {"prompt": "Count: 1, 2, 3,", "max_tokens": 30, "temperature": 0, "stop": [" 7"], "stream": True},
        {"prompt": "Is the sky blue? Answer:", "max_tokens": 5, "temperature": 0, "guided_choice": [" yes", " no"]},
    ]

    def answers(post) -> list[object]:
        result = []
        for body in requests:
            response = post("/v1/completions", body)
            assert response.status_code == 200, response.text
            if body.get("stream"):
                events = [e for e in sse_payloads(response.iter_lines()) if e != "[DONE]"]
                result.append(("".join(e["choices"][0]["text"] for e in events),
                               [e["choices"][0]["finish_reason"] for e in events][-1]))
            else:
                result.append([(c["text"], c["finish_reason"], c["logprobs"]) for c in response.json()["choices"]])
        return result

    expected = answers(lambda path, body: client.post(path, json=body))
    with cli_server(tmp_path, *ARGS, "--async-scheduling") as (url, _):
        assert "async scheduling: each step is planned while the worker runs" in (tmp_path / "server.log").read_text()
        with httpx.Client(base_url=url, timeout=120) as async_client:
            assert answers(lambda path, body: async_client.post(path, json=body)) == expected
