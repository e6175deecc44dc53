"""The thread switching that keeps small CPU steps' elementwise ops off the OpenMP barrier, and small steps
off the core a server leaves to its frontend."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import EngineArgs
from engine.model.cpu_threads import all_threads, fewer_threads, serial_elementwise
from tests.conftest import Served


@pytest.fixture(autouse=True)
def two_threads():
    """Two intra-op threads even on a one-core runner, so that "one" and "all" differ."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_serial_block_runs_on_one_thread_except_where_all_threads_are_asked_for() -> None:
    full = torch.get_num_threads()
    with serial_elementwise(True):
        assert torch.get_num_threads() == 1
        with all_threads():
            assert torch.get_num_threads() == full
        assert torch.get_num_threads() == 1
        with serial_elementwise(True):  # nested: no change, and leaving it keeps the outer state
            assert torch.get_num_threads() == 1
        with all_threads():
            assert torch.get_num_threads() == full
    assert torch.get_num_threads() == full


def test_disabled_or_outside_a_serial_block_nothing_changes() -> None:
    full = torch.get_num_threads()
    with serial_elementwise(False):
        assert torch.get_num_threads() == full
    with all_threads():
        assert torch.get_num_threads() == full


def test_thread_count_is_restored_when_the_block_raises() -> None:
    full = torch.get_num_threads()
    try:
        with serial_elementwise(True), all_threads():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == full
    with all_threads():  # the module is back outside any serial block
        assert torch.get_num_threads() == full


def test_a_serial_block_in_one_thread_leaves_another_threads_blocks_alone() -> None:
    seen = []

    def other_engine() -> None:
        torch.set_num_threads(2)
        with serial_elementwise(True):
            seen.append(torch.get_num_threads())

    with serial_elementwise(True):
        worker = threading.Thread(target=other_engine)
        worker.start()
        worker.join()
    assert seen == [1]  # the other thread's block really went serial: the state is per thread


def test_nested_all_threads_give_back_what_they_found() -> None:
    with serial_elementwise(True), all_threads():
        with all_threads():
            pass
        assert torch.get_num_threads() == 2


def test_fewer_threads_leaves_the_reserved_cores_and_all_threads_inside_gives_back_only_the_rest() -> None:
    torch.set_num_threads(3)
    with fewer_threads(1):
        assert torch.get_num_threads() == 2
        with serial_elementwise(True):
            assert torch.get_num_threads() == 1
            with all_threads():
                assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 3
    with fewer_threads(5):  # never below one thread
        assert torch.get_num_threads() == 1
    with fewer_threads(0):
        assert torch.get_num_threads() == 3
    with pytest.raises(RuntimeError), fewer_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 3


def test_the_server_reserves_a_core_for_its_frontend_and_offline_reserves_none(served: Served) -> None:
    assert served.engine.engine_core.executor.worker.model_runner.reserved_cores == 1
    assert EngineArgs().cpu_reserved_cores is None  # resolved by who runs the engine: AsyncLLM 1, LLM 0
    with pytest.raises(ValueError, match="cpu_reserved_cores must be >= 0"):
        EngineArgs(cpu_reserved_cores=-1)
