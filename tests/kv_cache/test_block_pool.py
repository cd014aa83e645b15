from __future__ import annotations

import pytest

from tllm.kv_cache.block_pool import BlockPool


def test_allocate_and_free_restore_the_pool():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.num_free_blocks == 0 and len(set(a + b)) == 8
    with pytest.raises(RuntimeError, match="out of blocks"):
        pool.allocate(1)
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8


def test_shared_block_is_freed_by_its_last_owner():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.cache_full_block(block, block_hash=123)
    assert pool.lookup(123) == block
    pool.take_cached(block)
    pool.free([block])
    assert not pool.is_free(block)
    pool.free([block])
    assert pool.is_free(block) and pool.lookup(123) == block  # free but still reusable


def test_reusing_a_free_cached_block_and_evicting_it():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache_full_block(block, block_hash=7)
    pool.free([block])
    pool.take_cached(block)               # a later request takes it back from the free list
    assert pool.num_free_blocks == 1 and pool.blocks[block].ref_count == 1
    pool.free([block])
    pool.allocate(2)                      # handing it out again drops its hash
    assert pool.lookup(7) is None


def test_least_recently_freed_block_is_evicted_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, block_hash=100 + i)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    pool.allocate(1)
    assert pool.lookup(101) is None and pool.lookup(100) is not None


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    pool.cache_full_block(block, 5)
    assert pool.lookup(5) is None


def test_empty_freed_blocks_go_out_first_then_fresh_then_cached():
    """Freed blocks holding nothing reusable are handed out before never-used ones (their
    memory is paged in), most recently freed first; cached blocks last."""
    pool = BlockPool(6)
    cached, empty_old, empty_new = pool.allocate(1), pool.allocate(1), pool.allocate(1)
    pool.cache_full_block(cached[0], block_hash=9)
    pool.free(cached)
    pool.free(empty_old)
    pool.free(empty_new)
    order = pool.allocate(6)
    assert order[:2] == empty_new + empty_old
    assert order[2:5] == [3, 4, 5] and order[5] == cached[0]
