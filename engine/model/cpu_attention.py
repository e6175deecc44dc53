"""The CPU attention backend: the torch backend's plan of the step, C kernels for decodes and prefill chunks.

Paged attention is where torch has no good primitive: SDPA needs the keys
contiguous, so the torch backend copies every request's blocks into a
workspace first. For decodes, a step at batch 64 spends about half its
attention time on that copy. For a prefill chunk after earlier context it is
worse: the causal mask is an explicit boolean tensor, which sends SDPA to its
unfused math path (the whole ``[heads, chunk, context]`` score matrix, in bf16
more slowly than in fp32; 82% of an 8k-token prompt's time in fp32). Two C
kernels read the blocks in place:
``csrc/paged_decode_attention.c`` for one-token queries and
``csrc/paged_prefill_attention.c`` (FlashAttention-2 style, tiled with an
online softmax) for prefill chunks. They are plain C with OpenMP (no torch
headers), so each compiles in about a second with the system compiler the
first time it is needed and is cached under ``$PAGEDSERVE_CACHE_DIR/kernels``
(``c_kernels``). Their OpenMP runtime is torch's own, so all share one thread pool.

The cache may be float32 or bfloat16 (half the bytes to read, widened to
float32 in registers, or multiplied on AMX tiles by the prefill kernel where the
CPU has them). Decode queries and outputs cross the boundary in float32, prefill
ones in the cache's dtype. When no compiler is available, or the cache is
float16, the backend falls back to the torch path (and says so once in the log).
On the 2-core test machine an 8,000-token prompt (``max_tokens`` 1, SmolLM2-135M)
takes 19.5 s in fp32 and 7.2-9.0 s in bf16 with the kernel, against 42.0 s and
55.9 s on the torch path (``benchmarks/long_prefill.py``).
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from pagedserve.engine.model.attention import AttentionBackend, AttentionMetadata, register_backend
from pagedserve.engine.model.c_kernels import load_c_library
from pagedserve.engine.model.cpu_threads import all_threads
from pagedserve.engine.model.torch_attention import PrefillBatch, TorchAttentionBackend, TorchAttentionMetadata
from pagedserve.engine.profiling import region

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.c"
#: The kernel's entry point for each KV cache dtype it reads.
_ENTRY_POINTS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}
_PREFILL_SOURCE = Path(__file__).parent / "csrc" / "paged_prefill_attention.c"
_PREFILL_ENTRY_POINTS = {torch.float32: "paged_prefill_attention_f32",
                         torch.bfloat16: "paged_prefill_attention_bf16"}


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library (``c_kernels.load_c_library``: built on first use, cached under
    ``$PAGEDSERVE_CACHE_DIR/kernels``); None when it cannot be had, and decodes use the torch path."""
    lib = load_c_library(_SOURCE, "CPU decode attention")
    if lib is None:
        return None
    for entry in _ENTRY_POINTS.values():
        function = getattr(lib, entry)
        function.restype = ctypes.c_int
        function.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int64]
                             + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64])
    return lib


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           sliding_window: int | None = None) -> torch.Tensor | None:
    """Attention of one query token per request over its paged keys and values.

    Args:
        query: ``[num_reqs, num_heads, head_dim]`` on the CPU, any float dtype.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bfloat16, contiguous.
        block_table: ``[num_reqs, max_blocks]`` int32, contiguous.
        seq_lens: ``[num_reqs]`` int32, each request's keys, its query's included (>= 1).
        scale: softmax scale.
        new_kv: the step's ``(key, value, slot_mapping)`` to write into the cache first: ``[num_reqs,
            num_kv_heads, head_dim]`` each in the cache's dtype, heads contiguous (rows may be further apart,
            as in a view of the QKV output), and ``[num_reqs]`` int64 slots. None: already in the cache.
        sliding_window: each query attends to its request's last ``sliding_window`` keys; None: all of them.

    Returns:
        ``[num_reqs, num_heads, head_dim]`` in the query's dtype, or None when the
        kernel is unavailable or does not support this dtype or these shapes
        (the caller falls back; nothing was written then).
    """
    lib = load_kernel()
    entry = _ENTRY_POINTS.get(kv_cache.dtype)
    # A non-contiguous cache would be read through a copy, and writes into that copy lost.
    if lib is None or entry is None or (new_kv is not None and not kv_cache.is_contiguous()):
        return None
    query_f32, kv_cache = query.float().contiguous(), kv_cache.contiguous()
    num_reqs, num_heads, _ = query.shape
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    out = torch.empty_like(query_f32)
    cache = kv_cache.data_ptr()
    values_offset = num_blocks * block_size * num_kv_heads * head_dim * kv_cache.element_size()
    new_keys = new_values = slots = None
    keys_stride = values_stride = 0
    if new_kv is not None:
        key, value, slot_mapping = new_kv
        key, value = (_heads_contiguous(t, kv_cache.dtype) for t in (key, value))
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
        new_keys, new_values, slots = key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr()
        keys_stride, values_stride = key.stride(0), value.stride(0)
    status = getattr(lib, entry)(
        query_f32.data_ptr(), new_keys, new_values, keys_stride, values_stride, slots, cache, cache + values_offset,
        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads,
        num_kv_heads, head_dim, block_size, scale, sliding_window or 0)
    if status != 0:
        _warn_unsupported(num_heads // num_kv_heads, head_dim, block_size)
        return None
    return out.to(query.dtype)


def _heads_contiguous(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` ``[N, heads, head_dim]`` in ``dtype`` with each row's heads contiguous, as the kernels read them
    (rows may lie further apart, as in a view of the QKV output): itself where it already is, else a copy."""
    rows = rows.to(dtype)
    return rows if rows.stride(2) == 1 and rows.stride(1) == rows.shape[2] else rows.contiguous()


@cache
def _warn_unsupported(group: int, head_dim: int, block_size: int) -> None:
    logger.warning("the CPU decode kernel supports up to 16 query heads per KV head, 128 query heads, "
                   "head_dim <= 256, query heads x head_dim <= 8192 and block_size <= 128 (got %d per KV head, "
                   "head_dim %d, block_size %d): decodes use the slower torch path", group, head_dim, block_size)


@cache
def load_prefill_kernel(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled prefill kernel library (``c_kernels.load_c_library``); None when it cannot be had, and
    prefill chunks use the torch path.

    Args:
        extra_flags: compile flags after the defaults, for tests (``("-march=haswell",)``: an AVX2-only build).
    """
    lib = load_c_library(_PREFILL_SOURCE, "CPU prefill attention", extra_flags)
    if lib is None:
        return None
    for entry in _PREFILL_ENTRY_POINTS.values():
        function = getattr(lib, entry)
        function.restype = ctypes.c_int
        function.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                             + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64])
    lib.paged_prefill_attention_amx.restype = ctypes.c_int
    lib.paged_prefill_attention_amx.argtypes = [ctypes.c_int]
    return lib


def prefill_kernel_amx(enable: bool | None = None) -> bool:
    """Whether the prefill kernel runs bfloat16 caches on AMX tiles (Sapphire Rapids and later, compiled
    in by ``-march=native``, permitted by Linux); ``enable`` switches it off or back on (tests, benchmarks).

    Without AMX, or with head_dim not a multiple of 64, bf16 caches are widened to fp32 in AVX registers.
    """
    lib = load_prefill_kernel()
    return lib is not None and bool(lib.paged_prefill_attention_amx(-1 if enable is None else int(enable)))


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, prefills: PrefillBatch, scale: float,
                            extra_flags: tuple[str, ...] = (), sliding_window: int | None = None
                            ) -> torch.Tensor | None:
    """Causal attention of every prefill chunk of a step over its paged keys and values.

    The chunks' keys and values must already be in the cache. Query ``i`` of a
    chunk of ``n`` tokens sits at position ``seq_len - n + i`` and sees the
    request's keys ``0..seq_len - n + i`` (the last ``sliding_window`` of them when one is given).

    Args:
        query: ``[T, num_heads, head_dim]`` on the CPU, any float dtype: the step's flattened batch. In the
            cache's dtype, a view with contiguous heads (the model's split of its QKV output) is read in place.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bfloat16, contiguous.
        prefills: where the chunks' rows are, their lengths and block table rows (int32).
        scale: softmax scale.
        extra_flags: of the build to run (``load_prefill_kernel``).
        sliding_window: keys each query sees, its own included; None: all before it.

    Returns:
        ``[T, num_heads, head_dim]`` in the query's dtype, zeros outside the
        chunks' rows, or None when the kernel is unavailable or does not support
        this dtype or these shapes (the caller falls back).
    """
    lib = load_prefill_kernel(extra_flags)
    entry = _PREFILL_ENTRY_POINTS.get(kv_cache.dtype)
    if lib is None or entry is None:
        return None
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    rows = _heads_contiguous(query, kv_cache.dtype)
    kv_cache = kv_cache.contiguous()
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    block_table = prefills.block_table
    status = getattr(lib, entry)(
        rows.data_ptr(), rows.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_table.data_ptr(),
        block_table.stride(0), prefills.row_starts.data_ptr(), prefills.query_lens.data_ptr(),
        prefills.seq_lens.data_ptr(), out.data_ptr(), num_tokens, len(prefills.row_starts), num_heads, num_kv_heads,
        head_dim, block_size, scale, sliding_window or 0)
    if status != 0:
        _warn_prefill_unsupported(num_heads // num_kv_heads, head_dim)
        return None
    return out.to(query.dtype)


@cache
def _warn_prefill_unsupported(group: int, head_dim: int) -> None:
    logger.warning("the CPU prefill kernel supports up to 224 query heads per KV head and head_dim a multiple "
                   "of 8 up to 256 (got %d per KV head, head_dim %d): prefill chunks use the slower torch path",
                   group, head_dim)


@register_backend("cpu")
class CpuAttentionBackend(AttentionBackend):
    """Paged attention on the CPU: a ``TorchAttentionBackend`` for the step's plan and the cache write (in a
    decode-only step the decode kernel writes the step's keys and values itself); decodes and prefill chunks
    in the C kernels when they are available, else on the torch path.

    Scores soft-capped (``logit_softcap``, Gemma 2) run the torch backend's math path: the kernels do not cap.

    Args:
        block_size: tokens per block of the KV caches ``forward`` will be given.
        logit_softcap: see ``AttentionBackend``.
    """

    supported_devices = ("cpu",)

    def __init__(self, block_size: int, logit_softcap: float | None = None) -> None:
        super().__init__(block_size, logit_softcap)
        self._torch = TorchAttentionBackend(block_size, logit_softcap)
        if logit_softcap is not None:
            logger.info("attention scores are soft-capped: the CPU attention kernels do not cap, the torch path "
                        "runs attention")

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
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """See ``TorchAttentionBackend.forward``."""
        if self.logit_softcap is not None:
            return self._torch.forward(query, key, value, kv_cache, metadata, scale, sliding_window)
        # Attention repays an OpenMP barrier: every thread, even in a serial CPU step (cpu_threads).
        with region("attention"), all_threads():
            if metadata.decode_only(query) and kv_cache.shape[2] == self.block_size:
                # A decode-only step (every single-user step): the kernel writes the step's keys and values
                # itself, a few tensor ops fewer per layer than the torch backend's plan.
                decodes = metadata.decodes
                out = paged_decode_attention(query, kv_cache, decodes.block_table, decodes.seq_lens, scale,
                                             (key, value, metadata.slot_mapping), sliding_window)
                if out is not None:
                    return out
            return self._torch.run(query, key, value, kv_cache, metadata, scale, sliding_window, self._decode,
                                   self._prefill)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata,
                scale: float, sliding_window: int | None) -> torch.Tensor:
        """A ``DecodeFn``: the C kernel, or the torch path when the kernel is unavailable or refuses the shapes."""
        decodes = metadata.decodes
        out = paged_decode_attention(query, kv_cache, decodes.block_table, decodes.seq_lens, scale,
                                     sliding_window=sliding_window)
        return out if out is not None else self._torch.decode(query, kv_cache, metadata, scale, sliding_window)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: TorchAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        """A ``PrefillFn``: the C kernel, or the torch path when the kernel is unavailable or refuses the shapes."""
        out = paged_prefill_attention(query, kv_cache, metadata.prefill_batch, scale, sliding_window=sliding_window)
        if out is None:
            out = self._torch.prefill(query, key, value, kv_cache, metadata, scale, sliding_window)
        return out
