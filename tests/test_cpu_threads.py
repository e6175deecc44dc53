"""The thread switching that keeps small CPU steps' elementwise ops off the OpenMP barrier."""

from __future__ import annotations

import torch

from engine.model.cpu_threads import all_threads, serial_elementwise


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
