"""Slow and oversized clients against ``GuardedH11Protocol``, over raw sockets to a real uvicorn server."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from pagedserve.server.connections import GuardedH11Protocol
from tests.conftest import free_port

TIMEOUT_S = 0.5


async def _echo_length(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the body's length once it has all arrived."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(str(size)))]})
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    port = free_port()
    config = uvicorn.Config(_echo_length, port=port, lifespan="off", log_level="warning",
                            http=GuardedH11Protocol.with_timeouts(TIMEOUT_S, TIMEOUT_S))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(10)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (the test fails if nothing comes for 60 s)."""
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_complete_request_is_answered(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc")
        assert _read_all(sock).startswith(b"HTTP/1.1 200")


def test_a_silent_connection_is_closed(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as sock:
        assert _read_all(sock) == b""


def test_headers_that_never_end_get_408(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        # Dripping bytes does not push the deadline back.
        while time.monotonic() - started < 2 * TIMEOUT_S:
            try:
                sock.sendall(b"x")
            except OSError:
                break
            time.sleep(0.05)
        assert _read_all(sock).startswith(b"HTTP/1.1 408")


def test_a_body_that_stops_arriving_gets_408(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc")
        assert _read_all(sock).startswith(b"HTTP/1.1 408")


def test_a_1_mb_header_gets_431_not_a_reset(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 2**20 + b"\r\n\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 431")
