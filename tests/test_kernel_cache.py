"""The CPU decode kernel never stops the engine: an unwritable cache, no compiler or no source mean a
temporary folder or the torch path, with one log line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.engine.model import c_kernels, cpu_attention
from pagedserve.engine.model.cpu_attention import load_kernel, paged_decode_attention


@pytest.fixture(autouse=True)
def fresh_kernel() -> Iterator[None]:
    """Each test finds its own kernel; later tests find theirs again."""
    load_kernel.cache_clear()
    yield
    load_kernel.cache_clear()


@pytest.fixture
def unwritable_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder under a regular file: nothing can be created there, even by root
    (as with a read-only container filesystem or another user's cache)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(blocker / "cache"))
    return blocker


def decode_inputs() -> tuple[torch.Tensor, ...]:
    query = torch.randn(1, 2, 64)
    kv_cache = torch.randn(2, 2, 16, 1, 64)
    return query, kv_cache, torch.tensor([[1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)


def test_unwritable_cache_builds_in_a_temporary_folder(unwritable_cache: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=c_kernels.__name__):
        lib = load_kernel()
    assert lib is not None
    assert not Path(lib._name).is_relative_to(unwritable_cache)
    # Its own records: a test server still running logs its stats to the same root handler.
    assert [r.levelno for r in caplog.records if r.name == c_kernels.__name__] == [logging.INFO]
    assert "not writable" in caplog.text
    assert paged_decode_attention(*decode_inputs(), 0.125) is not None


def test_no_compiler_falls_back_to_torch_with_one_warning(unwritable_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(unwritable_cache.parent))
    with caplog.at_level(logging.WARNING, logger=c_kernels.__name__):
        assert load_kernel() is None
        assert paged_decode_attention(*decode_inputs(), 0.125) is None
    ours = [r for r in caplog.records if r.name == c_kernels.__name__]
    assert len(ours) == 1 and "no C compiler" in ours[0].getMessage()


def test_missing_source_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_attention, "_SOURCE", tmp_path / "missing.c")
    with caplog.at_level(logging.WARNING, logger=c_kernels.__name__):
        assert load_kernel() is None
    assert "source is missing" in caplog.text


def test_backend_decodes_through_torch_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine sees when the kernel cannot be had: the same numbers from the torch path."""
    from pagedserve.engine.model.attention import get_attention_backend
    from tests.test_attention import NUM_KV_HEADS, make_step

    query, key, value, kv_cache, metadata, _ = make_step([1, 1], [5, 40], NUM_KV_HEADS * 3, 16)
    backend = get_attention_backend("cpu", 16)
    metadata = backend.build_metadata(metadata)
    with_kernel = backend.forward(query, key, value, kv_cache.clone(), metadata, 0.1)
    monkeypatch.setattr(cpu_attention, "load_kernel", lambda: None)
    without_kernel = backend.forward(query, key, value, kv_cache.clone(), metadata, 0.1)
    torch.testing.assert_close(without_kernel, with_kernel, rtol=1e-5, atol=1e-5)


def test_loading_the_kernel_keeps_subnormal_floats(tmp_path: Path) -> None:
    """Regression: linked with -ffast-math, the library pulled in crtfastmath.o, which set flush-to-zero
    for the whole process as it loaded: every torch op and Python float after it lost subnormals."""
    code = ("from pagedserve.engine.model.cpu_attention import load_kernel\n"
            "assert load_kernel() is not None\n"
            "print(float.fromhex('0x1p-1070') * 1.0 != 0.0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parent.parent, env=os.environ | {"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert result.stdout.strip() == "True"


def test_a_change_in_an_included_file_builds_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused decode includes the per-op kernels' files: editing one of them must not load a stale build."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "value.c").write_text("static int value(void) { return 1; }\n")
    (tmp_path / "main.c").write_text('#include "value.c"\nint answer(void) { return value(); }\n')
    assert c_kernels.load_c_library(tmp_path / "main.c", "a test").answer() == 1
    (tmp_path / "value.c").write_text("static int value(void) { return 2; }\n")
    assert c_kernels.load_c_library(tmp_path / "main.c", "a test").answer() == 2
