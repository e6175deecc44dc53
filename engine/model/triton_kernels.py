"""The Triton kernels of the paged attention backend (``triton_attention``); importing this imports Triton.

Two kernels per layer and step:

1. ``_reshape_and_cache_kernel`` writes this step's K/V into the paged cache at
   ``metadata.slot_mapping``; a negative slot (a padded row of a CUDA-graph batch)
   is skipped.
2. ``_paged_attention_kernel`` attends every query token to its request's keys
   through the block table, causally, with the online softmax of FlashAttention
   (Dao et al. 2022, arXiv:2205.14135) and fp32 accumulation.

Grid of the attention kernel: ``(num_query_blocks, num_kv_heads)``. A program
owns ``BLOCK_Q`` consecutive query tokens of one request and all
``QUERIES_PER_KV`` query heads that share one kv head (GQA), i.e. a
``[BLOCK_M = BLOCK_Q * QUERIES_PER_KV, head_dim]`` tile, so each K/V tile is
loaded once for the whole head group. Query blocks of all requests are numbered
in one flat range whose size, ``num_tokens // BLOCK_Q + num_reqs``, needs only
host-known shapes; each program finds its request by binary search over
``query_start_loc``. This layout follows vLLM's unified Triton attention
(``vllm/attention/ops/triton_unified_attention.py``).

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates the kernels, i.e.
when this module is first imported: with ``TRITON_INTERPRET=1`` they run on the
CPU, in the interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.engine.model.attention import AttentionMetadata

# Keys per inner-loop iteration of the attention kernel; independent of the KV block size.
_TILE_N = 32
#: The window of a full-attention layer: longer than any sequence, so it hides nothing (one kernel serves both).
_NO_WINDOW = 1 << 30
# triton.jit reads TRITON_INTERPRET when it decorates the kernels below, so read it at import too.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _reshape_and_cache_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    stride_k_tok, stride_k_head, stride_k_d,
    stride_v_tok, stride_v_head, stride_v_d,
    stride_c_blk, stride_c_slot, stride_c_head, stride_c_d,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Copy the ``[num_kv_heads, head_dim]`` K and V of one token (program 0 = token) into its slot."""
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping + tok)
    if slot < 0:
        return
    offs_h = tl.arange(0, KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    cache_off = ((slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
                 + offs_h[:, None] * stride_c_head + offs_d[None, :] * stride_c_d)
    k = tl.load(key + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :] * stride_k_d,
                mask=mask)
    v = tl.load(value + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :] * stride_v_d,
                mask=mask)
    tl.store(key_cache + cache_off, k, mask=mask)
    tl.store(value_cache + cache_off, v, mask=mask)


@triton.jit
def _find_request(query_start_loc, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request that owns flat query block ``q_block``.

    Request ``i``'s blocks start at ``query_start_loc[i] // BLOCK_Q + i``; the answer is
    the largest ``i`` whose start is ``<= q_block``.

    Binary search: ``num_reqs`` is at most a few hundred, so about 8 scalar loads.
    """
    lo: tl.int32 = 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= q_block:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _paged_attention_kernel(
    out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
    scale, num_reqs, window, softcap,
    stride_q_tok, stride_q_head, stride_q_d,
    stride_o_tok, stride_o_head, stride_o_d,
    stride_c_blk, stride_c_slot, stride_c_head, stride_c_d,
    stride_bt_req,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One ``[BLOCK_M, head_dim]`` output tile: BLOCK_Q query tokens x the query heads of one kv head."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    # The flat numbering over-provisions blocks; the spare ones have nothing to do.
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + req)
    context_len = seq_len - q_len

    # Row m of the tile is query token q_idx[m] of the request, query head head[m].
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_block_local * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    d_valid = offs_d < HEAD_DIM
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(query + (q_start + q_idx)[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + offs_d[None, :] * stride_q_d, mask=q_mask, other=0.0)
    q_pos = context_len + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # Keys past the last query position of this tile are masked for every row, and so are those before the
    # first row's window (``window`` keys, its own included): skip them.
    kv_len = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    kv_first = tl.maximum(context_len + q_block_local * BLOCK_Q - window + 1, 0)
    for kv_start in range(kv_first, kv_len, TILE_N):
        k_pos = kv_start + offs_n
        k_valid = k_pos < kv_len
        block_id = tl.load(block_table + req * stride_bt_req + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        # int64: block_id * stride_c_blk overflows int32 for caches above 2**31 elements.
        slot_off = (block_id.to(tl.int64) * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_slot
                    + kv_head * stride_c_head)
        k = tl.load(key_cache + slot_off[None, :] + offs_d[:, None] * stride_c_d,
                    mask=k_valid[None, :] & d_valid[:, None], other=0.0)
        s = tl.dot(q.to(DOT_DTYPE), k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1 (tl has no tanh on every target)
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible & k_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key keeps m = -inf; exp(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache + slot_off[:, None] + offs_d[None, :] * stride_c_d,
                    mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    # Rows that attend to nothing (seq_len 0: padded CUDA-graph rows) come out as zeros.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(out + (q_start + q_idx)[:, None] * stride_o_tok + head[:, None] * stride_o_head
             + offs_d[None, :] * stride_o_d, o.to(out.dtype.element_ty), mask=q_mask)


def dot_dtype(dtype: torch.dtype) -> tuple[object, str | None]:
    """Operand dtype and ``input_precision`` of ``tl.dot`` for inputs of ``dtype``.

    fp32 inputs use IEEE fp32 products: Triton's default for fp32, TF32, would
    cost the accuracy the fp32 path exists for. fp16/bf16 use the default. The
    Triton interpreter does not support bf16 arithmetic ("use tl.cast to
    float32", Triton debugging guide; its ``tl.dot`` multiplies bf16 bit
    patterns, triton-lang/triton#11584), so interpreted bf16 operands are upcast.
    """
    if dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRETED):
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), None


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_tokens: int) -> None:
    """Write rows ``[0, num_tokens)`` of ``key`` and ``value`` (``[T, num_kv_heads, head_dim]``) into
    ``kv_cache`` at ``slot_mapping``; rows with a negative slot are skipped."""
    num_kv_heads, head_dim = key.shape[1:]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=_head_pad(head_dim), BLOCK_SIZE=kv_cache.shape[2],
    )


def paged_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
    """Causal attention of the first ``metadata.num_actual_tokens`` rows of ``query`` into ``out``.

    Args:
        out: ``[T, num_heads, head_dim]``, written for rows ``< num_actual_tokens``.
        query: ``[T, num_heads, head_dim]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, this step's K/V already written.
        metadata: the step's layout.
        scale: softmax scale.
        sliding_window: keys each query sees, its own included; None: all before it.
        logit_softcap: ``cap * tanh(s / cap)`` of each scaled score before the mask; None: none.
    """
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2:4]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    queries_per_kv = num_heads // num_kv_heads
    # Decode-only steps have one query token per request: a 16-row tile (the smallest
    # tl.dot accepts) wastes least; prefill tiles take 64 rows for more reuse of each K/V tile.
    min_rows = 16 if metadata.max_query_len == 1 else 64
    block_m = max(min_rows, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    operand_dtype, dot_precision = dot_dtype(query.dtype)
    grid = (metadata.num_actual_tokens // block_q + metadata.num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, metadata.block_table, metadata.query_start_loc,
        metadata.seq_lens, scale, metadata.num_reqs, sliding_window or _NO_WINDOW, logit_softcap or 1.0,
        *query.stride(), *out.stride(), *key_cache.stride(), metadata.block_table.stride(0),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, HEAD_PAD=_head_pad(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=_TILE_N,
        DOT_DTYPE=operand_dtype, DOT_PRECISION=dot_precision, SOFTCAP=logit_softcap is not None,
    )


def _head_pad(head_dim: int) -> int:
    """``head_dim`` rounded up to a power of two, at least 16 (``tl.dot`` needs dims >= 16)."""
    return max(16, triton.next_power_of_2(head_dim))
