"""The Triton kernel of LoRA on CUDA (``LoRALayer.add_to`` when the step's ``LoRAMapping`` has segments, i.e. with
the Triton attention backend); importing this imports Triton.

One segmented gather matrix-vector product (SGMV, punica's: Chen et al., 2023, arXiv:2310.18547) serves both
halves of an adapter: the "shrink" ``h = x @ A[slot].T`` to the rank and the "expand" ``out += h @ B[slot].T``.
A step's tokens come in runs of one request each, so the tokens of one adapter slot form a few contiguous
segments; a segment is ``(first token, tokens, slot)``. Grid: ``(segments, row blocks of the longest segment,
column blocks)``; a program multiplies ``BLOCK_M`` rows of its segment by ``BLOCK_N`` columns of its slot's weight,
``BLOCK_K`` inputs at a time, accumulating in float32. Tokens in no segment (the base model's) are not touched.
So a step with several adapters and the base model takes two launches per layer, whatever the mix, where the
torch path takes two products per slot.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates the kernel, i.e. at this module's first import: with
``TRITON_INTERPRET=1`` it runs on the CPU, in the interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.engine.model.triton_kernels import dot_dtype

#: Rows of a segment per program: decode segments have one token, so small tiles waste least (16 is the least
#: tl.dot takes).
_BLOCK_M = 16


@triton.jit
def _sgmv_kernel(
    x, weight, out, segments, num_inputs, num_outputs,
    stride_x_tok, stride_x_in, stride_w_slot, stride_w_out, stride_w_in, stride_o_tok, stride_o_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``out[rows, cols] (+)= x[rows] @ weight[slot, cols].T`` for one tile of one segment."""
    seg = tl.program_id(0)
    length = tl.load(segments + seg * 3 + 1)
    if tl.program_id(1) * BLOCK_M >= length:
        return
    start = tl.load(segments + seg * 3)
    slot = tl.load(segments + seg * 3 + 2).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (start + offs_m).to(tl.int64)
    row_mask = offs_m < length
    col_mask = offs_n < num_outputs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, num_inputs, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < num_inputs
        a = tl.load(x + rows[:, None] * stride_x_tok + offs_k[None, :] * stride_x_in,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(weight + slot * stride_w_slot + offs_n[None, :] * stride_w_out + offs_k[:, None] * stride_w_in,
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    ptrs = out + rows[:, None] * stride_o_tok + offs_n[None, :] * stride_o_out
    mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, segments: torch.Tensor, max_length: int,
         accumulate: bool) -> None:
    """``out[s:s+n] (+)= x[s:s+n] @ weight[slot].T`` for each segment ``(s, n, slot)``; other rows untouched.

    Args:
        x: ``[T, in]``.
        weight: ``[slots, out, in]`` (A for the shrink, B for the expand).
        out: ``[T, out]``; float32 for a shrink's result, the activations' dtype for an expand.
        segments: ``[S, 3]`` int32 on ``x``'s device, ``(first token, tokens, slot)`` each.
        max_length: the longest segment's tokens (sizes the grid).
        accumulate: add to ``out`` (expand) rather than overwrite it (shrink).
    """
    num_outputs, num_inputs = weight.shape[1:]
    operand_dtype, dot_precision = dot_dtype(weight.dtype)
    block_n = max(16, min(64, triton.next_power_of_2(num_outputs)))
    block_k = max(16, min(64, triton.next_power_of_2(num_inputs)))
    grid = (segments.shape[0], triton.cdiv(max_length, _BLOCK_M), triton.cdiv(num_outputs, block_n))
    _sgmv_kernel[grid](
        x, weight, out, segments, num_inputs, num_outputs,
        *x.stride(), *weight.stride(), *out.stride(),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        ACCUMULATE=accumulate, DOT_DTYPE=operand_dtype, DOT_PRECISION=dot_precision,
    )
