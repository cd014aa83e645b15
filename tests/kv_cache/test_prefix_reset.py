"""reset_prefix_cache (new weights, or the KV memory released): no cached prefix is found
afterwards, in the pool or the host tier, and a request that held blocks across the reset
never publishes them."""
from __future__ import annotations

import torch

from tests.kv_cache.test_manager import admit, compute, make_manager, make_request
from tllm.kv_cache.manager import KVCacheManager


def test_reset_forgets_cached_prefixes_and_running_requests_publish_nothing():
    manager = make_manager(num_blocks=8)
    done = make_request(range(10))
    admit(manager, done)
    compute(manager, done, 10)
    manager.free(done)                        # 2 full blocks cached
    running = make_request(range(50, 60))
    admit(manager, running)
    compute(manager, running, 4)              # held across the reset
    manager.reset_prefix_cache()
    again = make_request(range(10))
    admit(manager, again)
    assert again.num_computed_tokens == 0     # nothing reused
    manager.free(again)
    compute(manager, running, 6)
    manager.free(running)
    after = make_request(range(50, 60))
    admit(manager, after)
    assert after.num_computed_tokens == 0     # its mixed-weights blocks were not published
    manager.free(after)
    assert manager.num_free_blocks == 8


def test_reset_clears_the_host_tier():
    manager = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4,
                             tokens_per_block=4, dtype=torch.float32, device="cpu",
                             host_cache_blocks=8)
    request = make_request(range(8))
    admit(manager, request)
    compute(manager, request, 8)
    manager.free(request)
    for _ in range(4):                        # evicted to the host tier
        manager.pool.allocate(1)
    assert len(manager.host_store) > 0
    manager.reset_prefix_cache()
    assert len(manager.host_store) == 0
