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
  straight from this step's ``key``/``value`` instead of the cache. (On CPU,
  SDPA with a mask or ``enable_gqa`` takes its unfused math path, which
  materialises the ``[heads, chunk, context]`` scores: the ``cpu`` backend
  runs chunks in a C kernel instead: an 8k-token prompt 3-5x faster in fp32,
  9-13x in bf16.)

The split depends only on the step's metadata, so ``build_metadata`` computes
it once per step (``TorchAttentionMetadata``) and every layer reuses it.

Requirements on the caller: padding entries of ``block_table`` hold valid
block ids (e.g. 0), and the cache holds finite values everywhere (allocate it
with ``torch.zeros``): masked-out key slots are still multiplied by a zero
probability, and ``0 * nan`` would poison the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.engine.model.attention import AttentionBackend, AttentionMetadata, register_backend
from pagedserve.engine.model.cpu_threads import all_threads
from pagedserve.engine.profiling import region


@dataclass
class PrefillChunk:
    """One request with more than one query token this step."""

    start: int    # first row of the request's tokens in the flattened batch
    end: int      # one past its last row
    seq_len: int  # keys its last token sees: the earlier context plus this chunk
    # With earlier context only (None otherwise: keys come from this step's key/value):
    blocks: torch.Tensor | None  # [num_blocks] int64 ids covering the sequence
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, sliding_window: int | None, device: torch.device) -> torch.Tensor:
        """``[chunk_len, seq_len]`` bool, True where a query sees a key: query i sits at position
        ``context_len + i`` and sees keys ``0..context_len + i``, or the last ``sliding_window`` of them.

        Built on first use per window, so once per step (every layer shares the metadata) and never by a
        backend that attends without it (the CPU backend's kernel: 16 MB for a 2048-token chunk of an 8k prompt).
        """
        if (mask := self._masks.get(sliding_window)) is None:
            rows = torch.arange(self.seq_len - (self.end - self.start), self.seq_len, device=device)[:, None]
            keys = torch.arange(self.seq_len, device=device)[None, :]
            mask = keys <= rows
            if sliding_window is not None:
                mask &= keys > rows - sliding_window
            self._masks[sliding_window] = mask
        return mask


@dataclass
class PrefillBatch:
    """Every prefill chunk of the step, as arrays (the CPU backend's prefill kernel reads them)."""

    row_starts: torch.Tensor   # [num_prefills] int32, first row of each chunk in the flattened batch
    query_lens: torch.Tensor   # [num_prefills] int32, tokens of each chunk
    seq_lens: torch.Tensor     # [num_prefills] int32, keys each chunk's last token sees
    block_table: torch.Tensor  # [num_prefills, max_blocks] int32 block table rows, contiguous


@dataclass
class DecodeBatch:
    """The requests with a single query token this step, in request order."""

    rows: torch.Tensor         # [num_decodes] int64 rows of their tokens in the flattened batch
    blocks: torch.Tensor       # [num_decodes * blocks per decode] int64 ids, padded to the longest sequence
    mask: torch.Tensor         # [num_decodes, 1, 1, keys] bool, True where a key is attended
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32 block table rows, contiguous
    seq_lens: torch.Tensor     # [num_decodes] int32, contiguous
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def window_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``mask``, keeping only each request's last ``sliding_window`` keys (None: ``mask`` itself); built
        once per step and window."""
        if sliding_window is None:
            return self.mask
        if (mask := self._window_masks.get(sliding_window)) is None:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            mask = self.mask & (keys[None, :] >= (self.seq_lens[:, None] - sliding_window))[:, None, None, :]
            self._window_masks[sliding_window] = mask
        return mask


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The common layout of a step plus its split into decodes and prefill chunks."""

    decodes: DecodeBatch | None  # None when no request decodes
    prefills: list[PrefillChunk]
    prefill_batch: PrefillBatch | None  # the same chunks as arrays; None when there are none

    @property
    def all_decode(self) -> bool:
        """Every request of the step has a single query token."""
        return self.decodes is not None and not self.prefills

    def decode_only(self, query: torch.Tensor) -> bool:
        """``all_decode``, and ``query`` (``[T, H, D]``) has no padding rows past the step's tokens: its rows
        are the decodes in order."""
        return self.all_decode and query.shape[0] == self.num_actual_tokens


#: Attention of the one-token queries: (query [num_decodes, H, D], kv_cache, metadata, scale, sliding_window)
#: -> same shape.
DecodeFn = Callable[[torch.Tensor, torch.Tensor, TorchAttentionMetadata, float, int | None], torch.Tensor]
#: Attention of the prefill chunks: (query [T, H, D], key, value, kv_cache, metadata, scale, sliding_window)
#: -> [T, H, D], zeros outside the chunks' rows.
PrefillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, TorchAttentionMetadata, float,
                      int | None], torch.Tensor]


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    One instance serves every layer of a model: the gather workspace is
    shared, since layers run one after another.

    Scores soft-capped (``logit_softcap``) take the unfused math path: SDPA has no such option.

    Args:
        block_size: tokens per block of the KV caches ``forward`` will be given.
        logit_softcap: see ``AttentionBackend``.
    """

    supported_devices = ("cpu", "cuda")

    def __init__(self, block_size: int, logit_softcap: float | None = None) -> None:
        super().__init__(block_size, logit_softcap)
        self._workspace = torch.empty(0)

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        """Split the step's requests into decodes and prefill chunks, with their block ids and the decodes'
        key mask (a chunk's causal mask is built on first use: ``PrefillChunk.mask``; windowed masks too)."""
        block_size = self.block_size
        device = common.block_table.device
        starts = np.asarray(common.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(common.seq_lens_cpu, dtype=np.int64)
        is_decode = np.diff(starts) == 1
        decode_reqs = np.flatnonzero(is_decode)

        decodes = None
        if len(decode_reqs):
            decode_num_blocks = -(-int(seq_lens[decode_reqs].max()) // block_size)
            reqs = torch.from_numpy(decode_reqs).to(device)
            keys = torch.arange(decode_num_blocks * block_size, device=device)
            decodes = DecodeBatch(
                rows=torch.from_numpy(starts[decode_reqs]).to(device),
                blocks=common.block_table[reqs, :decode_num_blocks].reshape(-1).long(),
                mask=(keys[None, :] < common.seq_lens[reqs, None])[:, None, None, :],
                block_table=common.block_table[reqs].contiguous(),
                seq_lens=common.seq_lens[reqs].contiguous(),
            )

        prefills, prefill_batch = [], None
        prefill_reqs = np.flatnonzero(~is_decode)
        for req in prefill_reqs.tolist():
            start, end, seq_len = int(starts[req]), int(starts[req + 1]), int(seq_lens[req])
            blocks = common.block_table[req, :-(-seq_len // block_size)].long() if seq_len > end - start else None
            prefills.append(PrefillChunk(start, end, seq_len, blocks))
        if len(prefill_reqs):
            prefill_batch = PrefillBatch(
                row_starts=torch.from_numpy(starts[prefill_reqs].astype(np.int32)).to(device),
                query_lens=torch.from_numpy(np.diff(starts)[prefill_reqs].astype(np.int32)).to(device),
                seq_lens=torch.from_numpy(seq_lens[prefill_reqs].astype(np.int32)).to(device),
                block_table=common.block_table[torch.from_numpy(prefill_reqs).to(device)].contiguous(),
            )

        return TorchAttentionMetadata(**{f.name: getattr(common, f.name) for f in fields(AttentionMetadata)},
                                      decodes=decodes, prefills=prefills, prefill_batch=prefill_batch)

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
        """See ``AttentionBackend.forward``; rows past ``num_actual_tokens`` are left as zeros.

        Raises:
            ValueError: when the cache's blocks are not ``block_size`` tokens.
        """
        # Attention repays an OpenMP barrier: every thread, even in a serial CPU step (cpu_threads).
        with region("attention"), all_threads():
            return self.run(query, key, value, kv_cache, metadata, scale, sliding_window, self.decode, self.prefill)

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
            metadata: TorchAttentionMetadata, scale: float, sliding_window: int | None, decode: DecodeFn,
            prefill: PrefillFn) -> torch.Tensor:
        """``forward``'s work with the decodes attended by ``decode`` and the prefill chunks by ``prefill``
        (how the CPU backend reuses it)."""
        if kv_cache.shape[2] != self.block_size:
            raise ValueError(f"the KV cache has blocks of {kv_cache.shape[2]} tokens; this attention backend "
                             f"was built for {self.block_size}")
        num_tokens = metadata.num_actual_tokens
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        slots = kv_cache.view(2, -1, num_kv_heads, head_dim)
        slots[0].index_copy_(0, metadata.slot_mapping[:num_tokens], key[:num_tokens])
        slots[1].index_copy_(0, metadata.slot_mapping[:num_tokens], value[:num_tokens])

        if metadata.decode_only(query):
            return decode(query, kv_cache, metadata, scale, sliding_window)
        output = (prefill(query, key, value, kv_cache, metadata, scale, sliding_window) if metadata.prefills
                  else torch.zeros_like(query))
        if metadata.decodes is not None:
            rows = metadata.decodes.rows
            output[rows] = decode(query[rows], kv_cache, metadata, scale, sliding_window)
        return output

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

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata,
               scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Attention of every one-token query at once (a ``DecodeFn``).

        Args:
            query: ``[num_decodes, num_heads, head_dim]``, in the order of ``metadata.decodes``.

        Returns:
            ``[num_decodes, num_heads, head_dim]``.
        """
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        num_decodes, num_heads = query.shape[:2]
        q = query.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kv = self._gather(kv_cache, metadata.decodes.blocks).view(2, num_decodes, -1, num_kv_heads, head_dim)
        out = self._attend(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                           metadata.decodes.window_mask(sliding_window), scale)
        return out.reshape(num_decodes, num_heads, head_dim)

    def prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Attention of every prefill chunk, one at a time (a ``PrefillFn``).

        Returns:
            ``[T, num_heads, head_dim]`` like ``query``, zeros outside the chunks' rows.
        """
        output = torch.zeros_like(query)
        for chunk in metadata.prefills:
            output[chunk.start:chunk.end] = self._prefill(query, key, value, kv_cache, chunk, scale, sliding_window)
        return output

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 chunk: PrefillChunk, scale: float, sliding_window: int | None) -> torch.Tensor:
        """Causal attention of one request's chunk: ``[chunk_len, num_heads, head_dim]``."""
        q = query[chunk.start:chunk.end].transpose(0, 1)
        # A window at least the sequence's length hides nothing.
        window = sliding_window if sliding_window is not None and sliding_window < chunk.seq_len else None
        if chunk.blocks is None:
            k, v = key[chunk.start:chunk.end].transpose(0, 1), value[chunk.start:chunk.end].transpose(0, 1)
            if window is None and self.logit_softcap is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                out = self._attend(q, k, v, chunk.mask(window, q.device), scale)
            return out.transpose(0, 1)
        kv = self._gather(kv_cache, chunk.blocks)[:, :chunk.seq_len].transpose(1, 2)
        return self._attend(q, kv[0], kv[1], chunk.mask(window, q.device), scale).transpose(0, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Softmax attention of ``q`` ``[..., Hq, L, D]`` over ``k``, ``v`` ``[..., Hkv, S, D]`` (``Hq`` a multiple of
        ``Hkv``) where ``mask`` (broadcast to ``[..., Hq, L, S]``) is true: SDPA, or with ``logit_softcap`` the
        math transformers' eager Gemma 2 runs (scores capped, then masked, softmax in float32)."""
        if self.logit_softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        cap = self.logit_softcap
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(v.dtype), v)
