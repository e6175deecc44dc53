"""Memory and CPU limits read from cgroup files (v1 and v2), on fake cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagedserve.engine.worker.host_resources import (
    available_cores,
    available_memory_bytes,
    cgroup_cpu_quota,
    cgroup_memory_limit,
    limit_threads_to_cpu_quota,
)

GiB = 2**30


def cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       25000000 kB\nMemFree:        1000 kB\nMemAvailable:   {available_kib} kB\n")
    return path


def test_cgroup_v2_limits(tmp_path: Path) -> None:
    root = cgroup(tmp_path / "v2", {"memory.max": str(2 * GiB), "memory.current": str(GiB // 2),
                                    "cpu.max": "150000 100000"})
    assert cgroup_memory_limit(root) == (2 * GiB, GiB // 2)
    assert cgroup_cpu_quota(root) == 1.5
    assert available_memory_bytes(root, meminfo(tmp_path, 20 * 2**20)) == GiB + GiB // 2


def test_cgroup_v1_limits(tmp_path: Path) -> None:
    root = cgroup(tmp_path / "v1", {"memory/memory.limit_in_bytes": str(GiB),
                                    "memory/memory.usage_in_bytes": str(GiB // 4),
                                    "cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_memory_limit(root) == (GiB, GiB // 4)
    assert cgroup_cpu_quota(root) == 2.0


def test_no_limits_means_the_host(tmp_path: Path) -> None:
    v2 = cgroup(tmp_path / "v2", {"memory.max": "max", "cpu.max": "max 100000"})
    v1 = cgroup(tmp_path / "v1", {"memory/memory.limit_in_bytes": "9223372036854771712",
                                  "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    for root in (v2, v1, tmp_path / "none"):
        assert cgroup_memory_limit(root) is None and cgroup_cpu_quota(root) is None
        assert available_memory_bytes(root, meminfo(tmp_path, 3 * 2**20)) == 3 * GiB
    assert available_memory_bytes(tmp_path / "none", tmp_path / "no-meminfo") is None


def test_available_cores_are_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path / "none") == affinity
    assert available_cores(cgroup(tmp_path / "v2", {"cpu.max": "50000 100000"})) == 1  # half a core: one
    assert available_cores(cgroup(tmp_path / "big", {"cpu.max": f"{(affinity + 8) * 100000} 100000"})) == affinity


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_threads_follow_the_cpu_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_threads) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    assert limit_threads_to_cpu_quota(cgroup(tmp_path, {"cpu.max": "150000 100000"})) == 2
    assert torch.get_num_threads() == 2
    assert limit_threads_to_cpu_quota(tmp_path / "none") == 2  # no quota: unchanged


def test_omp_num_threads_wins_over_the_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             restore_threads) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    torch.set_num_threads(4)
    assert limit_threads_to_cpu_quota(cgroup(tmp_path, {"cpu.max": "100000 100000"})) == 4
