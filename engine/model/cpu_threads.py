"""Which CPU ops of a forward pass get all intra-op threads, and which run on one.

Every op torch parallelises is an OpenMP parallel region, and every region
ends in a barrier that waits for its slowest thread. A decode step runs about
twenty elementwise ops per layer (norms, rotary, activation) on tensors of a
few tens of thousands of elements: their arithmetic takes microseconds, so a
barrier whose peer thread is descheduled (by the HTTP frontend, the tokenizer,
a load generator, anything else on the machine) costs far more than the work.
GEMMs and attention are long enough to repay the barrier.

So while ``serial_elementwise(True)`` is active, torch runs on one thread and
only the blocks marked ``all_threads()`` get the full count back. Measured on
the 2-core test machine, serving 64 streams in bf16: 387-426 -> 480-485 output
tok/s; the same workload offline, with nothing else running, is unchanged.
Thread counts are process-wide, so this belongs to the one thread that runs
forward passes (the engine thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: Intra-op threads to restore inside ``all_threads()``; None outside ``serial_elementwise``.
_full_threads: int | None = None


@contextlib.contextmanager
def serial_elementwise(enabled: bool) -> Iterator[None]:
    """Run the block's torch ops on one thread, except inside ``all_threads()``; a no-op when not enabled."""
    global _full_threads
    if not enabled or _full_threads is not None:
        yield
        return
    _full_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(_full_threads)
        _full_threads = None


@contextlib.contextmanager
def all_threads() -> Iterator[None]:
    """Give the block every intra-op thread again (for GEMMs and attention) inside ``serial_elementwise``."""
    if _full_threads is None:
        yield
        return
    torch.set_num_threads(_full_threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)
