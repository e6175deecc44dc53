"""What the check's sections share while it runs: results, time budget, engine log, device housekeeping.

Every section records into one results dict, which is rewritten to disk
after every part, so a check killed half-way still leaves what it measured.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.markdown import fmt


class LogRecorder(logging.Handler):
    """Keeps the engine's INFO messages (memory sizing, graph capture time) for the report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")

    @contextlib.contextmanager
    def capture(self, into: list[str]) -> Iterator[None]:
        """Append the messages logged while the block runs to ``into``."""
        start = len(self.messages)
        try:
            yield
        finally:
            into.extend(self.messages[start:])


@dataclass
class CheckContext:
    """The run's settings, its results and its time budget.

    Attributes:
        device: ``cuda``, or ``cpu`` for a dry run.
        quick: small sizes everywhere.
        models: tiny architectures the greedy parity section runs.
        tmp: scratch folder for the models the check writes.
        out: where the summary goes.
        deadline: ``time.monotonic()`` after which parts are skipped.
        results: ``meta`` and ``sections``, as the report renders them.
        save_summary: writes ``results`` (without private keys) to ``out``.
    """

    device: str
    quick: bool
    models: tuple[str, ...]
    tmp: Path
    out: Path
    deadline: float
    results: dict[str, Any]
    save_summary: Callable[[dict[str, Any], Path], object]
    recorder: LogRecorder = field(default_factory=LogRecorder)
    _started: dict[str, float] = field(default_factory=dict)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def say(self, line: str) -> None:
        print(line, flush=True)

    def section(self, name: str) -> dict[str, Any]:
        return self.results["sections"].setdefault(name, {"status": "pending", "data": {}, "notes": []})

    def begin(self, name: str) -> None:
        self._started[name] = time.perf_counter()
        self.section(name)["status"] = "running"
        self.say(f"[{name}] ...")

    def end(self, name: str) -> None:
        section = self.section(name)
        if section["status"] == "running":
            section["status"] = "ok"
        section["elapsed_s"] = time.perf_counter() - self._started[name]
        self.save()

    def record_error(self, name: str, prefix: str = "") -> None:
        """Add the exception being handled to the section's error and mark it failed."""
        section = self.section(name)
        section["status"] = "error"
        section["error"] = (section.get("error") or "") + prefix + traceback.format_exc()
        self.say(f"[{name}] error: {prefix}{traceback.format_exc().strip().splitlines()[-1]}")

    def fail(self, name: str, prefix: str = "") -> None:
        """Record the exception being handled and close the section."""
        self.record_error(name, prefix)
        self.end(name)

    def note(self, name: str, text: str) -> None:
        self.section(name)["notes"].append(text)

    def add_run(self, name: str, run: dict[str, Any]) -> None:
        self.section(name)["data"].setdefault("runs", []).append(run)
        self.say(f"[{name}] " + ", ".join(f"{k} {fmt(v)}" for k, v in run.items() if not isinstance(v, dict)))
        self.save()

    def run_part(self, name: str, fn: Callable[[], object]) -> bool:
        """Run one part of a section; an exception marks the section as failed but lets later parts run.

        Returns:
            Whether the part succeeded.
        """
        try:
            fn()
        except Exception:
            self.record_error(name)
            return False
        return True

    def run_section(self, name: str, fn: Callable[[CheckContext], dict[str, Any]]) -> None:
        """Run a whole section, which returns its data; an exception is recorded and the check goes on."""
        self.begin(name)
        if self.out_of_time():
            self.section(name)["status"] = "skipped"
            self.note(name, "time budget spent before this section")
        else:
            try:
                self.section(name)["data"] = fn(self)
            except Exception:
                self.fail(name)
                return
        self.end(name)

    def save(self) -> None:
        meta = self.results["meta"]
        meta["elapsed_s"] = time.perf_counter() - meta["_t0"]
        self.save_summary({**self.results, "meta": {k: v for k, v in meta.items() if k != "_t0"}}, self.out)


def free_memory() -> None:
    """Return what the last part held to the allocator, so the next part starts from the same memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    """Wait for the device's queued work, so a wall-clock time covers it."""
    if device == "cuda":
        torch.cuda.synchronize()


def attention_backend(llm: Any) -> str:
    """The attention backend the engine resolved (``attention_backend: auto`` made concrete)."""
    return llm.engine_core.executor.worker.attention_backend
