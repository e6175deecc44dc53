"""The thread switching that keeps small CPU steps' elementwise ops off the OpenMP barrier, and small steps
off the core a server leaves to its frontend."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.model.cpu_threads import all_threads, serial_elementwise, small_step_threads, threads_at_most
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


def test_threads_at_most_lowers_the_count_and_all_threads_inside_gives_back_only_that() -> None:
    torch.set_num_threads(3)
    with threads_at_most(2):
        assert torch.get_num_threads() == 2
        with serial_elementwise(True):
            assert torch.get_num_threads() == 1
            with all_threads():
                assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 3
    for unchanged in (None, 3, 8):
        with threads_at_most(unchanged):
            assert torch.get_num_threads() == 3
    with pytest.raises(RuntimeError), threads_at_most(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize(("threads", "cores", "reserved", "ranks", "expected"), [
    (2, 2, 1, 1, 1),  # the development machine: one thread, one core for the frontend
    (16, 16, 1, 1, 15),
    (16, 16, 2, 1, 14),
    (1, 1, 1, 1, 1),  # never below one thread
    (4, 16, 1, 1, None),  # OMP_NUM_THREADS=4 leaves 12 cores free already
    (15, 16, 1, 1, None),
    (16, 16, 0, 1, None),  # offline
    (8, 16, 1, 2, None),  # tensor-parallel ranks keep their shares
])
def test_small_step_threads_leave_the_reserved_cores_of_the_machine(threads, cores, reserved, ranks,
                                                                    expected) -> None:
    assert small_step_threads(threads, cores, reserved, ranks) == expected


def test_the_server_reserves_a_core_for_its_frontend_and_offline_reserves_none(served: Served) -> None:
    assert served.engine.client.core.executor.worker.model_runner.reserved_cores == 1
    assert EngineArgs().cpu_reserved_cores is None  # resolved by who runs the engine: AsyncLLM 1, LLM 0
    with pytest.raises(ValueError, match="cpu_reserved_cores must be >= 0"):
        EngineArgs(cpu_reserved_cores=-1)
