from __future__ import annotations

import itertools

import torch

from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request
from tllm.sampling_params import SamplingParams
from tllm.scheduler.interface import ScheduledBatch


def make_manager(num_blocks=8, block=4, reuse=True) -> KVCacheManager:
    return KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=num_blocks,
                          tokens_per_block=block, dtype=torch.float32, device="cpu",
                          enable_block_reuse=reuse)


_ids = itertools.count()  # the manager keys its state by request id


def make_request(prompt, max_new=4, **params) -> Request:
    return Request(f"r{next(_ids)}", list(prompt), SamplingParams(**params),
                   max_new_tokens=max_new)


def admit(manager, request) -> bool:
    """Admission as the scheduler does it: the manager answers, the scheduler writes."""
    admission = manager.try_admit(request)
    if admission is not None:
        request.num_computed_tokens = admission.num_computed_tokens
    return admission is not None


def compute(manager, request, num_tokens):
    """One step of `num_tokens` through the resource-manager hooks."""
    batch = ScheduledBatch([request], [num_tokens])
    assert manager.try_grow(request, num_tokens)
    manager.prepare(batch)
    request.num_computed_tokens += num_tokens
    manager.update(batch)


def test_admission_reserves_the_whole_generation():
    manager = make_manager(num_blocks=4)
    first = make_request(range(6), max_new=6)      # 12 tokens -> 3 blocks
    second = make_request(range(100, 106), max_new=6)
    assert admit(manager, first)
    compute(manager, first, 6)                     # holds 2 blocks, 1 more reserved
    assert not admit(manager, second)           # 1 unreserved block left, needs 3
    manager.free(first)
    assert admit(manager, second)
    manager.free(second)
    assert manager.num_free_blocks == 4


def test_prefix_blocks_are_reused():
    manager = make_manager()
    first = make_request(range(10))
    admit(manager, first)
    compute(manager, first, 10)
    second = make_request(list(range(8)) + [50, 51, 52])
    assert admit(manager, second)
    assert second.num_computed_tokens == 8 and manager.block_ids(second) == manager.block_ids(first)[:2]
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == manager.num_blocks


def test_last_prompt_token_is_always_recomputed():
    manager = make_manager()
    first = make_request(range(8))
    admit(manager, first)
    compute(manager, first, 8)
    same = make_request(range(8))
    admit(manager, same)
    assert same.num_computed_tokens == 4  # the block holding the last token is recomputed


def test_prompt_logprobs_skip_the_cache():
    manager = make_manager()
    first = make_request(range(10))
    admit(manager, first)
    compute(manager, first, 10)
    wants = make_request(range(10), prompt_logprobs=1)
    admit(manager, wants)
    assert wants.num_computed_tokens == 0


def test_free_of_a_never_admitted_request_is_harmless():
    manager = make_manager()
    manager.free(make_request(range(3)))
    assert manager.num_free_blocks == manager.num_blocks


def test_growth_is_promised_by_try_grow_and_allocated_by_prepare():
    manager = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=3,
                             tokens_per_block=4, dtype=torch.float32, device="cpu",
                             reserve_full_generation=False)
    first, second = make_request(range(4)), make_request(range(10, 14))
    assert admit(manager, first) and admit(manager, second)
    assert manager.try_grow(first, 4) and manager.try_grow(second, 4)   # 2 of 3 blocks
    assert manager.num_free_blocks == 3                                 # nothing allocated
    manager.prepare(ScheduledBatch([first, second], [4, 4]))
    assert manager.num_free_blocks == 1
    first.num_computed_tokens = second.num_computed_tokens = 4
    third = make_request(range(20, 23))
    assert admit(manager, third)
    assert manager.try_grow(third, 3)                                   # promised the last
    assert not manager.try_grow(first, 1)                               # none left for this
    manager.prepare(ScheduledBatch([third], [3]))
    assert len(manager.block_ids(third)) == 1 and manager.num_free_blocks == 0


def test_the_manager_reads_requests_and_never_writes_them():
    manager = make_manager()
    request = make_request(range(10))
    before = dict(vars(request))
    admission = manager.try_admit(request)
    manager.try_grow(request, 10)
    batch = ScheduledBatch([request], [10])
    manager.prepare(batch)
    manager.update(batch)
    manager.free(request)
    assert admission.num_computed_tokens == 0 and vars(request) == before
