"""A non-editable install carries everything the runtime needs: build the wheel, install it outside the
source tree, and serve from it with ``python -P`` in another folder (so that nothing is imported from
the checkout)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from pagedserve.engine import envs
from tests.conftest import cli_server

pytestmark = pytest.mark.infra

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, installed (without its dependencies, which the venv has) into a folder."""
    dist, target = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist,
                    ROOT], check=True, timeout=300, cwd=dist)
    wheel = next(dist.glob("pagedserve-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    # One import namespace: nothing beside pagedserve that another distribution's package could collide with.
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"pagedserve"}
    # Every package folder of the checkout is listed in pyproject.toml (setuptools takes only those listed).
    packages = {init.parent for folder in ("engine", "server") for init in (ROOT / folder).rglob("__init__.py")}
    assert {f"pagedserve/{p.relative_to(ROOT).as_posix()}/__init__.py" for p in packages} <= names
    sources = {f"pagedserve/engine/model/csrc/{p.name}" for p in (ROOT / "engine" / "model" / "csrc").glob("*.c")}
    assert len(sources) == 5 and sources <= names  # every C kernel ships
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", target,
                    wheel], check=True, timeout=300)
    return target


def test_the_installed_wheel_serves_a_completion(installed: Path, tmp_path: Path) -> None:
    # A fresh cache, so that the kernel is compiled from the installed source; the GGUF conversion is reused.
    cache = tmp_path / "cache"
    cache.mkdir()
    gguf = Path(envs.PAGEDSERVE_CACHE_DIR) / "gguf"
    if gguf.is_dir():
        (cache / "gguf").symlink_to(gguf)
    env = {"PYTHONPATH": str(installed), "PAGEDSERVE_CACHE_DIR": str(cache)}
    python = (sys.executable, "-P")
    code = "import pagedserve.engine, pagedserve.server; print(pagedserve.engine.__file__, pagedserve.server.__file__)"
    where = subprocess.run([*python, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert all(Path(p).is_relative_to(installed) for p in where.stdout.split())
    with cli_server(tmp_path, "--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB", python=python,
                    cwd=tmp_path, env=env) as (url, _):
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        # The package data and the grammar engine come with the install too.
        page = httpx.get(f"{url}/dashboard/static/dashboard.js", timeout=60)
        choice = httpx.post(f"{url}/v1/completions", json={**body, "guided_choice": ["Paris", "Rome"]}, timeout=120)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert page.status_code == 200 and "window.dashboard" in page.text
    assert choice.status_code == 200 and choice.json()["choices"][0]["text"] in {"Paris", "Rome"}
    # Decodes ran in a C kernel built from the installed sources: the fused one (all layers in one call), which
    # includes the paged attention kernel's source.
    assert list((cache / "kernels").glob("fused_decode-*.so"))
    assert "Traceback" not in (tmp_path / "server.log").read_text()
