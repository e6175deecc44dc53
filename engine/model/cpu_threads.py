"""Which CPU ops of a forward pass get all intra-op threads, and which run on one.

Every op torch parallelises is an OpenMP parallel region, and every region
ends in a barrier that waits for its slowest thread. A decode step runs about
twenty elementwise ops per layer (norms, rotary, activation) on tensors of a
few tens of thousands of elements: their arithmetic takes microseconds, so a
barrier whose peer thread is descheduled (by the HTTP frontend, the tokenizer,
a load generator, anything else on the machine) costs far more than the work.
GEMMs and attention are long enough to repay the barrier.

So while ``serial_elementwise(True)`` is active (the model runner wraps small
CPU steps in it), torch runs on one thread and only the blocks marked
``all_threads()`` get the full count back: the linear methods' ``apply``
(``linear_methods.py``) and the torch and CPU attention backends' ``forward``;
models hold no thread policy. Measured on
the 2-core test machine, serving 64 streams in bf16: 387-426 -> 455-485 output
tok/s; the same workload offline, with nothing else running, is unchanged.

OpenMP thread counts belong to the calling thread, and so does this module's
state. One caveat: ``torch.set_num_threads`` also sets the default a thread
starts with, so a thread that first touches torch while the engine thread is
inside ``serial_elementwise`` starts with one thread (the frontend's threads
tokenize with the Rust tokenizers and run no torch ops).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()  # .full_threads: the count to give back; absent or None outside serial blocks


@contextlib.contextmanager
def serial_elementwise(enabled: bool) -> Iterator[None]:
    """Run the block's torch ops on one thread, except inside ``all_threads()``; a no-op when not enabled."""
    if not enabled or getattr(_state, "full_threads", None) is not None:
        yield
        return
    _state.full_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(_state.full_threads)
        _state.full_threads = None


@contextlib.contextmanager
def all_threads() -> Iterator[None]:
    """Give the block every intra-op thread again (for GEMMs and attention) inside ``serial_elementwise``."""
    full = getattr(_state, "full_threads", None)
    if full is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(full)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
