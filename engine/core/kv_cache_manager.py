"""Which KV blocks each request owns, and prefix-cache lookups."""

from __future__ import annotations

from pagedserve.engine.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates KV blocks to requests and finds cached prefixes.

    With a sliding window shared by every layer, a request gives back each block that falls wholly before the
    window of its next token (vLLM's ``SlidingWindowManager``): its place in the request's list becomes the
    null block, which nothing reads (the attention kernels start at the window), and the block joins the free
    queue still cached, so a later request with the same prefix may yet hit it. A long request then holds about
    ``window / block_size + 1`` blocks instead of one per ``block_size`` tokens.

    Args:
        num_blocks: blocks in the pool, the reserved null block included.
        block_size: tokens per block.
        enable_caching: prefix caching on or off.
        sliding_window: the window every layer shares, in tokens; None keeps every block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Leading blocks of each request already given back (sliding_window).
        self.num_skipped_blocks: dict[str, int] = {}
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks of each request already registered in the prefix-cache index.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up (tokens)
        self.prefix_cache_hits = 0     # of those, found in the cache (tokens)

    @property
    def usage(self) -> float:
        """Fraction (0..1) of usable blocks held by requests."""
        return self.block_pool.get_usage()

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``'s tokens.

        The last token is never served from the cache: its logits are needed
        to sample, so at least one token is always computed. Requests asking
        for prompt logprobs get no hits (every prompt position must run); of
        ``n`` siblings only the first asks, and the others hit the blocks it caches.

        Returns:
            The cached blocks (not yet referenced: pass them to
            ``allocate_slots``) and the number of tokens they hold.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup that led to scheduling (retries are not counted twice)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens)`` would succeed now (a running request); with a
        sliding window it may say no where giving back the blocks before the window would have made room."""
        num_blocks = len(self.req_to_blocks.get(request.request_id, ()))
        num_required = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return num_required - num_blocks <= self.block_pool.get_num_free_blocks()

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens.

        Args:
            request: the request; its ``num_computed_tokens`` is where the new tokens start.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: tokens found in the prefix cache (first scheduling only).
            new_computed_blocks: the blocks holding them, from ``get_computed_blocks``.

        Returns:
            The newly allocated blocks (possibly empty), or None when the pool
            cannot hold them; nothing else changes then (with a sliding window, the blocks
            before the window may have been given back: no query reads them any more).
        """
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        if self.sliding_window is not None and req_blocks:
            self._free_blocks_before_window(request.request_id, req_blocks, num_computed)
        if not new_computed_blocks and num_required <= len(req_blocks):
            # Decode fast path (15 steps in 16): room in the last block, and no
            # block became full, except when these tokens filled one.
            if (self.enable_caching and (num_computed + num_new_tokens) // self.block_size
                    > self.num_cached_blocks.get(request.request_id, 0)):
                self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
            return []
        new_computed_blocks = new_computed_blocks or []
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Cache hits that sit in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        if self.sliding_window is not None and new_computed_blocks:  # hits wholly before the window
            self._free_blocks_before_window(request.request_id, req_blocks, num_computed)
        return new_blocks

    def _free_blocks_before_window(self, request_id: str, req_blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Give back the blocks no query from position ``num_computed`` on reads: those wholly before
        ``num_computed - sliding_window + 1``, its first key. Later blocks first, so that a prefix's root is
        evicted last, as in ``free``."""
        start = self.num_skipped_blocks.get(request_id, 0)
        end = min(max(num_computed - self.sliding_window + 1, 0) // self.block_size, len(req_blocks))
        if end <= start:
            return
        freed = req_blocks[start:end]
        req_blocks[start:end] = [self.block_pool.null_block] * (end - start)
        self.num_skipped_blocks[request_id] = end
        self.block_pool.free_blocks(reversed(freed))

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Blocks are registered before this step writes their K/V. A request that
        # hits them in a later step is safe; so is a sibling hitting them in this
        # same step, because every attention backend writes the whole step's K/V
        # of a layer before any query of that layer reads the cache.
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end > start:
            self.block_pool.cache_full_blocks(req_blocks[start:end], request.block_hashes[start:end])
            self.num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release every block of ``request``.

        Blocks are freed tail first, so under pressure a prefix's last blocks
        are evicted before its root, which more requests share.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        skipped = self.num_skipped_blocks.pop(request.request_id, 0)
        self.block_pool.free_blocks(reversed(blocks[skipped:]))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks ``request_id`` holds (0 for an unknown request), those given back before its window left out."""
        return len(self.req_to_blocks.get(request_id, ())) - self.num_skipped_blocks.get(request_id, 0)

    def block_ids_by_request(self) -> dict[str, list[int]]:
        """Each request holding blocks -> their ids, in its sequence's order (those given back left out)."""
        null = self.block_pool.null_block
        return {req_id: [b.block_id for b in blocks if b is not null]
                for req_id, blocks in self.req_to_blocks.items() if blocks}

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; False when requests still hold blocks."""
        return self.block_pool.reset_prefix_cache()
