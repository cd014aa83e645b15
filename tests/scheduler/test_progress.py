"""The scheduler alone moves a request's progress: forward after a step, to zero on a
recompute preemption (kept on a swap), back by rejected tokens; held requests sit out."""
from __future__ import annotations

import pytest
import torch

from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request, RequestState
from tllm.sampling_params import SamplingParams
from tllm.scheduler.scheduler import Scheduler


def make_scheduler(num_blocks=64, reserve=True, host_blocks=0, mode="recompute", **kw):
    kv = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=num_blocks,
                        tokens_per_block=4, dtype=torch.float32, device="cpu",
                        reserve_full_generation=reserve, host_cache_blocks=host_blocks)
    return Scheduler(kv, max_batch_size=kw.get("max_batch_size", 8),
                     max_num_tokens=kw.get("max_num_tokens", 64),
                     enable_chunked_prefill=True, preemption_mode=mode)


def make_request(rid: str, num_prompt: int, max_new: int = 8) -> Request:
    start = 1000 + 100 * int(rid[1:])
    return Request(rid, list(range(start, start + num_prompt)), SamplingParams(),
                   max_new_tokens=max_new)


def run_step(scheduler, token=7):
    batch = scheduler.schedule()
    scheduler.kv_cache.prepare(batch)
    scheduler.advance(batch)
    scheduler.kv_cache.update(batch)
    for request in batch.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(token)
    return batch


def test_advance_moves_progress_by_the_scheduled_tokens():
    scheduler = make_scheduler(max_num_tokens=6)
    request = make_request("r0", 10)
    scheduler.add_request(request)
    batch = scheduler.schedule()
    assert request.num_computed_tokens == 0          # scheduling alone moves nothing
    scheduler.kv_cache.prepare(batch)
    scheduler.advance(batch)
    assert request.num_computed_tokens == 6
    assert request.state is RequestState.RUNNING


def test_admission_starts_progress_at_the_cached_prefix():
    scheduler = make_scheduler()
    first, second = make_request("r0", 10), make_request("r0", 10)
    second.request_id = "r1"
    scheduler.add_request(first)
    run_step(scheduler)
    scheduler.add_request(second)
    batch = scheduler.schedule()
    assert second.num_computed_tokens == 8           # two full blocks found in the cache
    assert dict(zip([r.request_id for r in batch.requests], batch.num_scheduled_tokens)) \
        == {"r0": 1, "r1": 2}


def test_recompute_preemption_resets_progress_and_requeues_first():
    # 5 blocks, no reservation: two 8-token prompts fill 4, growth preempts the newest
    scheduler = make_scheduler(num_blocks=5, reserve=False)
    old, new = make_request("r0", 8), make_request("r1", 8)
    scheduler.add_request(old)
    scheduler.add_request(new)
    run_step(scheduler)                                # both prompts: 4 blocks
    run_step(scheduler)                                # both grow into a 5th... one fits
    assert scheduler.num_preemptions == 1
    assert new.state is RequestState.WAITING and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new
    assert old.num_computed_tokens == 9


def test_swap_preemption_keeps_progress_and_restores_it():
    scheduler = make_scheduler(num_blocks=5, reserve=False, host_blocks=8, mode="swap")
    old, new = make_request("r0", 8), make_request("r1", 8)
    scheduler.add_request(old)
    scheduler.add_request(new)
    run_step(scheduler)
    run_step(scheduler)
    assert new.state is RequestState.WAITING and new.num_computed_tokens == 8
    scheduler.finish(old)
    scheduler.kv_cache.free(old)
    batch = scheduler.schedule()                       # swapped back in where it was
    assert batch.requests == [new] and batch.num_scheduled_tokens == [1]
    assert new.num_computed_tokens == 8


def test_rollback_forgets_rejected_tokens():
    scheduler = make_scheduler()
    request = make_request("r0", 5)
    scheduler.add_request(request)
    run_step(scheduler)
    for token in (11, 12, 13):                         # three drafted tokens, computed
        request.append_token(token)
    batch = scheduler.schedule()
    scheduler.kv_cache.prepare(batch)
    scheduler.advance(batch)
    assert request.num_computed_tokens == 9
    scheduler.rollback(request, 2)                     # the target rejected the last two
    del request.token_ids[-2:]
    assert request.num_computed_tokens == 7
    with pytest.raises(ValueError, match="roll back"):
        scheduler.rollback(request, 8)


def test_held_requests_sit_out_until_released():
    scheduler = make_scheduler()
    request = make_request("r0", 4)
    scheduler.add_request(request)
    batch = scheduler.schedule()
    scheduler.kv_cache.prepare(batch)
    scheduler.advance(batch, hold=True)
    request.append_token(7)                            # its token came back early
    assert scheduler.schedule().requests == []
    scheduler.release(batch)
    assert scheduler.schedule().requests == [request]
