"""Fused CPU versions of a decoder layer's elementwise chains: RMSNorm (+ residual), rotary, SiLU-and-multiply.

One token per step makes these chains cost their op dispatch, not their
arithmetic: a 576-wide RMSNorm with its residual add is seven torch ops and
about 23 us on the 2-core test machine, the C call about 2 us
(``csrc/cpu_ops.c``, built and cached by ``pagedserve.engine.model.c_kernels``). Each
function here returns None when it does not apply (not a CPU tensor, a dtype
other than float32/bfloat16, rows not contiguous within themselves, no
compiler), and the caller runs its torch reference instead; the layers in
``pagedserve.engine.model.layers`` do exactly that, so every other device and dtype keeps
the torch path. The norm with a residual and the rotary write their inputs in
place, as vLLM's CPU and CUDA ops do: the decoder layer hands them tensors no
one else reads.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from pagedserve.engine import envs
from pagedserve.engine.model.c_kernels import load_c_library

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _library() -> ctypes.CDLL | None:
    if not envs.PAGEDSERVE_FUSED_CPU_OPS:
        return None
    lib = load_c_library(_SOURCE, "fused CPU elementwise ops")
    if lib is None:
        return None
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    argtypes = {"rms_norm": [p, i64, p, i64, p, p, i64, i64, i64, f32], "rotary": [p, i64, p, p, i64, i64, i64, i64],
                "silu_and_mul": [p, p, i64, i64]}
    for name, types in argtypes.items():
        for suffix in _SUFFIX.values():
            function = getattr(lib, f"{name}_{suffix}")
            function.argtypes, function.restype = types, None
    return lib


@cache
def _kernel(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    """The entry point ``name`` for tensors of ``dtype``, or None when there is none."""
    lib = _library() if dtype in _SUFFIX else None
    return None if lib is None else getattr(lib, f"{name}_{_SUFFIX[dtype]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``RMSNorm.forward`` fused: ``weight * norm(x)`` in a new tensor, or with a residual, in place (vLLM's
    ``fused_add_rms_norm``): ``residual += x``, ``x = weight * norm(residual)``, returning ``(x, residual)``.

    Args:
        x, residual: ``[T, width]`` CPU tensors of one dtype, each row contiguous.
        weight: ``[width]``, contiguous, same dtype.

    Returns:
        As ``RMSNorm.forward``, or None (nothing written) when the fused op does not apply.
    """
    kernel = _kernel("rms_norm", x.dtype)
    if (kernel is None or not x.is_cpu or x.dim() != 2 or x.stride(1) != 1 or weight.dtype != x.dtype
            or not weight.is_contiguous()):
        return None
    rows, width = x.shape
    if residual is None:
        out = torch.empty((rows, width), dtype=x.dtype)
        kernel(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), width, rows, width, eps)
        return out
    if residual.dtype != x.dtype or residual.shape != x.shape or residual.stride(1) != 1 or not residual.is_cpu:
        return None
    kernel(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(), x.data_ptr(),
           x.stride(0), rows, width, eps)
    return x, residual


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``apply_rotary`` in place on ``x``; returns ``x``, or None (``x`` untouched) when the fused op does not
    apply.

    Args:
        x: ``[T, heads, head_dim]`` on the CPU, heads contiguous within a row.
        cos, sin: ``[T, 1, head_dim // 2]`` with the same row stride, each row contiguous, same dtype.
    """
    kernel = _kernel("rotary", x.dtype)
    if (kernel is None or not x.is_cpu or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]
            or cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape != sin.shape
            or cos.shape[-1] * 2 != x.shape[2] or cos.stride(-1) != 1 or sin.stride(-1) != 1
            or cos.stride(0) != sin.stride(0)):
        return None
    rows, heads, head_dim = x.shape
    kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), rows, heads, head_dim)
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` (``[T, 2 * width]``, contiguous, on the CPU) ->
    ``[T, width]``, or None when the fused op does not apply."""
    kernel = _kernel("silu_and_mul", gate_up.dtype)
    if kernel is None or not gate_up.is_cpu or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return None
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, width)
    return out
