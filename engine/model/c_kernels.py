"""Build, cache and load the engine's C kernels (``csrc/*.c``): plain C with OpenMP, no torch headers.

A kernel compiles in about a second with the system compiler the first time it
is needed and is cached under ``$PAGEDSERVE_CACHE_DIR/kernels``, keyed by its
source (with the files it includes), the flags and the CPU's feature flags (``-march=native`` makes the code
CPU-specific). Its OpenMP runtime is torch's own: the dynamic loader resolves
``libgomp.so.1`` to the copy torch already loaded, so both share one thread
pool. A kernel problem never stops the engine: no compiler, a failed build or
load, or a missing source mean ``None`` and one warning, and the caller falls
back to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pagedserve.engine import envs

logger = logging.getLogger(__name__)

COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked without -ffast-math: with it the link adds crtfastmath.o, whose constructor sets flush-to-zero
# for the whole process when the library loads, so every torch op and Python float after it would lose
# subnormals. -lm last: it brings libmvec, which holds the vectorized expf.
LINK_FLAGS = ("-fopenmp", "-shared", "-lm")
_LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: -march=native makes it CPU-specific."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def load_c_library(source: Path, purpose: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library of ``source``, building it on first use; None when it cannot be had.

    Callers cache the result (``functools.cache``) and set the entry points' ``argtypes``.
    When the cache folder cannot be written (a read-only container, another
    user's cache) the library is built in a private temporary folder for this
    process instead. Each failure logs one warning.

    Args:
        source: the C file.
        purpose: what falls back to torch without it, for the log ("CPU decode attention").
        extra_flags: compile flags after the defaults (a later ``-march`` wins; ``-D`` switches).
    """
    fallback = f"{purpose} falls back to torch (slower)"
    try:
        text = _source_text(source)
    except OSError as err:
        logger.warning("the %s kernel's source is missing (%s): %s", purpose, err, fallback)
        return None
    compile_flags = [*COMPILE_FLAGS, *extra_flags]
    flags = " ".join(compile_flags + list(LINK_FLAGS))
    key = hashlib.sha256(text + flags.encode() + _cpu_signature().encode()).hexdigest()[:16]
    library = Path(envs.PAGEDSERVE_CACHE_DIR) / "kernels" / f"{source.stem}-{key}.so"
    if not library.exists():
        try:
            folder = _writable_folder(library.parent, purpose)
        except OSError as err:
            logger.warning("no writable folder for the %s kernel (%s): %s", purpose, err, fallback)
            return None
        library = _build(source, compile_flags, folder / library.name, fallback)
        if library is None:
            return None
    try:
        return ctypes.CDLL(str(library))
    except OSError as err:
        logger.warning("loading %s failed (%s): %s", library, err, fallback)
        return None


def _source_text(source: Path) -> bytes:
    """``source`` with the text of every local file it includes (``#include "x.c"``, recursively) appended, so
    that the cache key changes when any of them does.

    Raises:
        OSError: a file cannot be read.
    """
    text, seen, pending = b"", set(), [source]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        body = path.read_bytes()
        text += body
        pending += [path.parent / name.decode() for name in _LOCAL_INCLUDE.findall(body)]
    return text


def _writable_folder(folder: Path, purpose: str) -> Path:
    """``folder`` when it can be written, else a new private temporary folder.

    Raises:
        OSError: when no temporary folder can be made either.
    """
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    if os.access(folder, os.W_OK | os.X_OK):
        return folder
    temporary = Path(tempfile.mkdtemp(prefix="pagedserve-kernels-"))
    logger.info("the kernel cache %s is not writable: building the %s kernel in %s", folder, purpose, temporary)
    return temporary


def _build(source: Path, compile_flags: list[str], library: Path, fallback: str) -> Path | None:
    """Compile ``source`` into ``library`` (atomically: a temporary file, then a rename).

    Returns:
        ``library``, or None (with a warning) when there is no compiler or the build fails.
    """
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: %s", fallback)
        return None
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built, objects = Path(tmp) / library.name, Path(tmp) / "kernel.o"
        for command in ([compiler, *compile_flags, "-c", "-o", str(objects), str(source)],
                        [compiler, str(objects), *LINK_FLAGS, "-o", str(built)]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building %s failed, %s:\n%s", source, fallback, result.stderr[-2000:])
                return None
        os.replace(built, library)
    return library
