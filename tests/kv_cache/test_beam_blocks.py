"""Beams share KV blocks: a fork takes references on the parent's blocks and releases the
child's own; the shared block a beam writes next is copied on write (promised by try_grow,
copied by prepare) and never written in place; everything goes back to the pool."""
from __future__ import annotations

import torch

from tests.kv_cache.test_manager import admit, compute, make_manager, make_request
from tllm.scheduler.interface import ScheduledBatch


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    manager = make_manager(num_blocks=8, block=4, reuse=False)
    parent, child = make_request(range(6), max_new=4), make_request(range(6), max_new=4)
    assert admit(manager, parent) and admit(manager, child)
    compute(manager, parent, 6)  # two blocks, the second half full
    k, v = manager.kv_caches[0]
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    parent_blocks = list(manager.block_ids(parent))
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork([parent, child], [parent, parent])
    assert manager.block_ids(child) == parent_blocks == manager.block_ids(parent)
    assert [manager.pool.blocks[b].ref_count for b in parent_blocks] == [2, 2]
    assert manager.num_free_blocks == 8 - 2

    for request in (parent, child):
        request.append_token(7)
        assert manager.try_grow(request, 1)
    before = k[parent_blocks[1]].clone()
    manager.prepare(ScheduledBatch([parent, child], [1, 1]))
    tables = [manager.block_ids(parent), manager.block_ids(child)]
    assert [t[0] for t in tables] == [parent_blocks[0]] * 2    # the full block stays shared
    second = sorted(t[1] for t in tables)                      # the partial one: one holder
    assert parent_blocks[1] in second and len(set(second)) == 2  # keeps it, one has a copy
    copy = next(b for b in second if b != parent_blocks[1])
    assert torch.equal(k[copy], before) and torch.equal(v[copy], v[parent_blocks[1]])
    assert manager.pool.blocks[parent_blocks[0]].ref_count == 2
    assert manager.pool.blocks[parent_blocks[1]].ref_count == 1
    for request in (parent, child):
        manager.free(request)
    assert manager.num_free_blocks == 8


def test_a_beam_that_forks_from_another_drops_its_own_blocks():
    manager = make_manager(num_blocks=8, block=4, reuse=False)
    a, b = make_request(range(5), max_new=4), make_request(range(5), max_new=4)
    assert admit(manager, a) and admit(manager, b)
    compute(manager, a, 5)
    compute(manager, b, 5)
    assert manager.num_free_blocks == 8 - 4
    manager.fork([a, b], [b, b])  # both continue b: a's blocks go back to the pool
    assert manager.num_free_blocks == 8 - 2
    assert manager.block_ids(a) == manager.block_ids(b)
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8
