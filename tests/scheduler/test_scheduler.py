from __future__ import annotations

import torch

from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request
from tllm.sampling_params import SamplingParams
from tllm.scheduler.scheduler import Scheduler


def make_scheduler(max_batch_size=4, max_num_tokens=16, chunked=True, num_blocks=64):
    kv = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=num_blocks,
                        tokens_per_block=4, dtype=torch.float32, device="cpu")
    return Scheduler(kv, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                     enable_chunked_prefill=chunked)


def make_request(rid, num_prompt, leader=None) -> Request:
    return Request(rid, list(range(1000 + 100 * int(rid[1:]), 1000 + 100 * int(rid[1:])
                                   + num_prompt)), SamplingParams(), max_new_tokens=8,
                   prefix_leader=leader)


def step(scheduler):
    """Schedule, then pretend the model ran and every finished prompt sampled a token."""
    batch = scheduler.schedule()
    scheduler.kv_cache.prepare(batch)
    scheduler.advance(batch)
    scheduler.kv_cache.update(batch)
    for request in batch.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(7)
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_scheduled_tokens)}


def test_long_prompt_is_chunked_within_the_budget():
    scheduler = make_scheduler(max_num_tokens=16)
    scheduler.add_request(make_request("r0", 40))
    assert [step(scheduler) for _ in range(4)] == [{"r0": 16}, {"r0": 16}, {"r0": 8}, {"r0": 1}]


def test_decodes_go_first_and_new_requests_fill_the_budget():
    scheduler = make_scheduler(max_num_tokens=16)
    scheduler.add_request(make_request("r0", 4))
    step(scheduler)
    scheduler.add_request(make_request("r1", 30))
    assert step(scheduler) == {"r0": 1, "r1": 15}   # in-flight batching


def test_batch_size_limit_queues_requests():
    scheduler = make_scheduler(max_batch_size=2, max_num_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 4))
    assert set(step(scheduler)) == {"r0", "r1"}
    assert len(scheduler.waiting) == 1
    finished = scheduler.running[0]
    scheduler.finish(finished)
    scheduler.kv_cache.free(finished)
    assert "r2" in step(scheduler)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(max_num_tokens=16, chunked=False)
    scheduler.add_request(make_request("r0", 10))
    scheduler.add_request(make_request("r1", 10))
    assert step(scheduler) == {"r0": 10}
    assert step(scheduler) == {"r0": 1, "r1": 10}


def test_parallel_samples_wait_for_their_leader_then_reuse_its_blocks():
    scheduler = make_scheduler(max_num_tokens=8)
    leader = make_request("r0", 12)
    follower = Request("r1", leader.prompt_token_ids, SamplingParams(), max_new_tokens=8,
                       prefix_leader=leader)
    scheduler.add_request(leader)
    scheduler.add_request(follower)
    assert step(scheduler) == {"r0": 8}            # follower held back
    assert step(scheduler) == {"r0": 4}            # leader finishes its prompt
    # 2 of the 3 prompt blocks come from the cache: the follower computes only 4 tokens
    assert step(scheduler) == {"r0": 1, "r1": 4}


def test_finish_returns_all_blocks():
    scheduler = make_scheduler()
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 9))
    step(scheduler)
    for request in list(scheduler.running) + list(scheduler.waiting):
        scheduler.finish(request)
        scheduler.kv_cache.free(request)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
