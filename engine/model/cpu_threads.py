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

A server has one more contender: the HTTP frontend's per-token work (output
processing, detokenization, SSE), about 1 ms of CPU per token. Decoding one
request on two cores, the fused decode kernel's two threads meet at some 240
barriers a step, and whenever the frontend preempts one of them the other spins
until the scheduler gives it back: 14-19 ms a token, against 9.4-10.4 ms on one
thread with the second core left to the frontend (2-core test machine, GGUF
SmolLM2, one stream, 4 runs each). So small steps run under
``threads_at_most(small_step_threads(...))``: the cores this process may use
less ``EngineArgs.cpu_reserved_cores``. Large steps keep every thread: at 64
streams their arithmetic dominates and one thread served 0.6-0.7x the tokens.

OpenMP thread counts belong to the calling thread, and so does this module's
state. One caveat: ``torch.set_num_threads`` also sets the default a thread
starts with, so a thread that first touches torch while the engine thread is
inside ``serial_elementwise`` or ``threads_at_most`` starts with that count
(the frontend's threads tokenize with the Rust tokenizers and run no torch ops).
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


def small_step_threads(threads: int, cores: int, reserved: int, ranks: int) -> int | None:
    """The intra-op threads of a small step that leaves ``reserved`` of ``cores`` to the frontend, or None for
    no change: when ``threads`` already leave them free (e.g. ``OMP_NUM_THREADS`` below the cores), when nothing
    is reserved, or with tensor-parallel ``ranks`` (each already runs on its share of the cores; not measured)."""
    if reserved <= 0 or ranks > 1 or threads + reserved <= cores:
        return None
    return max(1, min(threads, cores - reserved))


@contextlib.contextmanager
def threads_at_most(count: int | None) -> Iterator[None]:
    """Run the block's torch ops and C kernels (which share torch's OpenMP runtime) on at most ``count``
    intra-op threads; None or a count at or above the current one changes nothing.

    Enclosing ``serial_elementwise``, it lowers the count that ``all_threads`` gives back too."""
    previous = torch.get_num_threads()
    if count is None or count >= previous:
        yield
        return
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
