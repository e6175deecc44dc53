"""Linear layers on group-quantized weights (GGUF Q4_1/Q4_0 and Q8_0): storage, a CPU C kernel, a torch path.

A weight ``[out_features, in_features]`` is stored in blocks of ``GROUP_SIZE``
(32) consecutive input features, each with its own scale (and for ``"q4"`` its
own offset), as GGUF's ``block_q4_1``/``block_q8_0`` (ggml/src/ggml-common.h):
0.625 and 1.0625 bytes a weight against bf16's 2. A decode step is a
matrix-vector product per layer, so reading fewer bytes is the whole point,
and the kernel must not turn compute-bound unpacking them.

``csrc/quant_gemv.c`` does it the llama.cpp way: each 32-block of the
activations is rounded to int8 with its own scale (GGUF's Q8_0/Q8_1), so a
block's dot product is an integer dot product of bytes, 64 multiply-adds per
AVX-512 VNNI ``vpdpbusd`` (AVX2: ``vpmaddubsw``), scaled once per block; rows
of the weight are interleaved 16 at a time so 16 rows' block sums land in one
register (see the C file). Unpacking to fp32 and using FMAs instead costs
about 5 times the instructions per weight (a convert and a shift per 4
weights, 16 FMAs per 256); torch's ``_weight_int4pack_mm_for_cpu`` works that
way and is the measured stand-in below. Up to 8 activation rows share one
pass over the weight. The rounding error this adds is that of ``x`` moved by
up to ``max|x_block| / 254``: on random data 0.53% of the output's RMS,
against 0.16% for rounding x to bf16 and 0.28% for a bf16 ``F.linear``, and
under a tenth of what rounding the weights to 4 bits does (7.9%).

Measured on the 2-core test machine (Xeon with AVX-512 VNNI/bf16, torch 2.13;
``python -m benchmarks.quant_gemv --threads 1``), best of repeated calls,
microseconds, bf16 activations, one thread: the second core was saturated by
other jobs, which made 2-thread times meaningless (a barrier waited out whole
scheduler slices); repeated runs vary by about 30%::

    [in, out]     rows  q4 kernel  q8 kernel  oneDNN bf16  oneDNN fp32  torch int4pack  torch int8pack
    [576, 576]      1       8.5        7.6        25.0         54.6          26.0            22.6
    [576, 192]      1       7.2        7.1        20.9         21.9           9.7             9.1
    [576, 1536]     1      15.4       12.9        58.2        158.9          56.7            53.7
    [1536, 576]     1      15.0       13.4        52.7        168.2          57.0            52.0
    [576, 49152]    1     911       1252       11039        25145          2278           10451
    [576, 1536]     4      28.9       25.3        60.8        162.4         105.7           108.8
    [576, 1536]    16      93.4       87.2        68.1        279.2         413.9           440.5

So torch's quantized kernels do not pay (and fall behind bf16 from a few rows
on); ours is 3-4x faster than the packed bf16 GEMM at one row (the LM head
12x, but its 57 MB bf16 weight streamed at the 4-5 GB/s copy bandwidth the
loaded machine had then; unloaded, with 2 threads, it took 1.7 ms), 2x at 4
rows, and from about 16 rows oneDNN's bf16 GEMM (on a bf16 weight we do not
have) is faster.
Above ``KERNEL_MAX_ROWS`` rows (prefill) the weight is dequantized (in C) and
multiplied by ``F.linear``: for [576, 1536] the kernel took 703 us at 64 rows
against 882 for dequantize + ``F.linear``, and 1381 against 1102 at 128; the
crossover is about 96 rows.

Other devices, other dtypes, or no compiler: dequantize + ``F.linear`` in torch
(CUDA keeps working).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.engine.model.c_kernels import load_c_library

GROUP_SIZE = 32  # weights per quantization block along the input dimension (GGUF's QK4_0/QK4_1/QK8_0)
#: Rows of a weight interleaved in its layout (the int32 lanes of a 512-bit register).
TILE_ROWS = 16
#: Rows of x up to which ``quantized_linear`` runs the C kernel; above, dequantize + ``F.linear`` (the
#: crossover is about 96 rows, see the module docstring).
KERNEL_MAX_ROWS = 64


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight stored in blocks of ``GROUP_SIZE`` along ``in_features``.

    Attributes:
        kind: ``"q4"``: ``w = scale * q + min``, q in 0..15 (GGUF Q4_1; Q4_0 is ``min = -8 * scale``);
            ``"q8"``: ``w = scale * q``, q in -128..127 (GGUF Q8_0; per-channel int8 is the same scale in every
            block).
        out_features, in_features: the weight's shape; ``in_features`` is a multiple of ``GROUP_SIZE``.
        data: uint8 ``[tiles, blocks, 256 | 512]``, the kernel's layout: rows in tiles of ``TILE_ROWS``
            (``tiles = ceil(out_features / TILE_ROWS)``, the last padded with zero rows), ``blocks = in_features //
            GROUP_SIZE``; per tile and block, ``"q4"`` two weights a byte, ``"q8"`` one (``q + 128``); see
            ``csrc/quant_gemv.c``.
        scales: float16 ``[tiles, blocks, TILE_ROWS]``, as GGUF stores them (a float32 scale is rounded to
            float16 by ``pack_q4``/``pack_q8``, as llama.cpp's quantizer does).
        mins: float16, same shape, for ``"q4"``; None for ``"q8"``.
    """

    kind: str
    out_features: int
    in_features: int
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on ``device``."""
        return QuantizedWeight(self.kind, self.out_features, self.in_features, self.data.to(device),
                               self.scales.to(device), None if self.mins is None else self.mins.to(device))

    def __post_init__(self) -> None:
        """Raises ValueError unless the tensors have the layout the kernel reads (it trusts their sizes)."""
        if self.kind not in _KIND_CODES:
            raise ValueError(f"QuantizedWeight: kind must be one of {list(_KIND_CODES)}, got {self.kind!r}")
        tiles, blocks = -(-self.out_features // TILE_ROWS), self.in_features // GROUP_SIZE
        expected = {"data": (self.data, torch.uint8, (tiles, blocks, 256 if self.kind == "q4" else 512)),
                    "scales": (self.scales, torch.float16, (tiles, blocks, TILE_ROWS))}
        if self.kind == "q4":
            expected["mins"] = (self.mins, torch.float16, (tiles, blocks, TILE_ROWS))
        elif self.mins is not None:
            raise ValueError("QuantizedWeight: a q8 weight has no mins")
        for field, (t, dtype, shape) in expected.items():
            if t is None or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"QuantizedWeight: {field} must be a contiguous {dtype} tensor of shape "
                                 f"{list(shape)} (as pack_q4/pack_q8 make it)")
        if self.out_features <= 0 or self.in_features <= 0 or self.in_features % GROUP_SIZE:
            raise ValueError(f"QuantizedWeight: in_features must be a positive multiple of {GROUP_SIZE}, "
                             f"got [{self.out_features}, {self.in_features}]")

    @cached_property
    def _c_weight(self) -> CWeight:
        if not self.data.is_cpu:
            raise ValueError(f"the CPU kernel cannot read a weight on {self.data.device}")
        return CWeight(_KIND_CODES[self.kind], self.out_features, self.in_features, self.data.data_ptr(),
                        self.scales.data_ptr(), 0 if self.mins is None else self.mins.data_ptr())

    @cached_property
    def kernel_handle(self) -> int:
        """The address of this weight's ``qweight_t`` for ``csrc/quant_gemv.c`` (built once).

        Raises:
            ValueError: the weight is not on the CPU.
        """
        return ctypes.addressof(self._c_weight)

    @property
    def nbytes(self) -> int:
        """Bytes held: data, scales and mins (0.625 per weight for q4, 1.0625 for q8, as GGUF; plus the
        padding rows of the last tile)."""
        tensors = [self.data, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)


def _check_blocks(name: str, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> None:
    """Raises ValueError unless ``q`` is ``[N, K]`` with K a multiple of 32 and the scales ``[N, K // 32]``."""
    if q.dim() != 2 or q.shape[1] % GROUP_SIZE or q.shape[1] == 0 or q.shape[0] == 0:
        raise ValueError(f"{name}: q must be [out_features, in_features] with in_features a positive multiple "
                         f"of {GROUP_SIZE}, got {list(q.shape)}")
    blocks = (q.shape[0], q.shape[1] // GROUP_SIZE)
    for field, t in (("scales", scales), ("mins", mins)):
        if t is not None and tuple(t.shape) != blocks:
            raise ValueError(f"{name}: {field} must be [{blocks[0]}, {blocks[1]}] (one per {GROUP_SIZE} weights), "
                             f"got {list(t.shape)}")


def _tiled(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[N, blocks, ...]`` padded with zero rows to whole tiles and interleaved as the kernel reads them:
    per-block values ``[N, blocks]`` -> ``[tiles, blocks, TILE_ROWS]``; a block's bytes ``[N, blocks, 4 c]``
    -> ``[tiles, blocks, c * TILE_ROWS * 4]``, where chunk r (of c) holds bytes 4 r .. 4 r + 3 of each row of
    the tile in turn."""
    padded = F.pad(t, [0, 0] * (t.dim() - 1) + [0, -t.shape[0] % TILE_ROWS])
    tiles, blocks = padded.shape[0] // TILE_ROWS, t.shape[1]
    if t.dim() == 2:
        return padded.view(tiles, TILE_ROWS, blocks).transpose(1, 2).contiguous()
    chunks = t.shape[2] // 4
    return padded.view(tiles, TILE_ROWS, blocks, chunks, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, -1)


def _half(name: str, field: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float16 and tiled; raises ValueError where that overflows (or ``t`` is not finite)."""
    half = t.to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError(f"{name}: {field} must be finite and within float16's range (|x| <= 65504)")
    return _tiled(half)


def pack_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> QuantizedWeight:
    """A ``"q4"`` weight ``w = scales * q + mins``, blockwise.

    Args:
        q: uint8 ``[N, K]``, values 0..15, K a multiple of ``GROUP_SIZE``.
        scales, mins: float ``[N, K // GROUP_SIZE]`` (stored as float16).

    Raises:
        ValueError: on shapes, a dtype or values out of range.
    """
    _check_blocks("pack_q4", q, scales, mins)
    if q.dtype != torch.uint8 or int(q.max()) > 15:
        raise ValueError(f"pack_q4: q must be uint8 in 0..15, got {q.dtype}")
    blocks = q.view(q.shape[0], -1, GROUP_SIZE)
    # GGUF's pairing: weight i in the low nibble, weight i + 16 in the high one.
    nibbles = blocks[..., :GROUP_SIZE // 2] | (blocks[..., GROUP_SIZE // 2:] << 4)
    return QuantizedWeight("q4", q.shape[0], q.shape[1], _tiled(nibbles), _half("pack_q4", "scales", scales),
                           _half("pack_q4", "mins", mins))


def pack_q8(q: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """A ``"q8"`` weight ``w = scales * q``, blockwise.

    Args:
        q: int8 ``[N, K]``, K a multiple of ``GROUP_SIZE``.
        scales: float ``[N, K // GROUP_SIZE]`` (stored as float16).

    Raises:
        ValueError: on shapes or a dtype.
    """
    _check_blocks("pack_q8", q, scales, None)
    if q.dtype != torch.int8:
        raise ValueError(f"pack_q8: q must be int8, got {q.dtype}")
    # Stored unsigned (q + 128): vpdpbusd multiplies unsigned by signed bytes; the kernel takes 128 * sum(x) off.
    unsigned = (q.view(torch.uint8) ^ 0x80).view(q.shape[0], -1, GROUP_SIZE)
    return QuantizedWeight("q8", q.shape[0], q.shape[1], _tiled(unsigned), _half("pack_q8", "scales", scales),
                           None)


def _dequantize_rows(weight: QuantizedWeight, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The torch path of ``dequantize``/``embedding_rows``: rows ``ids`` (or all) -> ``[rows, K]`` in ``dtype``."""
    tiles, blocks, _ = weight.data.shape
    chunks = 4 if weight.kind == "q4" else 8
    # [tiles, rows of a tile, blocks, bytes of a row's block], a view.
    data = weight.data.view(tiles, blocks, chunks, TILE_ROWS, 4).permute(0, 3, 1, 2, 4).flatten(3)
    scales, mins = (None if t is None else t.transpose(1, 2) for t in (weight.scales, weight.mins))
    if ids is None:
        rows = weight.out_features
        select = lambda t: t.flatten(0, 1)[:rows]  # noqa: E731
    else:
        rows = ids.numel()
        select = lambda t: t[ids // TILE_ROWS, ids % TILE_ROWS]  # noqa: E731
    data = select(data)
    if weight.kind == "q4":
        q = torch.cat([data & 15, data >> 4], dim=-1).float()
    else:
        q = (data.view(torch.int8) ^ -128).float()
    w = q * select(scales).float().unsqueeze(-1)
    if mins is not None:
        w += select(mins).float().unsqueeze(-1)
    return w.view(rows, weight.in_features).to(dtype)


def _kernel_dequantize(weight: QuantizedWeight, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The C kernel's ``dequantize``/``embedding_rows`` (rows ``ids``, or all); None where it cannot run.

    Raises:
        IndexError: an id outside ``[0, out_features)``.
    """
    if weight.data.device.type != "cpu" or dtype not in _C_DTYPES or (lib := load_kernel()) is None:
        return None
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
    rows = weight.out_features if ids is None else ids.numel()
    out = torch.empty(rows, weight.in_features, dtype=dtype)
    status = lib.quant_dequantize(_KIND_CODES[weight.kind], weight.data.data_ptr(), weight.scales.data_ptr(),
                                  0 if weight.mins is None else weight.mins.data_ptr(),
                                  0 if ids is None else ids.data_ptr(), rows, weight.out_features,
                                  weight.in_features, out.data_ptr(), _C_DTYPES[dtype])
    if status != 0:
        raise IndexError(f"embedding_rows: ids must be in [0, {weight.out_features})")
    return out


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as ``[out_features, in_features]`` in ``dtype`` (any device)."""
    out = _kernel_dequantize(weight, None, dtype)
    return out if out is not None else _dequantize_rows(weight, None, dtype)


def embedding_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of the dequantized weight -> ``[*ids.shape, in_features]`` in ``dtype``
    (a quantized embedding table's lookup).

    Raises:
        IndexError: an id outside ``[0, out_features)`` (as ``F.embedding``).
    """
    flat = ids.reshape(-1)
    out = _kernel_dequantize(weight, flat, dtype)
    if out is None:
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= weight.out_features):
            raise IndexError(f"embedding_rows: ids must be in [0, {weight.out_features})")
        out = _dequantize_rows(weight, flat, dtype)
    return out.view(*ids.shape, weight.in_features)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias``: ``[..., K]`` -> ``[..., N]`` in x's dtype.

    On the CPU with float32 or bfloat16 x, up to ``KERNEL_MAX_ROWS`` rows go
    through the C kernel (activations quantized per block, see the module
    docstring); more rows, other devices and dtypes, or no compiler:
    ``dequantize`` and ``F.linear``.

    Raises:
        ValueError: x's last dimension is not ``in_features``, or bias is not ``[out_features]``.
    """
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quantized_linear: x's last dimension must be in_features={weight.in_features}, "
                         f"got {list(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.out_features,):
        raise ValueError(f"quantized_linear: bias must be [{weight.out_features}], got {list(bias.shape)}")
    if x.is_cpu and x.shape[:-1].numel() <= KERNEL_MAX_ROWS and (out := kernel_linear(x, weight, bias)) is not None:
        return out
    return F.linear(x, dequantize(weight, x.dtype), bias)


def kernel_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``quantized_linear`` through the C kernel whatever the row count (CPU tensors, shapes checked by the
    caller); None when x's dtype is not float32/bfloat16 or there is no kernel.

    Raises:
        ValueError: the weight is not on the CPU.
    """
    # The decode path: every attribute read and ctypes argument here costs a fraction of a microsecond, and a
    # decode step makes over a hundred of these calls.
    if (code := _C_DTYPES.get(x.dtype)) is None or (lib := load_kernel()) is None:
        return None
    rows = x if x.dim() == 2 else x.reshape(-1, weight.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, weight.out_features, dtype=x.dtype)
    if bias is None:
        lib.quant_linear(weight.kernel_handle, rows.data_ptr(), out.data_ptr(), num_rows, code)
    else:
        if bias.dtype not in _C_DTYPES or not bias.is_contiguous():
            bias = bias.float().contiguous()
        lib.quant_linear_bias(weight.kernel_handle, rows.data_ptr(), out.data_ptr(), num_rows,
                              code | 2 * _C_DTYPES[bias.dtype], bias.data_ptr())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


class CWeight(ctypes.Structure):
    """``qweight_t`` in ``csrc/quant_gemv.c`` (``csrc/fused_decode.c`` reads a dense weight through it too)."""

    _fields_ = [("kind", ctypes.c_int64), ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p)]


_SOURCE = Path(__file__).parent / "csrc" / "quant_gemv.c"
_KIND_CODES = {"q4": 0, "q8": 1}
#: The kernel's dtype flag for each dtype it reads and writes.
_C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: Instruction sets ``force_isa`` accepts, by the kernel's code.
ISAS = {"scalar": 1, "avx2": 2, "avx512": 3}


@contextlib.contextmanager
def force_isa(name: str, lib: ctypes.CDLL | None = None) -> Iterator[None]:
    """Run the C kernel's ``name`` code path (a key of ``ISAS``) inside the block, for tests and benchmarks.

    Args:
        lib: the kernel library (default: ``load_kernel()``).

    Raises:
        ValueError: an unknown name, or a path this CPU or build lacks (or no kernel).
    """
    lib = lib or load_kernel()
    if name not in ISAS or lib is None or lib.quant_set_isa(ISAS[name]) < 0:
        raise ValueError(f"force_isa: {name!r} is not available here (known: {list(ISAS)})")
    try:
        yield
    finally:
        lib.quant_set_isa(0)


@cache
def load_kernel(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled ``csrc/quant_gemv.c`` (``c_kernels.load_c_library``); None when it cannot be had.

    Args:
        extra_flags: compile flags after the defaults, for tests (``("-march=haswell",)``: an AVX2-only build).
    """
    lib = load_c_library(_SOURCE, "CPU quantized linear", extra_flags)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for function in (lib.quant_linear, lib.quant_linear_bias, lib.quant_dequantize, lib.quant_set_isa):
        function.restype = i32
    lib.quant_linear.argtypes = [p, p, p, i64, i64]
    lib.quant_linear_bias.argtypes = [p, p, p, i64, i64, p]
    lib.quant_dequantize.argtypes = [i32, p, p, p, p, i64, i64, i64, p, i32]
    lib.quant_set_isa.argtypes = [i32]
    return lib
