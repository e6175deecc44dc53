"""The pool of KV cache blocks, their ref counts and the prefix-cache index."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pagedserve.engine.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    """Metadata of one KV cache block; the K/V themselves live on the worker.

    ``prev_free`` / ``next_free`` link the block into the free queue while
    its ``ref_cnt`` is 0.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockCounts(NamedTuple):
    """The usable blocks (the null block left out) by state, in blocks."""

    used: int  # held by requests
    cached_free: int  # free, still holding a cached prefix that a hit can take back until it is evicted
    free: int  # free, holding nothing cached
    total: int


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (least recently freed first).

    A doubly linked list with sentinels, so a cached block that gets a prefix
    hit can be taken out of the middle in O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next.

        Raises:
            ValueError: when the queue is empty.
        """
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """``num_blocks`` blocks; block 0 is reserved as the null (padding) block.

    A freed block keeps its hash and stays findable through
    ``get_cached_block`` until it is evicted, which is what lets a finished
    request's prefix serve later requests.

    Args:
        num_blocks: total blocks including the null block (>= 2).
        enable_caching: keep the hash -> block index.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.ref_cnt = 1
        # Free blocks that still hold a cached prefix (reusable by a hit until evicted); kept as a
        # count so that a step record need not scan the pool.
        self.num_cached_free_blocks = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction (0..1) of usable blocks held by requests."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def block_counts(self) -> BlockCounts:
        """The usable blocks by state, from counts kept as blocks change (no scan)."""
        num_free = self.get_num_free_blocks()
        return BlockCounts(used=self.num_usable_blocks - num_free, cached_free=self.num_cached_free_blocks,
                           free=num_free - self.num_cached_free_blocks, total=self.num_usable_blocks)

    def block_states(self) -> list[tuple[int, bool]]:
        """``(ref_cnt, cached)`` of every block, by block id, block 0 (the null block, ref_cnt 1) included;
        ``cached``: the block holds a full block's hash, so a prefix can hit it. Scans the whole pool."""
        return [(block.ref_cnt, block.block_hash is not None) for block in self.blocks]

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash]) -> None:
        """Register full ``blocks`` under ``block_hashes`` (aligned) for prefix reuse.

        When another block already holds a hash (two requests computed the
        same prefix at once), the first one stays the cached copy.
        """
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, evicting their cached contents.

        Raises:
            ValueError: when fewer blocks are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.num_cached_free_blocks -= block.block_hash is not None
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; unreferenced blocks join the
        free queue in the given order (first given = first evicted)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                self.num_cached_free_blocks += block.block_hash is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible while no request holds blocks.

        Returns:
            True when reset, False when blocks are still in use.
        """
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free_blocks = 0
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop the cached prefix of ``block``, just taken from the free queue."""
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            self.num_cached_free_blocks -= 1
