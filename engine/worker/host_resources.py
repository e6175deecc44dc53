"""The memory and CPU time this process may really use: the host's, narrowed by its cgroup.

A container started with ``--memory 2g --cpus 2`` still sees the host's
``/proc/meminfo`` and every core; the limits live in the cgroup files
(``memory.max`` and ``cpu.max`` on cgroup v2, ``memory.limit_in_bytes`` and
``cpu.cfs_quota_us`` on v1). Sizing the KV cache from the host's memory gets
the container OOM-killed at start, and one torch thread per host core on a
2-core quota makes every OpenMP barrier wait on a throttled thread.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: cgroup v1 writes "no limit" as a number near 2**63 (rounded down to the page size).
_NO_LIMIT = 2**62


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    """A cgroup value in bytes or microseconds; None for "max", a missing file or "no limit"."""
    if text is None or not text.isdigit():
        return None
    value = int(text)
    return value if value < _NO_LIMIT else None


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> tuple[int, int] | None:
    """``(limit, usage)`` in bytes of this process's memory cgroup, or None when it has no limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _number(_read(root / limit_file))
        if limit is not None:
            return limit, _number(_read(root / usage_file)) or 0
    return None


def available_memory_bytes(root: Path = CGROUP_ROOT, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes this process can still allocate: the host's ``MemAvailable``, capped by the cgroup's
    limit minus its usage; None when neither is known."""
    candidates = []
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            candidates.append(int(line.split()[1]) * 1024)  # kB
    cgroup = cgroup_memory_limit(root)
    if cgroup is not None:
        candidates.append(max(cgroup[0] - cgroup[1], 0))
    return min(candidates) if candidates else None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU time this cgroup may use, in cores (``--cpus``), or None when unlimited."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        pair = (_number(quota), _number(period))
    else:
        pair = (_number(_read(root / "cpu" / "cpu.cfs_quota_us")), _number(_read(root / "cpu" / "cpu.cfs_period_us")))
    quota_us, period_us = pair
    if quota_us is None or not period_us:
        return None
    return quota_us / period_us


def available_cores(root: Path = CGROUP_ROOT) -> int:
    """The cores this process may run on: its CPU affinity, capped by the cgroup's CPU quota (rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux / other
    quota = cgroup_cpu_quota(root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def limit_threads_to_cpu_quota(root: Path = CGROUP_ROOT) -> int:
    """Lower torch's intra-op threads to the cgroup's CPU quota (rounded up), unless the user chose
    a count with ``OMP_NUM_THREADS``. Returns the thread count in force."""
    quota = cgroup_cpu_quota(root)
    threads = torch.get_num_threads()
    if quota is not None and "OMP_NUM_THREADS" not in os.environ and math.ceil(quota) < threads:
        logger.info("CPU quota of the cgroup: %.2f cores, so %d torch threads instead of %d",
                    quota, math.ceil(quota), threads)
        threads = max(1, math.ceil(quota))
        torch.set_num_threads(threads)
    return threads
