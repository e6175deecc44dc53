"""Block pool, free queue and prefix-cache index in isolation."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.kv_cache_utils import ROOT_BLOCK_HASH, hash_block_tokens
from pagedserve.engine.request import Request
from pagedserve.engine.sampling_params import SamplingParams


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]
    assert queue.popleft().block_id == 0 and queue.num_free_blocks == 4
    for b in list(queue):
        queue.remove(b)
    with pytest.raises(ValueError):
        queue.popleft()


def test_block_zero_is_reserved_and_usage_counts_usable_blocks():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(2)
    assert {b.block_id for b in blocks} == {1, 2} and pool.get_usage() == 0.5
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_block_hash_is_chained_sha256():
    h1 = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3])
    assert len(h1) == 32
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(ROOT_BLOCK_HASH, [4, 5, 6])
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3], ("lora-1",)) != h1


def test_request_block_hashes_follow_appended_tokens():
    request = Request("r", list(range(20)), SamplingParams(), None, block_size=8)
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([1, 2, 3])
    assert len(request.block_hashes) == 2
    request.append_output_token_ids(4)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], request.all_token_ids[16:24])


def test_reset_prefix_cache_only_when_idle():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    request = Request("r", list(range(9)), SamplingParams(), None, block_size=4)
    assert manager.allocate_slots(request, 9) is not None
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    assert manager.reset_prefix_cache()
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(Request("s", list(range(9)), SamplingParams(), None, 4)) == ([], 0)


def test_allocation_failure_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    big = Request("big", list(range(16)), SamplingParams(), None, block_size=4)
    assert manager.allocate_slots(big, 16) is None
    assert manager.block_pool.get_num_free_blocks() == 3 and "big" not in manager.req_to_blocks


def test_prompt_logprobs_requests_get_no_cache_hits():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = Request("a", list(range(9)), SamplingParams(), None, block_size=4)
    manager.allocate_slots(first, 9)
    manager.free(first)
    asks = Request("b", list(range(9)), SamplingParams(prompt_logprobs=1), None, block_size=4)
    assert manager.get_computed_blocks(asks) == ([], 0)
    plain = Request("c", list(range(9)), SamplingParams(), None, block_size=4)
    assert manager.get_computed_blocks(plain)[1] == 8


def test_the_dashboard_s_views_count_blocks_by_state_and_owner():
    manager = KVCacheManager(num_blocks=10, block_size=4)  # 9 usable blocks
    first = Request("a", list(range(9)), SamplingParams(), None, block_size=4)
    second = Request("b", list(range(8)) + [99], SamplingParams(), None, block_size=4)
    manager.allocate_slots(first, 9)  # 3 blocks, the first 2 full and cached
    cached, num_cached_tokens = manager.get_computed_blocks(second)
    manager.allocate_slots(second, 1, num_cached_tokens, cached)  # shares those 2, and 1 of its own
    assert manager.num_blocks_of("a") == 3 and manager.num_blocks_of("b") == 3 and manager.num_blocks_of("x") == 0
    owners = manager.block_ids_by_request()
    assert owners["a"][:2] == owners["b"][:2] and len(set(owners["a"] + owners["b"])) == 4
    assert tuple(manager.block_pool.block_counts()) == (4, 0, 5, 9)
    manager.free(first)
    assert manager.block_pool.block_counts()._asdict() == {"used": 3, "cached_free": 0, "free": 6, "total": 9}
    manager.free(second)
    assert tuple(manager.block_pool.block_counts()) == (0, 2, 7, 9)
    states = manager.block_pool.block_states()
    assert len(states) == 10 and states[0] == (1, False)
    assert sorted(states[1:]).count((0, True)) == 2 and manager.block_ids_by_request() == {}


def run_to(manager: KVCacheManager, request: Request, num_tokens: int, chunk: int) -> None:
    """Schedule ``request`` as the scheduler would, ``chunk`` tokens a step, until ``num_tokens`` are computed."""
    while request.num_computed_tokens < num_tokens:
        step = min(chunk, num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, step) is not None
        request.num_computed_tokens += step


def test_a_sliding_window_gives_back_the_blocks_before_it_and_frees_the_rest_once():
    """Window 8, blocks of 4: a step whose first token sits at position p reads keys from p - 7 on, so the blocks
    wholly before p - 7 are given back (their places hold the null block), still cached; the rest is freed at the
    end, once."""
    manager = KVCacheManager(num_blocks=20, block_size=4, sliding_window=8)
    request = Request("r", list(range(3, 44)), SamplingParams(), None, block_size=4)
    run_to(manager, request, 41, chunk=5)  # the last step computes position 40 alone
    null = manager.block_pool.null_block
    # Before position 40 - 7 = 33: blocks 0-7 (positions 0-31) are given back; 8, 9 and 10 are held.
    assert manager.req_to_blocks["r"][:8] == [null] * 8 and null not in manager.req_to_blocks["r"][8:]
    assert manager.num_blocks_of("r") == 3 and manager.block_pool.get_num_free_blocks() == 19 - 3
    assert len(manager.block_ids_by_request()["r"]) == 3
    assert len(manager.block_pool.cached_block_hash_to_block) == 10  # the given-back blocks stay cached
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 19 and null.ref_cnt == 1


def test_a_hit_on_a_sliding_window_model_gives_back_the_hit_blocks_before_the_window():
    manager = KVCacheManager(num_blocks=20, block_size=4, sliding_window=8)
    first = Request("a", list(range(3, 43)), SamplingParams(), None, block_size=4)
    run_to(manager, first, 40, chunk=40)
    manager.free(first)
    second = Request("b", list(range(3, 43)) + [99], SamplingParams(), None, block_size=4)
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 40
    assert manager.allocate_slots(second, 1, num_hit_tokens, hits) is not None
    assert manager.num_blocks_of("b") == 3  # hits 8 and 9 and a new block 10 for position 40; 0-7 given back
    manager.free(second)
    assert manager.block_pool.get_num_free_blocks() == 19
