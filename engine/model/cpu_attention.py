"""The CPU attention backend: the torch backend's path for prefill chunks, a C kernel for decodes.

Decode attention is the one place where torch has no good primitive for a
paged cache: SDPA needs the keys contiguous, so the torch backend copies every
decode request's blocks into a workspace first, and a step at batch 64 spends
about half its attention time on that copy. ``csrc/paged_decode_attention.c``
reads the blocks in place. It is plain C with OpenMP (no torch headers), so it
compiles in about a second with the system compiler the first time it is
needed and is cached under ``$PAGEDSERVE_CACHE_DIR/kernels``. Its OpenMP
runtime is torch's own: the dynamic loader resolves ``libgomp.so.1`` to the
copy torch already loaded, so both share one thread pool.

The cache may be float32 or bfloat16 (half the bytes to read, widened to
float32 in registers); queries and outputs cross the boundary in float32. When
no compiler is available, or the cache is float16, the backend falls back to
the torch path (and says so once in the log).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from engine.config import cache_dir
from engine.model.attention import AttentionBackend, AttentionMetadata, register_backend
from engine.model.cpu_threads import all_threads
from engine.model.torch_attention import TorchAttentionBackend, TorchAttentionMetadata
from engine.profiling import region

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.c"
#: The kernel's entry point for each KV cache dtype it reads.
_ENTRY_POINTS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: with it the link adds crtfastmath.o, whose constructor sets flush-to-zero
# for the whole process when the library loads, so every torch op and Python float after it would lose
# subnormals. -lm last: it brings libmvec, which holds the vectorized expf.
_LINK_FLAGS = ["-fopenmp", "-shared", "-lm"]


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: -march=native makes it CPU-specific."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None when it cannot be had.

    The library is cached under ``$PAGEDSERVE_CACHE_DIR/kernels``, keyed by the
    source, the flags and the CPU's feature flags (``-march=native`` makes it
    CPU-specific). When that folder cannot be written (a read-only container,
    another user's cache) the kernel is built in a private temporary folder for
    this process instead; when there is no compiler, the build fails or the
    library does not load, decodes use the torch path. Each case logs one
    warning: a kernel problem never stops the engine.
    """
    try:
        source = _SOURCE.read_bytes()
    except OSError as err:
        logger.warning("the CPU decode kernel's source is missing (%s): CPU decode attention falls back to torch "
                       "(slower)", err)
        return None
    flags = " ".join(_COMPILE_FLAGS + _LINK_FLAGS)
    key = hashlib.sha256(source + flags.encode() + _cpu_signature().encode()).hexdigest()[:16]
    library = Path(cache_dir()) / "kernels" / f"paged_decode_attention-{key}.so"
    if not library.exists():
        try:
            folder = _writable_folder(library.parent)
        except OSError as err:
            logger.warning("no writable folder for the CPU decode kernel (%s): CPU decode attention falls back "
                           "to torch (slower)", err)
            return None
        library = _build(folder / library.name)
        if library is None:
            return None
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as err:
        logger.warning("loading %s failed (%s): CPU decode attention falls back to torch (slower)", library, err)
        return None
    for entry in _ENTRY_POINTS.values():
        function = getattr(lib, entry)
        function.restype = ctypes.c_int
        function.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
                             + [ctypes.c_int64] * 5 + [ctypes.c_float])
    return lib


def _writable_folder(folder: Path) -> Path:
    """``folder`` when it can be written, else a new private temporary folder (a read-only
    container, another user's cache).

    Raises:
        OSError: when no temporary folder can be made either.
    """
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    if os.access(folder, os.W_OK | os.X_OK):
        return folder
    temporary = Path(tempfile.mkdtemp(prefix="pagedserve-kernels-"))
    logger.info("the kernel cache %s is not writable: building the CPU decode kernel in %s", folder, temporary)
    return temporary


def _build(library: Path) -> Path | None:
    """Compile the kernel into ``library`` (atomically: a temporary file, then a rename).

    Returns:
        ``library``, or None (with a warning) when there is no compiler or the build fails.
    """
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention falls back to torch (slower)")
        return None
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built, objects = Path(tmp) / library.name, Path(tmp) / "kernel.o"
        for command in ([compiler, *_COMPILE_FLAGS, "-c", "-o", str(objects), str(_SOURCE)],
                        [compiler, str(objects), *_LINK_FLAGS, "-o", str(built)]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building %s failed, CPU decode attention falls back to torch (slower):\n%s",
                               _SOURCE, result.stderr[-2000:])
                return None
        os.replace(built, library)
    return library


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of one query token per request over its paged keys and values.

    Args:
        query: ``[num_reqs, num_heads, head_dim]`` on the CPU, any float dtype.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bfloat16, contiguous.
        block_table: ``[num_reqs, max_blocks]`` int32, contiguous.
        seq_lens: ``[num_reqs]`` int32, keys each query attends to (>= 1).
        scale: softmax scale.

    Returns:
        ``[num_reqs, num_heads, head_dim]`` in the query's dtype, or None when the
        kernel is unavailable or does not support this dtype or these shapes
        (the caller falls back).
    """
    lib = load_kernel()
    entry = _ENTRY_POINTS.get(kv_cache.dtype)
    if lib is None or entry is None:
        return None
    query_f32, kv_cache = query.float().contiguous(), kv_cache.contiguous()
    num_reqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query_f32)
    status = getattr(lib, entry)(
        query_f32.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_table.data_ptr(),
        block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads, num_kv_heads, head_dim,
        block_size, scale)
    if status != 0:
        _warn_unsupported(num_heads // num_kv_heads, head_dim, block_size)
        return None
    return out.to(query.dtype)


@cache
def _warn_unsupported(group: int, head_dim: int, block_size: int) -> None:
    logger.warning("the CPU decode kernel supports up to 16 query heads per KV head, 128 query heads, "
                   "head_dim <= 256, query heads x head_dim <= 8192 and block_size <= 128 (got %d per KV head, "
                   "head_dim %d, block_size %d): decodes use the slower torch path", group, head_dim, block_size)


@register_backend("cpu")
class CpuAttentionBackend(AttentionBackend):
    """Paged attention on the CPU: a ``TorchAttentionBackend`` for the step's plan, the cache write and
    prefill chunks; decodes in the C kernel when it is available, else on the torch path.

    Args:
        block_size: tokens per block of the KV caches ``forward`` will be given.
    """

    supported_devices = ("cpu",)

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._torch = TorchAttentionBackend(block_size)

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        """See ``TorchAttentionBackend.build_metadata``."""
        return self._torch.build_metadata(common)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """See ``TorchAttentionBackend.forward``."""
        # Attention repays an OpenMP barrier: every thread, even in a serial CPU step (cpu_threads).
        with region("attention"), all_threads():
            return self._torch.run(query, key, value, kv_cache, metadata, scale, self._decode)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata,
                scale: float) -> torch.Tensor:
        """A ``DecodeFn``: the C kernel, or the torch path when the kernel is unavailable or refuses the shapes."""
        decodes = metadata.decodes
        out = paged_decode_attention(query, kv_cache, decodes.block_table, decodes.seq_lens, scale)
        return out if out is not None else self._torch.decode(query, kv_cache, metadata, scale)
