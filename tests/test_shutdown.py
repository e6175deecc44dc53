"""An orderly shutdown ends the streams it cannot wait for with an error event, never a cut body."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from tests.conftest import cli_server, sse_payloads


def test_a_stream_past_the_drain_timeout_ends_with_an_error_and_done(tmp_path: Path) -> None:
    with cli_server(tmp_path, "--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB",
                    "--shutdown-timeout", "1") as (url, process):
        body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            events = sse_payloads([first, *lines])
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == "the server shut down"
        assert events[-2]["error"]["code"] == "engine_dead"
        assert process.wait(timeout=120) == -signal.SIGTERM
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and " ERROR " not in log, log
