"""The reference attention backend, in plain torch: correct everywhere, tuned for CPU.

One step's flattened batch mixes decodes (one query token) and prefill chunks
(several query tokens, maybe after earlier context). The backend splits it:

* all one-token queries run together: their requests' blocks are gathered
  with a single ``index_select`` into a reusable workspace (allocating tens of
  MB per layer would page-fault on every step), and one SDPA call attends over
  them with a key-length mask. The query heads sharing a KV head are folded
  into the query-length axis (``[B, kv_heads, group, head_dim]``), which turns
  GQA into plain attention without repeating keys;
* prefill chunks run one request at a time through SDPA with a causal mask
  offset by the request's context; a chunk without context reads its keys
  straight from this step's ``key``/``value`` instead of the cache.

The split depends only on the step's metadata, so it is computed once per step
and reused by every layer (``_plan`` caches it by metadata identity: build a
new ``AttentionMetadata`` for each step rather than mutating one in place).

Requirements on the caller: padding entries of ``block_table`` hold valid
block ids (e.g. 0), and the cache holds finite values everywhere (allocate it
with ``torch.zeros``): masked-out key slots are still multiplied by a zero
probability, and ``0 * nan`` would poison the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.attention import AttentionBackend, AttentionMetadata, register_backend


@dataclass
class _PrefillChunk:
    """One request with more than one query token this step."""

    start: int  # first row of the request's tokens in the flattened batch
    end: int    # one past its last row
    # With earlier context only (None otherwise: keys come from this step's key/value):
    blocks: torch.Tensor | None  # [num_blocks] int64 ids covering the sequence
    mask: torch.Tensor | None    # [chunk_len, seq_len] bool, True where a query sees a key


@dataclass
class _StepPlan:
    """How one step's batch splits into decodes and prefill chunks."""

    all_decode: bool                    # every request has a single query token
    decode_rows: torch.Tensor | None    # [num_decodes] int64 rows of the decode tokens; None if no decodes
    decode_blocks: torch.Tensor | None  # [num_decodes * blocks per decode] int64 ids, padded to the longest
    decode_mask: torch.Tensor | None    # [num_decodes, 1, 1, keys] bool, True where a key is attended
    prefills: list[_PrefillChunk]
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks] int32 block table rows
    decode_seq_lens: torch.Tensor | None = None     # [num_decodes] int32


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    One instance serves every layer of a model: the step plan and the gather
    workspace are shared, since layers run one after another.
    """

    def __init__(self) -> None:
        self._planned_for: AttentionMetadata | None = None
        self._plan_cache: _StepPlan | None = None
        self._workspace = torch.empty(0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``; rows past ``num_actual_tokens`` are left as zeros."""
        num_tokens = metadata.num_actual_tokens
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        slots = kv_cache.view(2, -1, num_kv_heads, head_dim)
        slots[0].index_copy_(0, metadata.slot_mapping[:num_tokens], key[:num_tokens])
        slots[1].index_copy_(0, metadata.slot_mapping[:num_tokens], value[:num_tokens])

        plan = self._plan(metadata, kv_cache.shape[2])
        if plan.all_decode and query.shape[0] == num_tokens:
            return self._decode(query, kv_cache, plan, scale)
        output = torch.zeros_like(query)
        if plan.decode_rows is not None:
            output[plan.decode_rows] = self._decode(query[plan.decode_rows], kv_cache, plan, scale)
        for chunk in plan.prefills:
            output[chunk.start:chunk.end] = self._prefill(query, key, value, kv_cache, chunk, scale)
        return output

    def _plan(self, metadata: AttentionMetadata, block_size: int) -> _StepPlan:
        """Split the step's requests into decodes and prefill chunks (cached per step)."""
        if metadata is self._planned_for and self._plan_cache is not None:
            return self._plan_cache
        device = metadata.block_table.device
        starts = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        query_lens = np.diff(starts)
        is_decode = query_lens == 1
        decode_reqs = np.flatnonzero(is_decode)

        decode_rows = decode_blocks = decode_mask = decode_block_table = decode_seq_lens = None
        if len(decode_reqs):
            decode_num_blocks = -(-int(seq_lens[decode_reqs].max()) // block_size)
            reqs = torch.from_numpy(decode_reqs).to(device)
            decode_blocks = metadata.block_table[reqs, :decode_num_blocks].reshape(-1).long()
            keys = torch.arange(decode_num_blocks * block_size, device=device)
            decode_mask = (keys[None, :] < metadata.seq_lens[reqs, None])[:, None, None, :]
            decode_rows = torch.from_numpy(starts[decode_reqs]).to(device)
            decode_block_table = metadata.block_table[reqs].contiguous()
            decode_seq_lens = metadata.seq_lens[reqs].contiguous()

        prefills = []
        for req in np.flatnonzero(~is_decode).tolist():
            start, end, seq_len = int(starts[req]), int(starts[req + 1]), int(seq_lens[req])
            blocks = mask = None
            if seq_len > end - start:
                blocks = metadata.block_table[req, :-(-seq_len // block_size)].long()
                # Query i sits at position context_len + i and sees keys 0..context_len + i.
                rows = torch.arange(seq_len - (end - start), seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= rows[:, None]
            prefills.append(_PrefillChunk(start, end, blocks, mask))

        self._planned_for = metadata
        self._plan_cache = _StepPlan(bool(is_decode.all()), decode_rows, decode_blocks, decode_mask, prefills,
                                     decode_block_table, decode_seq_lens)
        return self._plan_cache

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Copy the given blocks of keys and values into the workspace.

        Args:
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            blocks: ``[n]`` int64 block ids.

        Returns:
            ``[2, n * block_size, num_kv_heads, head_dim]``, a view of the
            workspace valid until the next gather.
        """
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        numel = 2 * len(blocks) * block_size * num_kv_heads * head_dim
        if (self._workspace.numel() < numel or self._workspace.dtype != kv_cache.dtype
                or self._workspace.device != kv_cache.device):
            self._workspace = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
        out = self._workspace[:numel].view(2, len(blocks), -1)
        torch.index_select(kv_cache.view(2, num_blocks, -1), 1, blocks, out=out)
        return out.view(2, -1, num_kv_heads, head_dim)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan,
                scale: float) -> torch.Tensor:
        """Attention of every one-token query at once.

        Args:
            query: ``[num_decodes, num_heads, head_dim]``, in plan order.

        Returns:
            ``[num_decodes, num_heads, head_dim]``.
        """
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        num_decodes, num_heads = query.shape[:2]
        q = query.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kv = self._gather(kv_cache, plan.decode_blocks).view(2, num_decodes, -1, num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                             attn_mask=plan.decode_mask, scale=scale)
        return out.reshape(num_decodes, num_heads, head_dim)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, chunk: _PrefillChunk, scale: float) -> torch.Tensor:
        """Causal attention of one request's chunk: ``[chunk_len, num_heads, head_dim]``."""
        q = query[chunk.start:chunk.end].transpose(0, 1)
        if chunk.blocks is None:
            k, v = key[chunk.start:chunk.end].transpose(0, 1), value[chunk.start:chunk.end].transpose(0, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(0, 1)
        kv = self._gather(kv_cache, chunk.blocks)[:, :chunk.mask.shape[1]].transpose(1, 2)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=chunk.mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(0, 1)
