"""Scheduling policies: the step token budget that serves running decodes first (every step
within its budget, decodes never skip a step while prefills wait), priority order (FCFS
within a level), and the lowest priority preempted first."""
from __future__ import annotations

import random

import pytest
import torch

from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request, RequestState
from tllm.sampling_params import SamplingParams
from tllm.scheduler.policy import PriorityWaitingQueue, SchedulingPolicy, check_priority
from tllm.scheduler.scheduler import Scheduler


def make_scheduler(policy=SchedulingPolicy(), max_batch_size=8, max_num_tokens=64,
                   num_blocks=256, reserve=True) -> Scheduler:
    kv = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=num_blocks,
                        tokens_per_block=4, dtype=torch.float32, device="cpu",
                        reserve_full_generation=reserve)
    return Scheduler(kv, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                     enable_chunked_prefill=True, policy=policy)


def make_request(rid: int, num_prompt: int, max_new: int = 8, priority: int = 0) -> Request:
    start = 1000 + 1000 * rid
    request = Request(f"r{rid}", list(range(start, start + num_prompt)), SamplingParams(),
                      max_new_tokens=max_new)
    request.priority = priority
    return request


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model ran; requests that sampled get a token, finished ones
    leave (their blocks freed)."""
    batch = scheduler.schedule()
    scheduler.kv_cache.prepare(batch)
    scheduler.advance(batch)
    scheduler.kv_cache.update(batch)
    for request in batch.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(7)
            if request.num_output_tokens >= request.max_new_tokens:
                scheduler.finish(request)
                scheduler.kv_cache.free(request)
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_scheduled_tokens)}


def is_decoding(request: Request) -> bool:
    return (request.state is RequestState.RUNNING
            and request.num_tokens - request.num_computed_tokens == 1)


def test_decodes_go_first_and_prefill_chunks_fill_the_budget():
    scheduler = make_scheduler(SchedulingPolicy(step_token_budget=16), max_num_tokens=64)
    scheduler.add_request(make_request(0, 40))   # a long prompt is running first
    scheduler.add_request(make_request(1, 4))
    assert run_step(scheduler) == {"r0": 16}
    scheduler.add_request(make_request(2, 4))
    assert run_step(scheduler) == {"r0": 16}
    assert run_step(scheduler) == {"r0": 8, "r1": 4, "r2": 4}
    # r1 and r2 decode; r0's last prompt token came with them
    assert run_step(scheduler) == {"r0": 1, "r1": 1, "r2": 1}


def test_without_a_budget_decodes_share_their_step_with_a_whole_chunk():
    """Today's default (the best throughput): a decode's step also computes up to
    max_num_tokens of prompt, so that token waits for the whole chunk; with a budget the
    step stays small and the prompt takes more, smaller chunks."""
    for policy, expected in ((SchedulingPolicy(), [{"r0": 1, "r1": 63}, {"r0": 1, "r1": 37}]),
                             (SchedulingPolicy(step_token_budget=16),
                              [{"r0": 1, "r1": 15}] * 6 + [{"r0": 1, "r1": 10}])):
        scheduler = make_scheduler(policy, max_num_tokens=64)
        scheduler.add_request(make_request(0, 4, max_new=20))
        run_step(scheduler)                        # r0 decodes from now on
        scheduler.add_request(make_request(1, 100))
        assert [run_step(scheduler) for _ in expected] == expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_step_within_budget_and_decodes_never_skip(seed):
    """Random arrivals of long and short prompts: each step stays within its budget, and
    every running decode is in every step while prompts wait or compute in chunks."""
    rng = random.Random(seed)
    budget = 24
    scheduler = make_scheduler(SchedulingPolicy(step_token_budget=budget), max_batch_size=6,
                               max_num_tokens=64)
    pending = [make_request(i, rng.choice([3, 9, 30, 70]), max_new=rng.randint(2, 12))
               for i in range(30)]
    num_steps, num_decodes = 0, 0
    while pending or scheduler.has_unfinished:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                scheduler.add_request(pending.pop(0))
        decoding = {r.request_id for r in scheduler.running if is_decoding(r)}
        prefilling = any(not is_decoding(r) for r in scheduler.running) or scheduler.waiting
        step = run_step(scheduler)
        assert sum(step.values()) <= budget
        if prefilling:
            assert decoding <= set(step), "a decode skipped a step while prefills waited"
            num_decodes += len(decoding)
        num_steps += 1
        assert num_steps < 1000
    assert num_decodes > 50  # the check saw decodes beside waiting prefills
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_decodes_are_never_cut_to_the_budget():
    """More decodes than the budget: all decode (prefills wait), within max_num_tokens."""
    scheduler = make_scheduler(SchedulingPolicy(step_token_budget=8), max_num_tokens=64)
    for i in range(4):
        scheduler.add_request(make_request(i, 2, max_new=20))
    assert run_step(scheduler) == {f"r{i}": 2 for i in range(4)}
    scheduler.policy = SchedulingPolicy(step_token_budget=2)
    scheduler.add_request(make_request(9, 8))
    for _ in range(3):
        assert run_step(scheduler) == {f"r{i}": 1 for i in range(4)}
    assert scheduler.waiting[0].request_id == "r9"


def test_drafts_share_what_the_budget_has_beyond_the_decodes():
    scheduler = make_scheduler(SchedulingPolicy(step_token_budget=8), max_num_tokens=64)
    requests = [make_request(i, 3) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler)
    for request in requests:
        request.draft_token_ids = [11, 12, 13, 14]
    scheduler.add_request(make_request(5, 20))
    # 3 decodes + 5 spare tokens: the first gets 4 drafts, the second 1, the third none
    assert run_step(scheduler) == {"r0": 5, "r1": 2, "r2": 1}


def test_priority_admits_the_lowest_value_first_fcfs_within_a_level():
    scheduler = make_scheduler(SchedulingPolicy(order="priority"), max_batch_size=1)
    levels = [3, 1, 2, 1, 0, 3]
    for i, level in enumerate(levels):
        scheduler.add_request(make_request(i, 2, max_new=1, priority=level))
    order = []
    while scheduler.has_unfinished:
        order += list(run_step(scheduler))
    assert order == ["r4", "r1", "r3", "r2", "r0", "r5"]


def test_priority_keeps_arrival_order_under_fcfs():
    scheduler = make_scheduler(max_batch_size=1)
    for i, level in enumerate([3, 1, 2]):
        scheduler.add_request(make_request(i, 2, max_new=1))
    order = []
    while scheduler.has_unfinished:
        order += list(run_step(scheduler))
    assert order == ["r0", "r1", "r2"]


def test_priority_preempts_the_lowest_priority_first():
    # 6 blocks, no reservation: three 8-token prompts fill 6; growth preempts one
    scheduler = make_scheduler(SchedulingPolicy(order="priority"), num_blocks=6,
                               reserve=False)
    low, high, mid = (make_request(0, 8, priority=5), make_request(1, 8, priority=0),
                      make_request(2, 8, priority=1))
    for request in (low, high, mid):
        scheduler.add_request(request)
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.num_preemptions == 1
    assert low.state is RequestState.WAITING and low.num_computed_tokens == 0
    assert high.num_computed_tokens == 9 and mid.num_computed_tokens == 9


def test_preempted_request_goes_back_behind_higher_priorities():
    queue = PriorityWaitingQueue()
    a, b, c = make_request(0, 2, priority=1), make_request(1, 2, priority=0), \
        make_request(2, 2, priority=1)
    for request in (a, b, c):
        queue.append(request)
    assert list(queue) == [b, a, c]
    assert queue.popleft() is b and queue.popleft() is a
    queue.appendleft(a)                            # preempted: by its key, not the front
    queue.appendleft(b)
    assert list(queue) == [b, a, c] and a in queue and len(queue) == 3
    queue.remove(a)
    assert list(queue) == [b, c]


def test_check_priority_names_the_argument():
    assert check_priority(None, "fcfs") == 0
    assert check_priority(0, "fcfs") == 0
    assert check_priority(-3, "priority") == -3
    with pytest.raises(ValueError, match="^priority: .*scheduling_policy='priority'"):
        check_priority(1, "fcfs")
    for bad in ("1", 1.5, True):
        with pytest.raises(ValueError, match="^priority: must be an integer"):
            check_priority(bad, "priority")


def test_a_budget_needs_chunked_prefill():
    kv = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8,
                        tokens_per_block=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="step_token_budget"):
        Scheduler(kv, max_batch_size=2, max_num_tokens=8, enable_chunked_prefill=False,
                  policy=SchedulingPolicy(step_token_budget=4))
