"""Fixtures that serve the real app on loopback ports.

One daemon thread runs an event loop holding every uvicorn server of the test
session. ``served`` is the main app: its lifespan loads the embedded SmolLM2
once per session. ``serve_app`` builds more apps around that same ``AsyncLLM``
(API key, small body limit) at no extra load; ``serve_fresh_engine`` starts an
app with an engine of its own, for tests that break it. Tests talk HTTP to the
servers and read engine state in-process (``served.engine.get_stats()``).

``pytest_collection_modifyitems`` gives every test its tier marker (docs/testing.md).
"""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET once, when it is first imported, and transformers
# imports it early: set it before anything else so the Triton kernels run (and are
# tested) on machines without a GPU.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineArgs
from pagedserve.server.app import ServerArgs, build_app
from pagedserve.server.connections import GuardedH11Protocol

#: Small enough to start fast on a shared 2-core machine.
TEST_ENGINE_ARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": "256MiB"}
STARTUP_TIMEOUT_S = 300.0


@dataclass
class Served:
    """A running app: its base URL, the app, and what stops it."""

    url: str
    app: FastAPI
    server: uvicorn.Server
    done: Future

    @property
    def engine(self) -> AsyncLLM:
        return self.app.state.engine


class ServerLoop:
    """An event loop on a daemon thread that runs uvicorn servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self.thread.start()

    def start(self, app: FastAPI) -> Served:
        """Serve ``app`` on a free loopback port; returns once its lifespan has started.

        Raises:
            RuntimeError: when the server stops or times out before it starts.
        """
        # The protocol `pagedserve serve` uses: uvicorn's default picks httptools when installed (ray brings it).
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                               http=GuardedH11Protocol))
        done = asyncio.run_coroutine_threadsafe(server.serve(), self.loop)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if done.done() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start; see the log above")
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        return Served(f"http://127.0.0.1:{port}", app, server, done)

    def stop(self, served: Served) -> None:
        served.server.should_exit = True
        served.done.result(timeout=120)

    def close(self) -> None:
        """Cancel what the servers left running (e.g. sse-starlette's shutdown watcher), stop the loop."""
        async def cancel_leftovers() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_leftovers(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(autouse=True)
def _no_api_key_from_the_developer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``PAGEDSERVE_API_KEY`` in the shell that runs the tests would lock every server they start (the
    settings read it, ``pagedserve.engine.envs``); tests that want a key set it themselves."""
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama (vocabulary 256, untied head) saved as an HF folder, without a tokenizer."""
    from benchmarks.tiny_models import tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", folder, tie_word_embeddings=False)
    return str(folder)


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def served(server_loop: ServerLoop) -> Iterator[Served]:
    """The main app, with the engine its lifespan created."""
    served = server_loop.start(build_app(EngineArgs(**TEST_ENGINE_ARGS)))
    yield served
    server_loop.stop(served)


@pytest.fixture(scope="session")
def serve_app(server_loop: ServerLoop, served: Served) -> Iterator[Callable[[ServerArgs], Served]]:
    """Serve another app around the main app's engine, with other ``ServerArgs``."""
    started: list[Served] = []

    def start(server_args: ServerArgs) -> Served:
        started.append(server_loop.start(build_app(server_args=server_args, engine=served.engine)))
        return started[-1]

    yield start
    for app in started:
        server_loop.stop(app)


@pytest.fixture(scope="module")
def serve_fresh_engine(server_loop: ServerLoop) -> Iterator[Callable[..., Served]]:
    """Serve an app whose lifespan creates (and, after the module, shuts down) its own engine."""
    started: list[Served] = []

    def start(**engine_args: object) -> Served:
        started.append(server_loop.start(build_app(EngineArgs(**engine_args))))
        return started[-1]

    yield start
    for app in started:
        server_loop.stop(app)


@pytest.fixture(scope="session")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """The data of each server-sent event in ``lines``: parsed JSON, or the string ``[DONE]``."""
    payloads = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def engine_step_fault(tmp_path: Path, first_faulty_step: int, fault: str) -> dict[str, str]:
    """The environment for a ``cli_server`` whose ``EngineCore.step`` runs the statement ``fault`` (``ctypes``
    imported) from its ``first_faulty_step``-th call on. The engine process is spawned, so a patch made in the
    server's own process would not reach it: the patch goes in a ``sitecustomize`` module on ``PYTHONPATH``,
    which every Python process of the server runs at start."""
    folder = tmp_path / "hook"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"""
import ctypes
from pagedserve.engine.engine_core import EngineCore
step = EngineCore.step
calls = []
def faulty_step(self):
    calls.append(1)
    if len(calls) >= {first_faulty_step}:
        {fault}
    return step(self)
EngineCore.step = faulty_step
""")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def cli_server(tmp_path: Path, *args: str, python: Sequence[str] = (sys.executable,),
               cwd: Path | None = None, env: Mapping[str, str] | None = None
               ) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``python -m pagedserve serve --port P ARGS`` as its own process,
    logging to ``tmp_path/server.log``; yields ``(url, process)`` once healthy and kills it at exit.

    Args:
        python: the interpreter and its options (e.g. ``-P``).
        cwd, env: the process's folder and extra environment variables.
    """
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen([*python, "-m", "pagedserve", "serve", "--port", str(port), *args], stdout=log,
                               stderr=subprocess.STDOUT, cwd=cwd,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        yield url, process
    finally:
        process.kill()
        log.close()


# --------------------------------------------------------------------------- test tiers (docs/testing.md)

#: Fixtures that start a server (this file's) or a browser (test_dashboard_browser.py's): a test that uses one,
#: itself or through another fixture, is in the ``server`` tier.
SERVER_FIXTURES = frozenset({"server_loop", "browser"})
TIERS = ("fast", "slow", "server", "infra")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each test its tier (pyproject.toml's markers) unless its module or itself names one
    (``pytestmark``, a decorator: ``slow`` and ``infra`` are only given so): ``server`` when it uses a server
    fixture or runs ``cli_server``, else ``fast``."""
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            continue
        function = getattr(item, "function", None)
        starts_server = SERVER_FIXTURES.intersection(item.fixturenames) or (
            function is not None and _refers_to(function.__code__, function.__globals__, cli_server, set()))
        item.add_marker(pytest.mark.server if starts_server else pytest.mark.fast)


def _refers_to(code: Any, module_globals: dict[str, Any], target: object, seen: set[Any]) -> bool:
    """Whether ``code`` names ``target``, itself, in a function it defines, or in a function of its module
    that it calls (so that a test starting its server through a helper is found too)."""
    if code in seen:
        return False
    seen.add(code)
    for name in code.co_names:
        value = module_globals.get(name)
        if value is target:
            return True
        if getattr(value, "__globals__", None) is module_globals and _refers_to(
                value.__code__, module_globals, target, seen):
            return True
    return any(_refers_to(const, module_globals, target, seen) for const in code.co_consts
               if hasattr(const, "co_names"))
